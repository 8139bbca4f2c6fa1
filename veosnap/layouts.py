"""Layouts: how the golden's batch and model are split across rows, micro-batches and processes.

Every layout is checked against the same single-process golden. In-process layouts (`single`,
`packed`, `microbatch`) run here; multi-process ones (`ddp`, `fsdp2`, `hsdp`, `tp`, `ep`) start
`veosnap.distributed_worker` under torchrun, where each rank takes its share of the golden's batch and
rank 0 writes the gathered capture (full tensors and routes) to a safetensors file that this side
compares with `compare.compare`. A rank that fails or hangs ends the check with `report.error`
within the time limit: the whole process group is killed.

Loss weighting: the golden's loss is the mean over all the batch's predicted tokens, so a share of
the batch with n of the N predictions contributes `mean_share * n / N`; reducers that average over
W data-parallel ranks (DDP, FSDP2) get that contribution multiplied by W, so the reduced gradient is
the full-batch mean gradient.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch import nn

from .reference import hardware, inputs, models, train
from .backends import Backend, Unsupported
from .reference.capture import Capture
from .reference.probes import full as _full, record_layer_outputs
from .check import check, describe_failure, load_checked
from .compare import compare
from .runs.verdict import CheckReport
from .errors import VeosnapError
from .golden.codec import Golden
from .golden.key import GoldenKey
from .reference.inputs import IGNORE_INDEX, Batch
from .reference.probes import RouteRecord, record_routes, replay_routes
from .reference.zoo import Project, ToyConfig

DEFAULT_TIMEOUT_S = 600.0
END_GRACE_S = 10.0  # how long torchrun gets to end its ranks after a timeout
# Test-only: planted faults, `layout=fault[,layout=fault]`, so tests can prove each check catches them.
FAULT_ENV = "VEOSNAP_LAYOUT_FAULTS"
FAULTS = {
    "sum_grads": "gradients summed instead of averaged across data-parallel ranks",
    "swap_shard": "the last rank trains on the first rank's rows instead of its own",
    "no_restart": "a packed batch whose position ids run on instead of restarting per sequence",
    "die": "the last rank exits with status 17 before its step",
    "hang": "the last rank sleeps before its step (hangs the others in their first collective)",
    # train scenario only: bugs that leave every gradient right and the next parameters wrong
    "clip_micro": "gradients clipped after every micro-batch instead of once after accumulation",
    "clip_local": "gradients clipped by each rank's own shard norm instead of the global norm",
}


LocalRun = Callable[[nn.Module, Golden, "dict[int, torch.Tensor] | None"], Capture]


@dataclass(frozen=True)
class Layout:
    """One layout: its name, what it does, and whether it runs under torchrun."""

    name: str
    description: str
    distributed: bool = False
    moe_only: bool = False
    unsupported: str = ""  # why no engine runs it (reported as skipped)
    no_train: str = ""  # why it does not run the train scenario (reported as skipped)
    # In-process layouts: (model, golden, forced experts or None) -> a capture shaped like the golden's.
    run: LocalRun | None = None

    def skip_reason(self, golden: Golden, device_type: str, nproc: int = 2) -> str:
        """Why this layout does not apply to this golden here, or '' when it does."""
        if self.unsupported:
            return self.unsupported
        if self.no_train and golden.key.scenario == train.SCENARIO:
            return self.no_train
        if self.moe_only and not _is_moe(golden):
            return f"{golden.key.model} is a dense model: {self.name} shards experts, it has none"
        config = golden.manifest.config
        if self.name == "packed" and config.get("model_type") in NO_PACKING:
            return NO_PACKING[config["model_type"]]
        if self.name == "tp":  # transformers does not check this itself; it fails deep in a reshape
            heads = config.get("num_attention_heads", 0)
            for what, count in (("attention heads", heads), ("key/value heads", config.get("num_key_value_heads", heads))):
                if count % nproc:
                    return f"{nproc} tensor-parallel ranks do not divide {golden.key.model}'s {count} {what}"
        if self.name == "ep":
            experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), 0)
            if experts % nproc:
                return f"{nproc} expert-parallel ranks do not divide {golden.key.model}'s {experts} experts"
        return ""


# Model families whose transformers implementation cannot run packed sequences: checked anyway, they
# fail at ~1e5x bound from layers.0.output (sequences attend to each other), a transformers bug that
# no candidate can fix, so the cell says why instead of failing every support matrix.
NO_PACKING = {
    "gpt_oss": "transformers' GptOssModel builds its attention masks without position_ids, so packed sequences "
               "attend to each other (a transformers bug, seen with 5.24)",
}


def names() -> list[str]:
    """Every layout name, the reference `single` first."""
    return list(LAYOUTS)


def get(name: str) -> Layout:
    """The layout called `name`; a one-line error naming the known ones otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise VeosnapError(f"unknown layout {name!r} (known: {', '.join(LAYOUTS)})") from None


