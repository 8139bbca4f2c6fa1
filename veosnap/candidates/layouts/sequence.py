"""Attention over a sequence sharded across ranks: what the `sp` (Ulysses) and `cp` (context parallel)
layouts share.

**Slicing.** `slice_positions` cuts every row of a batch (the golden's padded one, or the packed one)
into `world` contiguous position slices, one per rank, after padding the width to a multiple of
`world` (pad slots are masked, predict nothing, and stand for no golden position: -1 in the shard's
positions). Labels are shifted once for the whole row before slicing, so a slice's last position
predicts the next slice's first token, and the loss is normalised by the whole batch's prediction
count (`shift_labels` and `num_items_in_batch`, which transformers' causal-LM loss honours). A rank's
batch carries what its attention needs about the whole sequence (the full padding mask and position
ids), as a framework's sequence-parallel collator does (VeOmni precomputes `cu_seq_lens` the same way).

**Masks.** No rank builds a mask for its local slice: the model runs an attention implementation of
veosnap's that transformers has no mask function for (so it passes none), and the masks are built once
per forward for the whole sequence, by transformers' own `create_causal_mask` /
`create_sliding_window_causal_mask`, in the format of the attention implementation the candidate had
before (`eager`, `sdpa`, a backend's own): causal + padding, or block-diagonal per packed sequence.

**Attention.** `install(model, kind, group)` wraps the candidate's attention implementation:

- `ulysses`: q/k/v of the local positions are exchanged (all-to-all) into all positions for a subset
  of heads, the wrapped attention runs on the whole sequence with the full mask, and the output is
  exchanged back. Key/value heads that the world size does not divide are repeated to a multiple of it
  (as frameworks do); per-head parameters (attention sinks) are sliced to the rank's heads.
- `allgather_kv`: the local queries attend to keys and values all-gathered from every rank (the
  Llama-3 context-parallel scheme; a ring passing k/v blocks computes the same with less memory), with
  the full mask's rows of the rank's positions.

Every collective is autograd-aware, so the backward pass is right by construction.

**The exchange hook.** The all-to-all of `ulysses` is an `Exchange`: two functions with the signature
of VeOmni's `veomni.distributed.sequence_parallel.ulysses` ones, so a framework's plugin hands over its
own (see `use_exchange`):

    gather_seq_scatter_heads(x, seq_dim: int, head_dim: int, group: ProcessGroup) -> Tensor
        x holds this rank's positions of every head; returns every position of this rank's heads
        (heads split into world-size chunks in rank order, positions concatenated in rank order)
    gather_heads_scatter_seq(x, head_dim: int, seq_dim: int, group: ProcessGroup) -> Tensor
        the inverse: every position of this rank's heads -> this rank's positions of every head

Both are called with keyword arguments and must carry gradients (their backward is the other one).
"""

from __future__ import annotations

import inspect
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import Unsupported
from ...reference.inputs import IGNORE_INDEX, PAD_ID, Batch

# The extra model inputs a rank's batch carries for its attention (consumed before the model runs).
SEQUENCE_MASK = "sequence_attention_mask"
SEQUENCE_POSITIONS = "sequence_position_ids"
# Attention kinds whose whole-sequence mask transformers' masking utilities build.
MASK_KINDS = ("full_attention", "sliding_attention")
KINDS = ("ulysses", "allgather_kv")
NO_POSITION = -1  # a slot a layout added (padding): it stands for no golden position


# --- slicing ------------------------------------------------------------------------------------------


