"""The limits veosnap puts on a toy config, checked before anything runs: one line each, naming the file.

- The vocabulary holds every token of the golden's batch: `vocab_size` above the largest token id of
  the test data's sequences (250 for the bundled `testdata/sequences.parquet`, sequences 0-3).
- Positions reach the batch's width: `max_position_embeddings` at least the longest sequence (32).
- An MoE model's hidden size holds its routing code: the toy weights (`weights.py`) give each expert
  of the first MoE layer one hidden dimension of every token's embedding, so `hidden_size` must be
  at least the number of experts.

What transformers itself refuses (heads that do not divide the hidden size, say) is its own one-line
error, raised where the config is built (`models.hf_config`).
"""

from __future__ import annotations

from torch import nn

from ..errors import VeosnapError
from .inputs import Batch
from .probes import find_moe_layers
from .zoo import ToyConfig


def check_model(toy: ToyConfig, model: nn.Module) -> None:
    """What the toy weights need of the model's sizes (before they are drawn)."""
    moe = find_moe_layers(model)
    hidden = getattr(model.config, "hidden_size", None) or getattr(model.get_input_embeddings(), "embedding_dim", 0)
    if moe and moe[0].num_experts > hidden:
        raise VeosnapError(
            f"{toy.path}: hidden_size {hidden} is below the number of experts ({moe[0].num_experts}, top-"
            f"{moe[0].top_k}): veosnap's toy routers give each expert one hidden dimension of the token code, "
            f"so hidden_size must be at least {moe[0].num_experts}")


def check_batch(toy: ToyConfig, model: nn.Module, batch: Batch, source: str) -> None:
    """What the golden's batch (made from `source`) needs of the model: its tokens and positions."""
    vocab = model.get_input_embeddings().num_embeddings
    largest = int(batch.input_ids.max())
    if largest >= vocab:
        raise VeosnapError(
            f"{toy.path}: vocab_size {vocab} is too small for the test data: the golden's batch ({source}) holds "
            f"token ids up to {largest}, so vocab_size must be at least {largest + 1}")
    positions = getattr(model.config, "max_position_embeddings", None)
    longest = int(batch.position_ids.max()) + 1
    if isinstance(positions, int) and positions < longest:
        raise VeosnapError(
            f"{toy.path}: max_position_embeddings {positions} is below the longest sequence of the golden's batch "
            f"({longest} tokens, {source}); it must be at least {longest}")