def _is_moe(golden: Golden) -> bool:
    return any(n.startswith("routes.") for n in golden.tensors)


def hsdp_mesh(world: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the HSDP mesh: shard over 2 where there are 4+ ranks, replicate the rest."""
    shard = 2 if world >= 4 and world % 2 == 0 else 1
    return world // shard, shard


def fault_for(layout: str) -> str:
    """The planted fault for `layout` from $VEOSNAP_LAYOUT_FAULTS (tests only), or ''."""
    text = os.environ.get(FAULT_ENV, "").strip()
    faults = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, fault = item.partition("=")
        if fault not in FAULTS:
            raise VeosnapError(f"{FAULT_ENV}: unknown fault {fault!r} in {item!r} (known: {', '.join(FAULTS)})")
        faults[name] = fault
    return faults.get(layout, "")


# ---------------------------------------------------------------------------------------------
# Shares of a batch and one weighted forward/backward; used here and by the distributed worker.


def predictions(batch: Batch) -> int:
    """How many tokens the causal-LM loss averages over (labels shifted by one, ignored ones out)."""
    return int((batch.labels[..., 1:] != IGNORE_INDEX).sum())


def rows(batch: Batch, index: torch.Tensor) -> Batch:
    """The rows `index` of a padded batch, at the batch's full width (so outputs map back by row)."""
    return Batch(*(t[index] for t in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.labels)))


def shard_rows(num_rows: int, world: int, rank: int) -> torch.Tensor:
    """The row indices rank `rank` of `world` data-parallel ranks trains on (contiguous, as even as can be)."""
    return torch.tensor_split(torch.arange(num_rows), world)[rank]


@dataclass
class Part:
    """What one forward/backward of a share of the batch produced (CPU tensors)."""

    loss: torch.Tensor  # this share's contribution to the full-batch mean loss
    logits: torch.Tensor
    layers: dict[int, torch.Tensor]
    routes: dict[int, RouteRecord] = field(default_factory=dict)


def run_part(model: nn.Module, inner: nn.Module, batch: Batch, total: int, grad_scale: float = 1.0,
             forced: dict[int, torch.Tensor] | None = None) -> Part:
    """Forward `batch` through `model` (a wrapper of `inner`, or `inner` itself), backward its loss weighted
    by its token share of `total` predictions times `grad_scale`; with `forced`, on those experts."""
    device = next(inner.parameters()).device
    batch = batch.to(device)
    share = predictions(batch) / total
    replay = replay_routes(inner, forced) if forced else nullcontext()
    with record_layer_outputs(inner) as layers, record_routes(inner) as routes, replay:
        output = model(**batch.model_kwargs(), use_cache=False)
    (output.loss * (share * grad_scale)).backward()
    logits = _full(output.logits.detach()).cpu()
    return Part(loss=(output.loss.detach().float() * share).cpu(), logits=logits, layers=dict(layers),
                routes=dict(routes))


def gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """`grad.<name>` of every trainable parameter, gathered to full tensors (a collective under DTensor)."""
    out = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            out[f"grad.{name}"] = _full(grad).detach().cpu()
    return out


def join(parts: list[Part], grads: dict[str, torch.Tensor]) -> Capture:
    """Parts covering consecutive rows, as one capture shaped like the golden's."""
    tensors = {"loss": sum(p.loss for p in parts), "logits": torch.cat([p.logits for p in parts])}
    for layer in sorted(parts[0].layers):
        tensors[f"layers.{layer}.output"] = torch.cat([p.layers[layer] for p in parts])
    routes = {}
    for layer in sorted(parts[0].routes):
        recs = [p.routes[layer] for p in parts]
        routes[layer] = RouteRecord(layer, *(torch.cat([getattr(r, f) for r in recs]) for f in ("experts", "weights", "margin")))
    return Capture(tensors={**tensors, **grads}, routes=routes)


def golden_routes(golden: Golden) -> dict[int, torch.Tensor]:
    """The golden's expert ids per MoE layer, [batch * seq, k]."""
    return {int(n.split(".")[1]): t.long() for n, t in golden.tensors.items() if n.endswith(".experts")}


