"""One forward and backward of a model on a batch, and every tensor a golden holds.

Uniform hook points only (see `probes`): the loss from the model's own forward with labels (so a
framework's fused loss is checked too), the logits, each decoder layer's output, each encoder block's
and projection's output (multimodal batches), every parameter's gradient, and each MoE block's routes.
`forward_backward` runs one batch (a layout may run several,
each weighted by its share of the loss); `run_step` is the golden's own step: the whole batch, once.

What is kept of each tensor is its `reduce.Reducer`'s choice: whole (a host copy), or a sketch made on
the tensor's device in the hook that sees it (layer outputs, logits) or parameter by parameter after
the backward (gradients), so a sketched tensor never goes to the host whole and no list of full
gradient copies is ever held. The loss and the routes are always whole.

What a candidate does not produce is said, not guessed: a model whose loss comes from hidden states
and the LM head weight (a fused or chunked loss) has no logits, an MoE block whose routes cannot be
read has none; `absent` names each such tensor and why, and a check reports it instead of comparing.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VeosnapError
from ..golden import names
from ..numerics.sketch import RowSketch, SketchProblem, TensorShape, zero_rows
from .inputs import IGNORE_INDEX, Batch
from .probes import (
    RouteRecord,
    decoder_layers,
    decoder_stack,
    find_moe_layers,
    full,
    host_copy_async,
    host_sync,
    record_encoder_outputs,
    record_layer_outputs,
    record_logits,
    record_routes,
    replay_routes,
)
from .reduce import WHOLE, Reducer, Rows


@dataclass
class Capture:
    """Named CPU tensors of one step (`loss`, `logits`, `layers.N.output`, `grad.<param>`, or a train
    run's), the routes by MoE layer, and the sketched tensors as the reducer kept them."""

    tensors: dict[str, torch.Tensor]
    routes: dict[int, RouteRecord] = field(default_factory=dict)
    backward: bool = True  # False: a forward-only run, no `grad.*` tensors
    # Sketched tensors: `GoldenSketch` (record), `CandidateSketch` (check, the float64 run), or a
    # `SketchProblem` (a candidate's tensor of another shape or dtype than the golden's).
    sketches: dict[str, object] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)  # tensors the model did not produce, and why
    notes: list[str] = field(default_factory=list)  # what a report must say about how it was captured

    def route_tensors(self) -> dict[str, torch.Tensor]:
        """Routes as named tensors: `routes.N.experts`, `routes.N.weights`, `routes.N.margin`."""
        out = {}
        for layer, rec in sorted(self.routes.items()):
            out[str(names.Route(layer, "experts"))] = rec.experts.to(torch.int32)
            out[str(names.Route(layer, "weights"))] = rec.weights
            out[str(names.Route(layer, "margin"))] = rec.margin.float()
        return out

    def all_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.tensors, **self.route_tensors()}

    def experts(self) -> dict[int, torch.Tensor]:
        """The expert ids chosen per MoE layer: [tokens, k] int64."""
        return {layer: rec.experts for layer, rec in self.routes.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], backward: bool = True,
                     absent: dict[str, str] | None = None) -> Capture:
        """What `all_tensors` gave (and `absent` said), back as a capture (sketches are carried separately)."""
        routes, rest = {}, {}
        for name, t in tensors.items():
            parsed = names.try_parse(name)
            if isinstance(parsed, names.Route):
                routes.setdefault(parsed.layer, {})[parsed.part] = t
            else:
                rest[name] = t
        records = {layer: RouteRecord(layer, parts["experts"].long(), parts["weights"], parts["margin"])
                   for layer, parts in routes.items()}
        return cls(tensors=rest, routes=records, backward=backward, absent=dict(absent or {}))


