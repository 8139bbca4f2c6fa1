"""Item 3: a generator backend's `finally` runs before a layout runs the model.

    veosnap check --model llama --dtype float32 --backend examples/veomni/repro/item3_generator_undone.py:patched --layout single --layout packed

main: single PASS; packed ERROR "the backend's patch was undone before the model ran": layouts.candidate_model
enters `backend.prepare(model)` and drops the context manager, so the generator is closed (its `finally`
runs) at once. The same in microbatch, ddp, fsdp2, hsdp, tp and ep, and for the built-in `liger`.
"""

import sys

ACTIVE = []


def patched(model):
    ACTIVE.append(True)
    print("patched", file=sys.stderr)

    def check(*_):
        print("layout runs the model", file=sys.stderr)
        if not ACTIVE:
            raise RuntimeError("the backend's patch was undone before the model ran")

    model.register_forward_pre_hook(check)
    try:
        yield model
    finally:
        ACTIVE.clear()
        print("restored", file=sys.stderr)
