"""`cp`: context parallel, the Llama-3 scheme: queries sharded by position, keys and values all-gathered.

Every rank holds a contiguous slice of every row's positions (the golden's padded rows, or with
`cp_packed` the packed row), sliced as `sp` slices them (`sequence.slice_positions`). Each layer's keys
and values are all-gathered from every rank (autograd-aware: the backward reduce-scatters their
gradients), and each rank's queries attend to all of them with its rows of the whole sequence's mask:
causal + padding, or block-diagonal per packed sequence. A ring passing key/value blocks from rank to
rank computes the same with less memory; the all-gather form is veosnap's because it is the simplest
that is right, and the check is of what the layout computes, not of its memory.

Unlike Ulysses, nothing here needs the world size to divide the heads, so `cp` runs on any number of
ranks (3 ranks: 32 positions padded to 33). It declines flash-attention backends, which take no dense
mask for a slice of queries. torch's own `context_parallel` (its ring SDPA) is no substitute here: it
rewrites only the CUDA SDPA kernels and takes `is_causal` but no mask, so neither the padded nor the
packed batch can run through it.
"""

from __future__ import annotations

from .sp import SequenceParallel


class ContextParallel(SequenceParallel):
    attention = "allgather_kv"

    def explain(self, state, model) -> str:  # noqa: ANN001
        return (f"keys and values all-gathered over {state.world} ranks, each rank's queries attending to all; "
                f"{state.wrapped} attention with the whole sequence's mask rows of its positions")


LAYOUT = ContextParallel("cp", "context parallel over every rank: queries sharded by position, keys and values "
                               "all-gathered, the golden's padded rows")
LAYOUTS = (
    LAYOUT,
    ContextParallel("cp_packed", "context parallel over every rank, the sequences packed into one row", packed=True),
)