@dataclass
class Part:
    """What one forward (and backward) of a batch produced: the loss and routes on the CPU, the token
    tensors as the reducer kept them (a host copy, or a sketched tensor's `Rows` at the golden positions
    the pass was given). A pass run with `forward_backward(sync=False)` leaves its loss on the model's
    device, the backward not waited for."""

    loss: torch.Tensor  # the loss, times the batch's share of the golden's predictions
    logits: torch.Tensor | Rows | SketchProblem | None  # [rows, positions, vocab] when whole; None: see `absent`
    layers: dict[int, torch.Tensor | Rows | SketchProblem]  # decoder layer -> [rows, positions, hidden] when whole
    routes: dict[int, RouteRecord]  # MoE layer -> one route per token, row-major
    # golden name -> media kind -> [rows of the batch's media of that kind, ...]: encoder outputs (see
    # `by_media_kind`), always whole; a golden holds each name's kinds concatenated in `Media.KINDS` order
    encoders: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)  # tensors this pass did not produce, and why
    notes: list[str] = field(default_factory=list)  # e.g. MoE layers route replay could not force

    @property
    def unreadable(self) -> dict[int, str]:
        """MoE layers whose routes could not be read, and why."""
        return {parsed.layer: why for name, why in self.absent.items()
                if isinstance(parsed := names.try_parse(name), names.Route) and parsed.part == "experts"}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (shifted labels, mean over non-ignored) in the logits' own precision.

    HF upcasts logits to float32; the float64 noise run must not, or its loss would carry float32
    rounding into every gradient.
    """
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    shift_labels = labels[..., 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)


@contextmanager
def cross_entropy_in_logits_precision(model: nn.Module) -> Iterator[None]:
    """Within the block, `model` computes its loss with `causal_lm_loss` as its cross-entropy.

    Everything else the model adds to that loss, it still adds itself, by its own code: an MoE
    model's load-balancing loss (`output_router_logits`) is part of the noise run's loss exactly as
    it is part of the reference's, so a bug in it is measured against float64, not counted as noise.
    """
    had_own = "_loss_function" in vars(model)
    previous = vars(model).get("_loss_function")
    model.loss_function = lambda logits, labels, vocab_size=None, **kwargs: causal_lm_loss(logits, labels)
    try:
        yield
    finally:
        if had_own:
            model.loss_function = previous
        else:
            del model._loss_function


def auxiliary_loss(model: nn.Module) -> str:
    """What `model` adds to its cross-entropy, in words ('' for nothing).

    transformers' MoE models add a load-balancing loss over all the batch's real tokens when their
    config sets `output_router_logits` (times `router_aux_loss_coef`). It is not a sum over tokens:
    the loss of a batch split into parts is not the sum of the parts' losses.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return ""
    coef = getattr(config, "router_aux_loss_coef", None)
    return "a load-balancing loss" + (f" (router_aux_loss_coef {coef:g})" if coef is not None else "")


def forward_backward(model: nn.Module, batch: Batch, *, inner: nn.Module | None = None, share: float = 1.0,
                     grad_scale: float = 1.0, own_loss: bool = False, backward: bool = True,
                     forced: dict[int, torch.Tensor] | None = None, call: dict | None = None,
                     reducer: Reducer = WHOLE, positions: torch.Tensor | None = None, sync: bool = True) -> Part:
    """Forward `batch` through `model` and backward its loss weighted by `share * grad_scale`.

    `inner` is the HF model inside `model` (a DDP wrapper, say), where the hooks go; `share` is the
    batch's share of the golden's predictions (the returned loss is weighted by it); `grad_scale`
    undoes a reducer's averaging over ranks. With `own_loss`, the model's cross-entropy is taken in the
    logits' precision (the float64 noise run; its other loss terms are its own); without `backward`,
    only the forward runs, under no_grad; with `forced`, the routers are forced onto those experts
    (route replay). `call` is the model's keyword arguments when a candidate adapted the batch to its
    own form (default: the batch's own). `reducer` keeps the token tensors (whole, or sketched in the
    hooks); `positions` is the flat position in the golden's batch of each of this batch's token slots
    (None: this batch is the golden's). Without `sync`, nothing waits for the device after the backward:
    the loss stays there, and the host goes on queueing work behind the backward (a check's compare then
    reads everything at once). The forward's host copies (whole token tensors, routes, encoder outputs:
    read on the host next) are waited for before the backward instead, when the device has only the
    forward's end left to run and the host then runs ahead through the backward again.
    """
    inner = model if inner is None else inner
    batch = batch.to(next(inner.parameters()).device)
    kwargs = batch.model_kwargs() if call is None else call
    replay = replay_routes(inner, forced) if forced else nullcontext({})

    def keep(name: str, tensor: torch.Tensor) -> object:
        return reducer.keep_tokens(name, tensor, positions)

    precise = cross_entropy_in_logits_precision(inner) if own_loss else nullcontext()
    with record_layer_outputs(inner, keep) as layers, record_routes(inner) as routes, \
            record_logits(inner, keep) as produced, record_encoder_outputs(inner) as encoded, \
            replay as not_replayed, precise, torch.set_grad_enabled(backward):
        output = model(**kwargs, use_cache=False)
        logits = produced.get("logits")
        if logits is None and getattr(output, "logits", None) is not None:
            logits = keep("logits", full(output.logits.detach()))
        loss = output.loss
    weight = share * grad_scale
    if not sync and _host_copies(logits, layers, routes, encoded):
        host_sync(loss.device)
    if backward:
        (loss if weight == 1.0 else loss * weight).backward()
    reported = loss.detach() if share == 1.0 else loss.detach().float() * share
    if sync:
        reported = reported.cpu()
        host_sync(loss.device)  # the hooks' queued copies (that copy of the loss already waited for them)
    absent = {str(names.Route(layer, part)): why for layer, why in routes.unreadable.items()
              for part in ("experts", "weights")}
    absent.update({str(names.Route(layer, "margin")): why for layer, why in routes.no_margin.items()})
    if logits is None:
        absent[str(names.LOGITS)] = NO_LOGITS
    notes = [f"route replay could not force layer {layer} onto the golden's experts: {why}"
             for layer, why in sorted(not_replayed.items())]
    return Part(loss=reported, logits=logits, layers=dict(layers), routes=dict(routes),
                encoders=by_media_kind(encoded, batch), absent=absent, notes=notes)


