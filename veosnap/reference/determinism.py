"""Fixed CPU threads, deterministic algorithms, TF32 off: the same run gives the same numbers.

Recording under `deterministic()` makes a golden's bytes reproducible on one machine; checking under
it makes a report reproducible, even for kernels whose reductions otherwise vary from run to run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

RECORD_THREADS = 1  # a fixed thread count keeps CPU reductions, and so the bytes, reproducible


@contextmanager
def deterministic() -> Iterator[dict]:
    """Deterministic algorithms, fixed CPU threads, TF32 off; yields the settings (for provenance),
    restores the previous ones."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(RECORD_THREADS)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield {"deterministic_algorithms": True, "cpu_threads": RECORD_THREADS, "tf32": False}
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.set_num_threads(saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread within the block."""
    # Golden tensors are small: handing each op to a thread pool costs more than the op itself,
    # ten times more on a loaded 2-core machine (measured with tools/bench/bench_diff.py).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