def padded_width(width: int, world: int) -> int:
    """The row width padded up to a multiple of `world`."""
    return -(-width // world) * world


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted once for whole rows: position p predicts the label of p + 1 (the last, nothing)."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


@dataclass(frozen=True)
class SequenceSlice:
    """One rank's slice of every row: its batch and, per token slot, the golden position (-1: padding)."""

    batch: Batch
    positions: torch.Tensor


def slice_positions(batch: Batch, positions: torch.Tensor, world: int, rank: int) -> SequenceSlice:
    """Rank `rank`'s contiguous slice of every row of `batch` (whose slots stand for golden `positions`).

    The width is padded to a multiple of `world` with pad tokens, masked out in a padded batch; their
    position ids restart at 0, so a packed batch sees them as one more sequence of their own. The slice's
    batch holds the local token grids, the local pre-shifted labels (`shift_labels`), the whole batch's
    prediction count (`num_items_in_batch`), and the whole rows' padding mask (when the batch has one)
    and position ids.
    """
    if batch.extra:
        raise Unsupported(f"slicing a batch with {', '.join(sorted(batch.extra))} along positions is not supported")
    rows, width = batch.rows, batch.width
    full = padded_width(width, world)
    pad = full - width

    def widen(grid: torch.Tensor, value: int | torch.Tensor) -> torch.Tensor:
        if not pad:
            return grid
        tail = value if isinstance(value, torch.Tensor) else torch.full((rows, pad), value, dtype=grid.dtype)
        return torch.cat([grid, tail.to(grid.dtype)], dim=1)

    ids = widen(batch.input_ids, PAD_ID)
    # A packed batch has no padding mask (its sequences are told apart by restarting position ids): its
    # pad slots become one more sequence of their own, which no real token attends to.
    packed = bool(batch.attention_mask.all())
    mask = widen(batch.attention_mask, 1 if packed else 0)
    pos = widen(batch.position_ids, torch.arange(pad).expand(rows, pad))
    labels = widen(batch.labels, IGNORE_INDEX)
    shifted = shift_labels(labels)
    where = widen(positions.reshape(rows, width), NO_POSITION)
    size = full // world
    cut = slice(rank * size, (rank + 1) * size)
    extra = {
        "shift_labels": shifted[:, cut].contiguous(),
        "num_items_in_batch": torch.tensor(int((shifted != IGNORE_INDEX).sum())),
        SEQUENCE_POSITIONS: pos,
    }
    if not packed:
        extra[SEQUENCE_MASK] = mask
    local = Batch(ids[:, cut].contiguous(), mask[:, cut].contiguous(), pos[:, cut].contiguous(),
                  labels[:, cut].contiguous(), extra=extra)
    return SequenceSlice(local, where[:, cut].reshape(-1).contiguous())


# --- the exchange hook --------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: object) -> torch.Tensor:
    """`x` cut into world-size chunks along `scatter_dim`, chunk j sent to rank j; what every rank sent
    here, concatenated along `gather_dim` in rank order (autograd-aware: the backward is the reverse)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split over {world} ranks")
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    received = funcol.all_to_all_single_autograd(send, None, None, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def gather_seq_scatter_heads(x: torch.Tensor, seq_dim: int, head_dim: int, group: object = None) -> torch.Tensor:
    """This rank's positions of every head -> every position of this rank's heads (one all-to-all)."""
    return _all_to_all(x, scatter_dim=head_dim, gather_dim=seq_dim, group=group)


def gather_heads_scatter_seq(x: torch.Tensor, head_dim: int, seq_dim: int, group: object = None) -> torch.Tensor:
    """Every position of this rank's heads -> this rank's positions of every head (one all-to-all)."""
    return _all_to_all(x, scatter_dim=seq_dim, gather_dim=head_dim, group=group)


@dataclass(frozen=True)
class Exchange:
    """The Ulysses all-to-all pair (see the module docstring for the contract)."""

    gather_seq_scatter_heads: Callable[..., torch.Tensor] = gather_seq_scatter_heads
    gather_heads_scatter_seq: Callable[..., torch.Tensor] = gather_heads_scatter_seq
    name: str = "veosnap all-to-all"


ULYSSES = Exchange()
_EXCHANGE_ATTR = "veosnap_sequence_exchange"


def use_exchange(model: nn.Module, exchange: Exchange) -> nn.Module:
    """Make `sp` exchange heads for positions with `exchange` on this model (call it from a backend)."""
    if not isinstance(exchange, Exchange):
        raise TypeError(f"{exchange!r}: an Exchange(gather_seq_scatter_heads=..., gather_heads_scatter_seq=...)")
    setattr(model, _EXCHANGE_ATTR, exchange)
    return model


def exchange_of(model: nn.Module) -> Exchange:
    """The exchange a backend set on `model`, else veosnap's own."""
    return getattr(model, _EXCHANGE_ATTR, None) or ULYSSES


# --- whole-sequence masks -----------------------------------------------------------------------------


class _ConfigAs:
    """A model config seen with another attention implementation (to build that implementation's masks)."""

    def __init__(self, config: object, implementation: str) -> None:
        self._config, self._attn_implementation = config, implementation

    def __getattr__(self, name: str) -> object:
        return getattr(self._config, name)


def _mask_builders() -> dict[str, Callable]:
    from transformers import masking_utils

    return {"full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask}


def _call_mask_builder(builder: Callable, **kwargs: object) -> object:
    # transformers renamed `past_key_values` to `cache` (5.2x); both are None here.
    params = inspect.signature(builder).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    kwargs[cache_arg] = None
    if "cache_position" in params:  # older 5.x releases still ask for it
        width = kwargs["inputs_embeds"].shape[1]
        kwargs["cache_position"] = torch.arange(width, device=kwargs["inputs_embeds"].device)
    return builder(**{k: v for k, v in kwargs.items() if k in params})


def layer_kinds(config: object) -> list[str]:
    """The attention kind of every decoder layer (`config.layer_types`, else all full attention)."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else ["full_attention"] * int(config.num_hidden_layers)


# --- the attention wrapper ----------------------------------------------------------------------------


class _HeadSlice:
    """An attention module seen by the wrapped attention function as holding only some of its heads:
    per-head parameters (attention sinks) sliced, the key/value grouping of the exchanged heads."""

    PER_HEAD = ("sinks",)

    def __init__(self, module: nn.Module, heads: slice, kv_groups: int) -> None:
        self._module, self._heads, self.num_key_value_groups = module, heads, kv_groups
        for name in self.PER_HEAD:
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value[heads])

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


@dataclass
class SequenceAttention:
    """The state of one model's sequence-sharded attention: its group, the wrapped implementation,
    and the whole-sequence masks of the forward in progress."""

    kind: str
    group: object
    world: int
    rank: int
    wrapped: str  # the attention implementation the candidate had (eager, sdpa, a backend's)
    exchange: Exchange = ULYSSES
    config: object = None
    kinds: list[str] = field(default_factory=list)
    masks: dict[str, object] = field(default_factory=dict)
    positions: torch.Tensor | None = None
    _pending: tuple | None = None

    def begin(self, mask: torch.Tensor | None, positions: torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> None:
        """A forward starts: remember the whole rows' padding mask and positions (masks built on demand)."""
        self.positions = positions.to(device)
        self.masks = {}
        self._pending = (None if mask is None else mask.to(device), dtype, device)

    def mask(self, module: nn.Module) -> object:
        """The whole-sequence mask of `module`'s layer, in the wrapped implementation's format."""
        kind = self.kinds[module.layer_idx] if self.kinds else "full_attention"
        if kind not in self.masks:
            mask, dtype, device = self._pending
            embeds = torch.empty(self.positions.shape[0], self.positions.shape[1], 0, dtype=dtype, device=device)
            self.masks[kind] = _call_mask_builder(
                _mask_builders()[kind], config=_ConfigAs(self.config, self.wrapped), inputs_embeds=embeds,
                attention_mask=mask, position_ids=self.positions,
                # The local queries of `allgather_kv` need every row of the mask: no is_causal shortcut.
                allow_is_causal_skip=self.kind == "ulysses")
        return self.masks[kind]

    def function(self, module: nn.Module) -> Callable:
        """The wrapped attention function, looked up at call time (a backend's patches count)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.wrapped == "eager":
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.wrapped]

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        if self.positions is None:
            raise RuntimeError("sequence-sharded attention called outside a layout's forward")
        kwargs["position_ids"] = self.positions  # flash-style kernels find packed sequences from them
        if self.kind == "ulysses":
            return self._ulysses(module, query, key, value, kwargs), None
        return self._allgather_kv(module, query, key, value, kwargs), None

    def _ulysses(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kwargs: dict) -> torch.Tensor:
        heads, kv_heads = query.shape[1], key.shape[1]
        repeat = math.lcm(kv_heads, self.world) // kv_heads
        if repeat > 1:  # key/value heads to a multiple of the world size, each query head keeping its own
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        ex, group = self.exchange, self.group
        q = ex.gather_seq_scatter_heads(query, seq_dim=2, head_dim=1, group=group)
        k = ex.gather_seq_scatter_heads(key, seq_dim=2, head_dim=1, group=group)
        v = ex.gather_seq_scatter_heads(value, seq_dim=2, head_dim=1, group=group)
        share = heads // self.world
        mine = slice(self.rank * share, (self.rank + 1) * share)
        if "s_aux" in kwargs and isinstance(kwargs["s_aux"], torch.Tensor):
            kwargs["s_aux"] = kwargs["s_aux"][mine]
        view = _HeadSlice(module, mine, q.shape[1] // k.shape[1])
        out, _ = self.function(module)(view, q, k, v, self.mask(module), **kwargs)  # [B, L, heads/W, D]
        return ex.gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=group)

    def _allgather_kv(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kwargs: dict) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        k = gather(key.contiguous(), 2, self.group)
        v = gather(value.contiguous(), 2, self.group)
        size = query.shape[2]
        mask = self.mask(module)
        if isinstance(mask, torch.Tensor) and mask.ndim == 4:
            mask = mask[:, :, self.rank * size:(self.rank + 1) * size, :]
        elif mask is not None:
            raise Unsupported(f"{self.wrapped} attention takes no dense mask; context parallel needs one")
        return self.function(module)(module, query, k, v, mask, **kwargs)[0]


_names = itertools.count()


def install(model: nn.Module, kind: str, group: object, world: int, rank: int) -> SequenceAttention:
    """Make `model` attend over a sequence sharded across `group` (in place), wrapping the attention
    implementation it has now. Its forward then takes a rank's `slice_positions` batch."""
    from transformers import AttentionInterface

    if kind not in KINDS:
        raise ValueError(f"unknown sequence attention {kind!r} (known: {', '.join(KINDS)})")
    config = model.config
    wrapped = config._attn_implementation or "eager"
    kinds = layer_kinds(config)
    unknown = sorted(set(kinds) - set(MASK_KINDS))
    if unknown:
        raise Unsupported(f"{', '.join(unknown)} layers: only {' and '.join(MASK_KINDS)} are sharded along positions")
    if kind == "allgather_kv" and wrapped.startswith("flash"):
        raise Unsupported(f"{wrapped} takes no dense mask for a slice of queries; context parallel needs one")
    state = SequenceAttention(kind, group, world, rank, wrapped, exchange_of(model), config, kinds)
    # One name per model: transformers passes no mask to an implementation it has no mask function for.
    name = f"veosnap_{kind}_{next(_names)}"
    AttentionInterface.register(name, state)
    model.set_attn_implementation(name)
    model.register_forward_pre_hook(_take_sequence_inputs(state, model), with_kwargs=True)
    return state


def _take_sequence_inputs(state: SequenceAttention, model: nn.Module) -> Callable:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        positions = kwargs.pop(SEQUENCE_POSITIONS, None)
        mask = kwargs.pop(SEQUENCE_MASK, None)
        if positions is None:
            raise RuntimeError(f"a sequence-sharded model needs {SEQUENCE_POSITIONS} (a slice_positions batch)")
        embed = model.get_input_embeddings().weight
        state.begin(mask, positions, embed.dtype, embed.device)
        return args, kwargs

    return hook
