"""`sp`: sequence parallel. Declined for now, with the reason.

The protocol has what it needs: `wrap` may install an attention function that exchanges sequence
shards for head shards, `shard` may cut the golden's rows along positions (a Shard's positions say
which), and the engine puts each rank's tokens back where they belong.
"""

from __future__ import annotations

from ...errors import Unsupported
from ...golden.codec import Golden
from .cp import NO_ENGINE
from .protocol import Layout


class SequenceParallel(Layout):
    name = "sp"
    description = "sequence parallel"
    distributed = True

    def accept(self, golden: Golden, nproc: int) -> None:
        raise Unsupported(NO_ENGINE)


LAYOUT = SequenceParallel()