def routes_differ(golden: Golden, routes: dict[int, RouteRecord], token_index: torch.Tensor) -> bool:
    """Whether any real token among the golden's flat positions `token_index` went to other experts."""
    mask = Batch.from_golden(golden).token_mask[token_index]
    for layer, experts in golden_routes(golden).items():
        rec = routes.get(layer)
        if rec is None or rec.experts.shape != experts[token_index].shape:
            return True
        if ((rec.experts != experts[token_index]).any(dim=-1) & mask).any():
            return True
    return False


def token_index(golden: Golden, row_index: torch.Tensor) -> torch.Tensor:
    """Flat [batch * seq] positions of the golden's rows `row_index`."""
    seq = Batch.from_golden(golden).input_ids.shape[-1]
    return (row_index[:, None] * seq + torch.arange(seq)).reshape(-1)


# ---------------------------------------------------------------------------------------------
# In-process layouts.


def _build(golden: Golden, toy: ToyConfig, backend: Backend, device: torch.device) -> nn.Module:
    model = models.build(toy, models.dtype_from_name(golden.key.dtype), device, golden.manifest.reference.seed)
    return candidate_model(backend, model)


def candidate_model(backend: Backend, model: nn.Module) -> nn.Module:
    """The backend's model, ready to train; a forward-only backend cannot be checked under a layout."""
    candidate = backend.prepare(model).__enter__()  # patches stay: the layout owns the model from here on
    if candidate.forward_only:
        raise Unsupported(f"{backend.spec} runs forward only here ({candidate.forward_only}); layouts check gradients")
    model = candidate.model
    model.train()
    model.zero_grad(set_to_none=True)
    return model


def run_microbatch(model: nn.Module, golden: Golden, forced: dict[int, torch.Tensor] | None,
                   after_part: Callable[[], object] | None = None) -> Capture:
    """Gradient accumulation over one-row micro-batches, each loss weighted by its token share
    (`after_part` runs after each micro-batch's backward: how a planted fault gets in)."""
    batch = Batch.from_golden(golden)
    total = predictions(batch)
    model.zero_grad(set_to_none=True)
    parts = []
    for row in range(batch.input_ids.shape[0]):
        index = torch.tensor([row])
        sub_forced = {k: v[token_index(golden, index)] for k, v in forced.items()} if forced else None
        parts.append(run_part(model, model, rows(batch, index), total, forced=sub_forced))
        if after_part is not None:
            after_part()
    return join(parts, gradients(model))


def run_packed(model: nn.Module, golden: Golden, forced: dict[int, torch.Tensor] | None) -> Capture:
    """The sequences in one row; token outputs and routes mapped back onto the golden's padded positions."""
    gb = Batch.from_golden(golden)
    real = gb.token_mask.nonzero().flatten()  # golden flat position of each packed token, in order
    sequences = [ids[m.bool()].tolist() for ids, m in zip(gb.input_ids, gb.attention_mask)]
    batch = inputs.packed(sequences)
    if fault_for("packed") == "no_restart":
        batch.position_ids = torch.arange(batch.input_ids.shape[1])[None]
    model.zero_grad(set_to_none=True)
    part = run_part(model, model, batch, predictions(batch),
                    forced={k: v[real] for k, v in forced.items()} if forced else None)
    grads = gradients(model)

    def unpack(name: str, packed_value: torch.Tensor) -> torch.Tensor:
        # Pads keep the golden's own values: only real tokens are compared.
        gold = golden.tensors[name]
        out = gold.clone().reshape(-1, *(gold.shape[-1:] if gold.ndim > 1 else ()))
        out[real] = packed_value.reshape(real.numel(), *out.shape[1:]).to(out.dtype)
        return out.reshape(gold.shape)

    tensors = {"loss": part.loss}
    if "logits" in golden.tensors:  # a train golden holds no logits or layer outputs: nothing to map them onto
        tensors["logits"] = unpack("logits", part.logits)
        for layer, hidden in part.layers.items():
            tensors[f"layers.{layer}.output"] = unpack(f"layers.{layer}.output", hidden)
    routes = {layer: RouteRecord(layer, unpack(f"routes.{layer}.experts", rec.experts).long(),
                                 unpack(f"routes.{layer}.weights", rec.weights),
                                 unpack(f"routes.{layer}.margin", rec.margin))
              for layer, rec in part.routes.items()}
    return Capture(tensors={**tensors, **grads}, routes=routes)


