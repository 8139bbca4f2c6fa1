"""VeOmni's model as a veosnap candidate: `candidate()`, the generator every backend here is written with,
and the example's backends (examples/veomni/plugin.py serves them under `plugin.py:<name>`)."""

from __future__ import annotations

from typing import Iterator

from torch import nn

import veosnap
from veosnap import Candidate, Unsupported, parallelizes

from .core import (EAGER_PATH, families, import_veomni, load_reference, ops_config, packing_collator,
                   parallel_state, parallelized, registry_key, build, runs_here, with_pipeline_masks)
from .state import restored


def candidate(reference: nn.Module, ctx: veosnap.Context, ops=None, *, collator: bool = False,  # noqa: ANN001
              own_fsdp2: bool = False) -> Iterator[Candidate]:
    """VeOmni's model for `reference`'s config, for the layout `ctx` describes: a generator to `yield from`
    in a backend (`def mine(model, ctx): yield from candidate(model, ctx, ops_config(...))`).

    - `ops`: VeOmni's ops config (`ops_config(**overrides)`; default every op eager). Every op eager and no
      collator declares `Candidate(reference_path=EAGER_PATH)`: a bit-identical result is expected.
    - `collator=True`: the batch as VeOmni's `PackingCollator` makes it (`Candidate(adapt_batch=...)`).
    - `own_fsdp2=True`: VeOmni's own `build_parallelize_model` (meta init, its FSDP2, its weight loader),
      under the fsdp2 and hsdp layouts; mark the backend `@veosnap.parallelizes`.

    Builds inside `restored()`: VeOmni's parallel state set for the layout, then everything VeOmni changed
    (losses, ops config, kernel registry, op slots, fused-MoE pointers) put back when the check is done.
    Raises `veosnap.Unsupported` (a skip with the reason) where VeOmni is missing, has no model class for
    the reference, or has no path on this machine.
    """
    import_veomni()
    ops = ops_config() if ops is None else ops
    if registry_key(reference.config) is None:
        raise Unsupported(f"VeOmni has no model class for {reference.config.model_type!r} (its registry: "
                          f"{', '.join(families())})")
    with restored():
        parallel_state(ctx)
        model = parallelized(reference, ops, ctx) if own_fsdp2 else load_reference(build(reference, ops), reference)
        runs_here(model)
        model = with_pipeline_masks(model)
        yield Candidate(model, adapt_batch=packing_collator if collator else None,
                        reference_path=EAGER_PATH if ops == ops_config() and not collator else "")


def veomni(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's model class, every op eager (VeOmni's modeling code itself is checked)."""
    yield from candidate(model, ctx)


def veomni_sdpa(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's model class with transformers' SDPA attention."""
    yield from candidate(model, ctx, ops_config(attn_implementation="sdpa"))


def veomni_chunk_loss(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's chunked cross-entropy: the loss from hidden states and the LM head, no logits."""
    yield from candidate(model, ctx, ops_config(cross_entropy_loss_implementation="chunk_loss"))


def veomni_collator(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's model fed by VeOmni's packing collator (its production batch form)."""
    if model.config.model_type == "gpt_oss":  # the reason veosnap's own `packed` layout skips GPT-OSS
        raise Unsupported("eager attention cannot run GPT-OSS packed: transformers' GptOssModel builds its masks "
                          "without position_ids, so packed sequences attend to each other (VeOmni's production path "
                          "gives cu_seqlens to flash attention, a GPU kernel)")
    yield from candidate(model, ctx, collator=True)


@parallelizes
def veomni_fsdp2(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's own FSDP2 (`build_parallelize_model`) under veosnap's fsdp2 and hsdp layouts."""
    yield from candidate(model, ctx, own_fsdp2=True)


def veomni_ulysses(model: nn.Module) -> nn.Module:
    """The reference model, with VeOmni's own Ulysses all-to-all (`veomni.distributed.sequence_parallel.
    ulysses`) as the exchange of veosnap's `sp` layouts (other layouts run the reference unchanged): checks
    VeOmni's sequence-parallel communication, gradients included, against the single-process golden."""
    import_veomni()
    from veomni.distributed.sequence_parallel.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

    from veosnap.candidates.layouts.sequence import Exchange, use_exchange

    return use_exchange(model, Exchange(gather_seq_scatter_heads, gather_heads_scatter_seq,
                                        name="VeOmni's ulysses all-to-all"))
