"""`cp`: context parallel (ring attention). Declined for now, with the reason."""

from __future__ import annotations

from ...errors import Unsupported
from ...golden.codec import Golden
from .protocol import Layout

NO_ENGINE = ("no engine runs it with an eager reference here: torch's context_parallel rewrites only the CUDA "
             "SDPA kernels (flash, efficient, cudnn) and cannot take a padding mask, and transformers 5's "
             "DistributedConfig reserves enable_sequence_parallel without wiring it up")


class ContextParallel(Layout):
    name = "cp"
    description = "context parallel (ring attention)"
    distributed = True

    def accept(self, golden: Golden, nproc: int) -> None:
        raise Unsupported(NO_ENGINE)


LAYOUT = ContextParallel()
