"""Item 4: a plugin is not told where it runs, and cannot parallelize the model itself.

    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item4_where.py:where --layout fsdp2
    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item4_where.py:own_fsdp2 --layout fsdp2

`where`: the backend gets only the model. It can ask torch.distributed for rank and world size, but
not which layout builds it (ddp, fsdp2, hsdp, tp, ep take different parallel states) nor the mesh the
layout will use; it skips saying what it learned. `own_fsdp2` shards the model the way a framework's
parallelize function does (VeOmni's `parallelize_model_fsdp2`): main's fsdp2 layout then shards it
again, ERROR "fully_shard has already been applied".
"""

import torch.distributed as dist

from veosnap import Unsupported


def where(model):
    if not dist.is_initialized():
        raise Unsupported("in process: layout single, packed or microbatch (not told which)")
    raise Unsupported(f"rank {dist.get_rank()} of {dist.get_world_size()}, backend {dist.get_backend()}; "
                      "layout, data-parallel size and device mesh: not told")


def own_fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model