def _host_copies(logits: object, layers: dict, routes: dict, encoded: dict) -> bool:
    """Whether a pass's hooks kept anything as a host copy (from a GPU, queued: valid only once the device has
    caught up): whole token tensors, routes, encoder outputs. Sketched rows (`Rows`) stay where they live."""
    return bool(routes) or bool(encoded) or any(isinstance(v, torch.Tensor) for v in (logits, *layers.values()))


NO_LOGITS = "not produced by the candidate (its loss is computed without logits: a fused or chunked loss)"


def by_media_kind(encoded: dict[str, list[torch.Tensor]], batch: Batch) -> dict[str, dict[str, torch.Tensor]]:
    """Each encoder hook point's calls, by the media kind each call ran: a tower runs once per kind its batch
    holds, in `Media.KINDS` order (a vision tower: the images, then the videos). Calls of an encoder the
    batch has no media for (a dummy forward that keeps ranks in step) are dropped."""
    kinds = batch.media.kinds if batch.media is not None else []
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, calls in encoded.items():
        encoder = names.parse(name).encoder  # type: ignore[attr-defined]
        mine = [kind for kind in kinds if batch.media.ENCODER[kind] == encoder]
        if not mine:
            continue
        if len(calls) != len(mine):  # not one call per kind: kept whole, under the first
            out[name] = {mine[0]: torch.cat(calls)}
            continue
        out[name] = dict(zip(mine, calls))
    return out


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """`grad.<name>` of every trainable parameter, on the CPU, gathered to full tensors (a collective
    under DTensor); a parameter without a gradient has a zero one."""
    return reduce_gradients(model, WHOLE)[0]


# What a post-accumulate-grad hook kept of a sketched gradient: the gradient tensor it saw, that tensor's
# version counter then, and its rows as `Reducer.keep_rows` kept them.
Accumulated = dict[str, tuple[torch.Tensor, int, object]]


@contextmanager
def sketched_as_accumulated(model: nn.Module, reducer: Reducer) -> Iterator[Accumulated]:
    """Inside: each gradient `reducer` sketches is reduced to its rows (`keep_rows`) the moment the backward
    has accumulated it, in a post-accumulate-grad hook, while the rest of the backward still runs. On a GPU
    the hooks' host work (~0.3 ms a gradient) is then hidden behind the device's backward instead of
    following it. Only for a backward that leaves every gradient final (one rank, the last pass of a step):
    `reduce_gradients` takes an entry only for the very gradient tensor the hook saw, at the same version
    (nothing replaced or changed it in place since), and reduces any other gradient as before. Sharded
    (DTensor) gradients are left to it."""
    kept: Accumulated = {}
    handles = []
    for param_name, param in model.named_parameters():
        name = str(names.Grad(param_name))
        if not param.requires_grad or reducer.spec(name) is None:
            continue

        def hook(parameter: torch.Tensor, name: str = name) -> None:
            grad = parameter.grad
            if grad is not None and getattr(grad, "placements", None) is None:
                kept[name] = (grad, grad._version, reducer.keep_rows(name, grad))

        handles.append(param.register_post_accumulate_grad_hook(hook))
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


