"""Item 8: rank 0 fails first, the report names another rank's death.

    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item8_rank_error.py:rank0_import --layout fsdp2

Rank 0 raises at once (as `from_pretrained(distributed_config=...)` does without `accelerate`); rank 1
gets further and waits in a collective until torchrun ends it. See CORE.md for what main reports.
"""

import time

import torch.distributed as dist


def rank0_import(model):
    if dist.is_initialized():
        if dist.get_rank() == 0:
            raise ImportError("Using a `distributed_config` requires `accelerate`: `pip install accelerate`")
        time.sleep(2)
        dist.barrier()
    return model