def _check_local(golden: Golden, toy: ToyConfig, backend: Backend, layout: Layout, fields: dict) -> CheckReport:
    device = hardware.device_for(hardware.detect())  # as `check` does: where this process runs
    if golden.key.scenario == train.SCENARIO:
        return _train_local(golden, toy, backend, layout, fields, device)

    def run() -> CheckReport:
        model = _build(golden, toy, backend, device)
        capture = layout.run(model, golden, None)
        replayed = None
        if _is_moe(golden) and routes_differ(golden, capture.routes, torch.arange(Batch.from_golden(golden).token_mask.numel())):
            replayed = layout.run(model, golden, golden_routes(golden))
        return compare(golden, capture, replayed=replayed, **fields)

    return _candidate_result(golden, fields, run)


def _candidate_result(golden: Golden, fields: dict, run: Callable[[], CheckReport]) -> CheckReport:
    """`run()`'s report; a backend's Unsupported is a skip and the candidate's own failure an error
    report (a bad golden or input still raises)."""
    try:
        return run()
    except VeosnapError:
        raise
    except Unsupported as exc:
        return _report(golden, fields, skipped=str(exc))
    except Exception as exc:  # noqa: BLE001 - the candidate's failure is a result
        return _report(golden, fields, error=describe_failure(exc))


def _train_local(golden: Golden, toy: ToyConfig, backend: Backend, layout: Layout, fields: dict,
                 device: torch.device) -> CheckReport:
    """The golden's optimizer steps, each step's forward and backward run by the layout."""
    hyper = golden.manifest.reference.train

    def run() -> CheckReport:
        model = _build(golden, toy, backend, device)
        step = layout.run
        if layout.name == "microbatch" and fault_for("microbatch") == "clip_micro":
            params = [p for p in model.parameters() if p.requires_grad]
            step = partial(run_microbatch, after_part=lambda: train.clip_global(params, hyper.max_norm))
        capture = train.train(model, hyper, train.of_capture(lambda: step(model, golden, None))).capture
        return train_report(golden, capture, fields)

    return _candidate_result(golden, fields, run)


def train_report(golden: Golden, capture: Capture, fields: dict, notes: list[str] = ()) -> CheckReport:
    """A train capture against its golden (routes first; later steps' routes are not recorded, so no replay)."""
    report = compare(golden, capture, **fields)
    report.notes.extend(notes)
    if not report.routes_passed:
        report.notes.append("routes differ in the first step: updates are compared without route replay")
    return report


def _report(golden: Golden, fields: dict, **kw: str) -> CheckReport:
    return CheckReport(golden=str(golden.key), model=golden.key.model, dtype=golden.key.dtype, **fields, **kw)


_NO_TRAIN = ("not wired for the train scenario yet: the worker's train loop runs the data-parallel layouts "
             "(ddp, fsdp2, hsdp); transformers' tensor/expert-parallel plans are checked on step only")
_CP_REASON = ("no engine runs it with an eager reference here: torch's context_parallel rewrites only the CUDA "
              "SDPA kernels (flash, efficient, cudnn) and cannot take a padding mask, and transformers 5's "
              "DistributedConfig reserves enable_sequence_parallel without wiring it up")

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("single", "the golden's padded batch in one process (the reference layout)"),
    Layout("packed", "the batch's sequences packed into one row, position ids restarting per sequence", run=run_packed),
    Layout("microbatch", "gradient accumulation over one-row micro-batches, each loss weighted by its token share",
           run=run_microbatch),
    Layout("ddp", "DistributedDataParallel, rows split across ranks", distributed=True),
    Layout("fsdp2", "FSDP2 fully_shard per decoder layer and root, rows split across ranks", distributed=True),
    Layout("hsdp", "FSDP2 fully_shard on a 2-D (replicate, shard) mesh; 2 ranks: (2, 1), 4 ranks: (2, 2)",
           distributed=True),
    Layout("tp", "transformers' tensor-parallel plan (DistributedConfig(tp_size=N)), full batch on every rank",
           distributed=True, no_train=_NO_TRAIN),
    Layout("ep", "transformers' expert parallel (DistributedConfig(ep_size=N, fsdp_size=N)), rows split, "
           "tokens dispatched all-to-all", distributed=True, moe_only=True, no_train=_NO_TRAIN),
    Layout("sp", "sequence parallel", distributed=True, unsupported=_CP_REASON),
    Layout("cp", "context parallel (ring attention)", distributed=True, unsupported=_CP_REASON),
)}