def reduce_gradients(model: nn.Module, reducer: Reducer = WHOLE, accumulated: Accumulated | None = None,
                     host: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Every trainable parameter's gradient, parameter by parameter: (whole ones on the CPU, sketched
    ones as `reducer.finish` keeps them). Collectives under DTensor: call it on every rank. Without `host`,
    whole ones stay where they are (the gradients themselves, not copies) and nothing waits for the device:
    for a caller that compares them there, after the step (a check in process).

    A sketched gradient sharded by rows (FSDP2's `Shard(0)`) is sketched shard by shard where it lives,
    each rank's rows at their global index, and only the per-row sketches are gathered; any other
    DTensor is gathered to its full value first. A parameter without a gradient has a zero one. A gradient
    `accumulated` holds, unchanged since (`sketched_as_accumulated`), is not reduced again.
    """
    whole: dict[str, torch.Tensor] = {}
    sketched: list[tuple[str, object]] = []  # finished together, after the loop: tensors of a kind in one pass
    devices = set()
    for param_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = str(names.Grad(param_name))
        spec = reducer.spec(name)
        grad = param.grad
        if spec is None:
            value = full(grad if grad is not None else torch.zeros_like(param)).detach()
            if not host:
                whole[name] = value
                continue
            devices.add(value.device)
            whole[name] = host_copy_async(value) if value.is_cuda else value.cpu()  # one wait for all, below
        elif grad is None:
            sketched.append((name, Rows(zero_rows(spec, param.dtype, param.device), param.dtype)))
        elif _row_sharded(grad):
            sketched.append((name, _sharded_rows(reducer, name, grad, spec.rows)))
        elif (seen := (accumulated or {}).get(name)) is not None and seen[0] is grad and grad._version == seen[1]:
            sketched.append((name, seen[2]))
        else:
            sketched.append((name, reducer.keep_rows(name, full(grad))))
    kept = reducer.finish_all(sketched) if sketched else {}
    for device in devices:
        host_sync(device)
    return whole, kept


def _row_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor sharded along its first dimension over a 1-D mesh (FSDP2's parameters and gradients)."""
    placements = getattr(tensor, "placements", None)
    if placements is None or len(placements) != 1 or tensor.ndim == 0:
        return False
    from torch.distributed.tensor import Shard

    # Exactly Shard: a _StridedShard (tensor parallel's fused gate/up experts) is a Shard whose rows
    # are not one contiguous run per rank.
    return type(placements[0]) is Shard and placements[0].dim == 0


def _sharded_rows(reducer: Reducer, name: str, grad: torch.Tensor, rows: int) -> Rows | SketchProblem:
    """The per-row sketches of a `Shard(0)` DTensor, each rank sketching its own rows: offsets from the
    ranks' local sizes (all-gathered, prefix sums; no private DTensor API), then the small per-row
    sketches all-gathered and put in rank order. Bit-identical to sketching the full tensor."""
    import torch.distributed as dist

    group = grad.device_mesh.get_group()
    local = grad.to_local()
    sizes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, int(local.shape[0]), group=group)
    per_index = math.prod(local.shape[1:-1]) if local.ndim > 1 else 1  # rows per index of dimension 0
    offset = sum(sizes[: dist.get_rank(group)]) * per_index
    mine = reducer.keep_rows(name, local, row_offset=offset)
    pieces: list = [None] * len(sizes)
    dist.all_gather_object(pieces, mine.cpu() if isinstance(mine, Rows) else mine, group=group)
    problem = next((p for p in pieces if isinstance(p, SketchProblem)), None)
    if problem is not None:
        return problem
    values = torch.cat([p.sketch.values for p in pieces])
    if values.shape[0] != rows:
        return SketchProblem(f"{values.shape[0]} rows over the shards but golden {rows}")
    sumsq = torch.cat([p.sketch.sumsq for p in pieces])
    return Rows(RowSketch(values.to(local.device), sumsq.to(local.device)), pieces[0].dtype)


