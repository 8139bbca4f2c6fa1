"""`packed`: the batch's sequences in one row, position ids restarting per sequence, no attention mask
(transformers finds the sequences from the restarting positions). Token outputs go back to the golden's
padded positions; pads keep the golden's values and are never compared."""

from __future__ import annotations

from ...errors import Unsupported
from ...golden.codec import Golden
from ...reference import inputs
from ...reference.inputs import Batch
from .protocol import Layout, LayoutContext, Setup, Shard

# Model families whose transformers implementation cannot run packed sequences: checked anyway, they
# fail at ~1e5x bound from layers.0.output (sequences attend to each other), a transformers bug that
# no candidate can fix, so the cell says why instead of failing every support matrix.
NO_PACKING = {
    "gpt_oss": "transformers' GptOssModel builds its attention masks without position_ids, so packed sequences "
               "attend to each other (a transformers bug, seen with 5.24)",
    "deepseek_v4": "DeepSeek-V4's compressors cut windows at fixed positions of the row and its indexer sees every "
                   "earlier window: packed sequences would read each other's compressed entries (a property of "
                   "the architecture, not of a kernel)",
}


class Packed(Layout):
    name = "packed"
    description = "the batch's sequences packed into one row, position ids restarting per sequence"

    def accept(self, golden: Golden, nproc: int) -> None:
        model_type = golden.manifest.config.get("model_type")
        if model_type in NO_PACKING:
            raise Unsupported(NO_PACKING[model_type])

    def shard(self, ctx: LayoutContext, setup: Setup) -> list[Shard]:
        return [pack(ctx.batch)]


def pack(batch: Batch) -> Shard:
    """The batch's sequences packed into one row, each packed token at its golden position."""
    real = batch.token_mask.nonzero().flatten()  # the golden position of each packed token, in order
    return Shard(inputs.pack(batch), real)


LAYOUT = Packed()