def register(layout: Layout) -> Layout:
    """Add an in-process layout (one with `run`); multi-process layouts need the distributed worker."""
    if layout.run is None and not layout.unsupported:
        raise VeosnapError(f"layout {layout.name!r}: a registered layout needs a run function")
    LAYOUTS[layout.name] = layout
    return layout


# ---------------------------------------------------------------------------------------------
# The public entry points.


def check_layout(project: Project, key: GoldenKey, backend: Backend, layout: str = "single", nproc: int = 2,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cross_class: bool = False) -> CheckReport:
    """Check `backend` under `layout` against the golden for `key`; report.layout is the layout's name.

    Multi-process layouts run `nproc` ranks under torchrun and are ended after `timeout_s` seconds.
    """
    return check_layouts(project, key, backend, [layout], nproc=nproc, timeout_s=timeout_s, cross_class=cross_class)[0]


def check_layouts(project: Project, key: GoldenKey, backend: Backend, layouts: list[str], nproc: int = 2,
                  timeout_s: float = DEFAULT_TIMEOUT_S, cross_class: bool = False) -> list[CheckReport]:
    """Check several layouts of one golden; all multi-process ones share one torchrun (one start-up)."""
    specs = [get(name) for name in layouts]
    golden, toy = load_checked(project, key, cross_class)
    device_type = hardware.device_for(hardware.detect()).type
    reports: dict[str, CheckReport] = {}
    spawned = []
    for spec in specs:
        fields = {"backend": backend.spec, "layout": spec.name}
        reason = spec.skip_reason(golden, device_type, nproc)
        if reason:
            reports[spec.name] = _report(golden, fields, skipped=reason)
        elif spec.name == "single":
            reports[spec.name] = check(project, key, backend, cross_class=cross_class, gold=golden)
        elif not spec.distributed:
            reports[spec.name] = _check_local(golden, toy, backend, spec, fields)
        else:
            spawned.append(spec.name)
    if spawned:
        _check_nproc(golden, device_type, nproc)
        reports.update(_check_spawned(project, golden, backend, spawned, nproc, timeout_s))
    return [reports[spec.name] for spec in specs]


def _check_nproc(golden: Golden, device_type: str, nproc: int) -> None:
    if nproc < 2:
        raise VeosnapError(f"--nproc {nproc}: multi-process layouts need at least 2 processes")
    num_rows = Batch.from_golden(golden).input_ids.shape[0]
    if nproc > num_rows:
        raise VeosnapError(f"--nproc {nproc}: the golden's batch has {num_rows} rows, one at least per rank")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise VeosnapError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) visible")


# torchrun's failure summary: a "rank : N (local_rank: M)" line followed by its "exitcode : S" line.
_RANK_EXIT_RE = re.compile(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.M)


def _check_spawned(project: Project, golden: Golden, backend: Backend, layouts: list[str], nproc: int,
                   timeout_s: float) -> dict[str, CheckReport]:
    for name in layouts:
        fault_for(name)  # a bad fault spec is bad input here, not a rank's crash
    with tempfile.TemporaryDirectory(prefix="veosnap-layouts-") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "veosnap.distributed_worker",
               "--goldens", str(project.goldens), "--configs", str(project.configs),
               "--testdata", str(project.testdata), "--hardware-class", golden.key.hardware_class,
               "--model", golden.key.model, "--dtype", golden.key.dtype, "--scenario", golden.key.scenario,
               "--backend", backend.spec, "--layouts", ",".join(layouts), "--out", str(out),
               "--timeout", str(timeout_s)]
        env = dict(os.environ)
        # The ranks import this very veosnap, and the backend's module wherever the parent found it.
        paths = [str(Path(__file__).resolve().parent.parent), *(p for p in sys.path if p and Path(p).is_dir())]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.setdefault("OMP_NUM_THREADS", "1")
        failure = _run_group(cmd, env, out, timeout_s)
        reports = {}
        ended_in = ""  # the first layout without a result is where the run ended; later ones never ran
        for name in layouts:
            fields = {"backend": backend.spec, "layout": name}
            result = out / f"{name}.safetensors"
            skip = out / f"{name}.skip"
            if skip.is_file():
                reports[name] = _report(golden, fields, skipped=skip.read_text(encoding="utf-8").strip())
            elif result.is_file():
                capture, replayed, notes = read_capture(result)
                if golden.key.scenario == train.SCENARIO:
                    reports[name] = train_report(golden, capture, fields, notes)
                    continue
                report = compare(golden, capture, replayed=replayed, **fields)
                report.notes.extend(notes)
                reports[name] = report
            elif ended_in:
                reports[name] = _report(golden, fields, error=f"not run: the ranks ended in layout {ended_in} before it")
            else:
                ended_in = name
                reports[name] = _report(golden, fields, error=failure or "the worker wrote no result")
        return reports