def run_step(model: nn.Module, batch: Batch, *, own_loss: bool = False, backward: bool = True,
             reducer: Reducer = WHOLE) -> Capture:
    """The golden's step: one forward and backward of `model` on the whole `batch`; everything captured.

    With `own_loss`, the model's cross-entropy is taken in the logits' precision (the float64 noise
    run); whatever else its loss holds (an MoE load-balancing loss), the model computes as always.
    Without `backward`, only the forward runs (under no_grad, for kernels that have no backward here)
    and no gradients are captured. `reducer` chooses what is kept of each tensor (whole, or sketched
    where it lives).
    """
    model.train()
    model.zero_grad(set_to_none=True)
    part = forward_backward(model, batch, own_loss=own_loss, backward=backward, reducer=reducer)
    _require_token_rows(model, part, tuple(batch.input_ids.shape))
    capture = Capture(tensors={str(names.LOSS): part.loss}, routes=part.routes, backward=backward,
                      absent=dict(part.absent))
    produced = {} if part.logits is None else {str(names.LOGITS): part.logits}
    produced.update({str(names.LayerOutput(index)): hidden for index, hidden in sorted(part.layers.items())})
    sketched = []
    for name, kept in produced.items():
        if reducer.spec(name) is None:
            capture.tensors[name] = kept
        else:
            sketched.append((name, kept))
    capture.sketches.update(reducer.finish_all(sketched))  # the layers' outputs: one kind, finished together
    # encoder outputs (rows of patches and frames, not of tokens) are always kept whole
    capture.tensors.update({name: torch.cat(list(calls.values())) for name, calls in part.encoders.items()})
    if backward:
        whole, sketched = reduce_gradients(model, reducer)
        capture.tensors.update(whole)
        capture.sketches.update(sketched)
    return capture


def _require_token_rows(model: nn.Module, part: Part, grid: tuple[int, ...]) -> None:
    """Refuse a model whose decoder layers' outputs are not one hidden vector per token of the batch (CPM-Ant
    prepends prompt positions of its own): a golden compares them token by token, on real tokens only."""
    for index, hidden in sorted(part.layers.items()):
        # DeepSeek-V4's layers carry several residual streams: [rows, positions, streams, hidden]
        if isinstance(hidden, torch.Tensor) and (hidden.ndim < 3 or tuple(hidden.shape[:2]) != grid):
            path = f"{decoder_stack(model)[0]}.{index}"
            raise VeosnapError(f"{type(model).__name__}: decoder layer {path} returns hidden states "
                               f"{list(hidden.shape)}, not one per token of the batch {list(grid)}, so veosnap "
                               "cannot compare its output token by token")


def step_shapes(model: nn.Module, batch: Batch) -> tuple[list[TensorShape], int]:
    """What `run_step` will capture, from shapes alone (before it runs, for the sketch planner): every
    compared tensor's shape and dtype, and the bytes of what is always whole and never compared
    (inputs, route ids and margins). The input embedding's gradient, when it is not the LM head's,
    is non-zero only on the batch's tokens: its support is bounded by them."""
    dtype = next(model.parameters()).dtype
    tokens = batch.input_ids.numel()
    head = model.get_output_embeddings()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(head.weight.shape[0]) if head is not None else int(config.vocab_size)
    grid = tuple(batch.input_ids.shape)
    shapes = [TensorShape(str(names.LOSS), (), "float32", sketchable=False),
              TensorShape(str(names.LOGITS), (*grid, vocab), _dtype_name(dtype))]
    shapes += [TensorShape(str(names.LayerOutput(i)), (*grid, int(config.hidden_size)), _dtype_name(dtype))
               for i in range(len(decoder_layers(model)))]
    embed = model.get_input_embeddings().weight
    untied = head is None or head.weight is not embed
    for param_name, param in model.named_parameters():
        if param.requires_grad:
            support = tokens if untied and param is embed else None
            shapes.append(TensorShape(str(names.Grad(param_name)), tuple(param.shape), _dtype_name(param.dtype),
                                      support_rows=support))
    fixed = sum(t.numel() * t.element_size() for t in batch.tensors().values())
    for moe in find_moe_layers(model):
        top_k = moe.top_k or 1  # a block that does not say its top-k: known once its routes are read
        shapes.append(TensorShape(str(names.Route(moe.layer, "weights")), (tokens, top_k), _dtype_name(dtype),
                                  sketchable=False))
        fixed += tokens * top_k * 4 + tokens * 4  # expert ids (int32), margins (float32)
    return shapes, fixed


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