def _run_group(cmd: list[str], env: dict, out: Path, timeout_s: float) -> str:
    """Run torchrun in its own process group; '' when it succeeded, else why it did not (one line)."""
    log = out / "torchrun.log"
    started = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end(proc)
    text = log.read_text(encoding="utf-8", errors="replace")
    errors = {int(p.stem.removeprefix("error-rank")): p.read_text(encoding="utf-8").strip().splitlines()[0]
              for p in sorted(out.glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime_ns)}
    if code is None:
        first = next(iter(errors.values()), "")
        return f"timed out after {timeout_s:g} s (process group killed)" + (f"; {first}" if first else "")
    if code == 0:
        return ""
    return explain_failure(text, errors, code, time.monotonic() - started)


def explain_failure(log: str, errors: dict[int, str], code: int, seconds: float) -> str:
    """One line saying why a torchrun failed, from its log and the ranks' own error lines."""
    # A rank that died without writing why (killed, crashed, exited) is the cause; the others' errors
    # (a collective whose peer vanished) are its consequences, whatever order torchrun saw them in.
    # Ranks torchrun itself stopped once another failed end on a signal (negative status): those are
    # consequences too, so a rank that exited by itself comes first.
    exits = {int(m.group(1)): m.group(2) for m in _RANK_EXIT_RE.finditer(log)}
    silent = sorted((rank for rank in exits if rank not in errors), key=lambda r: (int(exits[r]) < 0, r))
    if silent:
        rank = silent[0]
        return f"rank {rank} exited with status {exits[rank]} after {seconds:.0f} s"
    # Otherwise torchrun names the first rank that failed, and its own message says why.
    root = _RANK_EXIT_RE.search(log, max(log.find("Root Cause"), 0))
    if root:
        rank, status = int(root.group(1)), root.group(2)
        return errors.get(rank) or f"rank {rank} exited with status {status} after {seconds:.0f} s"
    if errors:
        return next(iter(errors.values()))
    tail = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
    return f"torchrun exited with status {code}: {tail[0][:300]}"


def _end(proc: subprocess.Popen) -> None:
    """Nothing of a torchrun outlives the check, ranks stuck in a collective included.

    torchrun puts each rank in its own session, so killing its group is not enough: SIGTERM lets it end
    its ranks; SIGKILL follows, and ranks whose torchrun is gone die by their parent-death signal.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=END_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


REPLAYED = "replayed."


def write_capture(path: Path, capture: Capture, replayed: Capture | None, notes: list[str]) -> None:
    """The worker's result file: the capture's tensors and routes, and the replayed run's under `replayed.`."""
    from safetensors.torch import save_file

    tensors = {n: t.contiguous().clone() for n, t in capture.all_tensors().items()}
    if replayed is not None:
        tensors.update({REPLAYED + n: t.contiguous().clone() for n, t in replayed.all_tensors().items()})
    save_file(tensors, str(path), metadata={"notes": json.dumps(notes)})


def read_capture(path: Path) -> tuple[Capture, Capture | None, list[str]]:
    """Read what `write_capture` wrote."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        notes = json.loads((fh.metadata() or {}).get("notes", "[]"))
    tensors = load_file(str(path))
    main = {n: t for n, t in tensors.items() if not n.startswith(REPLAYED)}
    replayed = {n[len(REPLAYED):]: t for n, t in tensors.items() if n.startswith(REPLAYED)}
    return _capture_from(main), _capture_from(replayed) if replayed else None, notes


def _capture_from(tensors: dict[str, torch.Tensor]) -> Capture:
    routes = {}
    for name in [n for n in tensors if n.startswith("routes.") and n.endswith(".experts")]:
        layer = int(name.split(".")[1])
        routes[layer] = RouteRecord(layer, tensors[name].long(), tensors[f"routes.{layer}.weights"],
                                    tensors[f"routes.{layer}.margin"])
    return Capture(tensors={n: t for n, t in tensors.items() if not n.startswith("routes.")}, routes=routes)
