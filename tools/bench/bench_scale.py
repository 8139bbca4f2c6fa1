"""Goldens and checks at scale: bytes, times and memory from the toy zoo to about 1B parameters.

For each size (a zoo family at real widths, few layers, long sequences) and dtype it records a golden
with `--sketch auto` and checks a candidate against it, and prints one table:

    params, tokens      the model and the golden's batch (4 rows, left-padded)
    golden              bytes on disk (the target is 16 MiB, the hard limit 64 MiB)
    record              wall time of `veosnap record` (two model builds, the reference, its float64 twin)
    build               one model build with deterministic weights (not veosnap's own work, but a check waits for it;
                        on the prebuild thread in a check)
    cand f+b            the candidate's forward and backward alone (no hooks), median of 3, warm
    eager f+b           the eager reference's (the slowest candidate; the issue's own figures were eager's)
    check               a whole `veosnap check` (after the record and the candidate alone: its Triton kernels are
                        compiled and cuBLAS is warm, as for a user's check after the first)
    own                 veosnap's own time in that check, on its critical path (the main thread): the sum of
        load / head / wait          reading the file; decoding its head (the manifest and the batch:
                                    golden.background); waiting for the decode thread where the golden's
                                    tensors are first used (after the model build)
        setup                       before the candidate runs: reading the config, the limits (config, batch,
                                    memory), the golden's coverage of the model (a meta-device skeleton), the
                                    version drift
        reduce (grads)               capture's hooks and gradient pass: sketches, host copies of whole tensors
                                     (in brackets: the gradient pass alone). On a GPU the last pass's gradients
                                     are sketched in the backward's hooks, on the autograd engine's thread: shown
                                     as "+ N in the backward's hooks", host time there, not in own
        routes / assemble            the route hooks (experts, weights, margins of each MoE block); the capture
                                     put together from the passes, and the route comparison that decides replay
        compare / report             every tensor against the golden; the text report (what `veosnap check`
                                     prints; `--format json` renders JSON instead)
                        A check builds its model on a thread from its start (reference.prebuild): load, head
                        and setup then run while it builds, "(with the build)" in their cells, and are not in
                        own when the check waited for that build (they were off the critical path)
    rest                check - build - cand f+b - own: what no phase covers, and the noise of timing the
                        candidate apart (it can come out negative). The phases are timed with a device sync
                        around each (hooks included), which itself costs the overlap of host and device
    plain check         the same check with nothing timed but the build (no syncs added): what a user waits
    build from          in the plain check, from its start to its model build's start (the build runs on its own
                        thread from the check's start, once the limits allow it: this much is on the path)
    build alone/plain   one build with nothing else running (the candidate's own, before the checks) / the plain
                        check's build (on its thread, beside the check's reading and setup): a build slowed by
                        them (the GIL) would show here, and e2e would then hide that much of veosnap's own time
    e2e own/f+b         (plain check - build - cand f+b) / cand f+b: everything veosnap adds, end to end, as a
                        user sees it (no phase split; includes `rest` and the noise of cand f+b). The build left
                        out is the model's own: the prebuild's vetting inside it (the limits and coverage on the
                        model as constructed, `vet` in the path table) is counted as veosnap's
                        With --plain N, the median of N plain checks, and their range in brackets
    e2e first           (--first-check) the same for one more plain check run before the timed one: the first check
                        of this size in the process (for the first size: of the process, as a `veosnap check` run
                        from the shell; the candidate alone has run before it), so its first-use costs (CUDA's lazy
                        loading of each kernel at its first launch, first pinned allocations) fall there and not in
                        the timed check's phases
    cand first f+b      the candidate's first step alone, its allocator holding only the weights (its activations'
                        and gradients' first allocation), but also the libraries' first calls in the process (cuDNN's
                        plan search: 2.8 s for llama-hd128 on the H200), which a check after it does not pay: not a
                        figure to subtract from a check (an "e2e own (cold)" column that did came out negative)
    own/f+b             the issue's target: <= 0.25 on the H200 at ~1B parameters (aim 0.1); own/eager likewise
    decode off path     zstd decompress / safetensors parse + hashes + validation, on the decode thread while
                        the model is built (not in own: only `wait` is)
    serial own          (not with --no-serial) the same check again with the golden read and decoded first, on the
                        main thread (as before the decode thread; in brackets its decompress / parse), and
                        its ratio to cand f+b: what the overlap saves
    peak                GPU: torch.cuda.max_memory_allocated during the check / during the candidate alone;
                        CPU: resident set size, sampled, same two phases
    sketch GB/s         the row-sketch kernel on a logits-shaped tensor, against a copy's GB/s (read + write)

    python tools/bench/bench_scale.py                       # the sizes for this machine (CPU: up to ~0.1B)
    python tools/bench/bench_scale.py --sizes toy,llama-17m  # the CPU breakdown at a small width (about 2 minutes)
    python tools/bench/bench_scale.py --sizes toy,llama-1b --dtypes bfloat16 --budget-s 480
    OUT=/tmp/out python tools/bench/bench_scale.py          # also writes $OUT/bench_scale.json and .md
    python tools/bench/bench_scale.py --profile             # and one more check of the last size (bfloat16) under
                                                      # torch.profiler: $OUT/profile.md (+ trace, when small)

`--profile` summarizes that check as three tables: veosnap's own stages (record_function ranges around the
check's phases and the engine's steps: calls, host ms, device ms), the top operators by host self time
(syncs and copies show here as cudaStreamSynchronize / cudaMemcpyAsync) and by device self time.

Sizes are real widths with few layers (docs/scale.md lists them); test data is generated (random
tokens, seeded) into a scratch project, so nothing in the repository is touched. Routers at 128 experts
may have near-ties at 8k tokens: the benchmark records with --allow-near-ties (it measures cost, not
routing). On CUDA, TF32 is off (veosnap's deterministic settings) in every phase.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import veosnap.golden.background as background_module  # noqa: E402
import veosnap.golden.codec as codec_module  # noqa: E402
import veosnap.golden.store as store_module  # noqa: E402
import veosnap.numerics.compare as numerics_compare_module  # noqa: E402
import veosnap.reference.coverage as coverage_module  # noqa: E402
import veosnap.reference.limits as limits_module  # noqa: E402
import veosnap.reference.models as models_module  # noqa: E402
import veosnap.reference.prebuild as prebuild_module  # noqa: E402
import veosnap.reference.probes as probes_module  # noqa: E402
import veosnap.reference.zoo as zoo_module  # noqa: E402
import veosnap.runs.check as check_module  # noqa: E402
from veosnap.candidates import backends  # noqa: E402
from veosnap.errors import GoldenError, Unsupported  # noqa: E402
from veosnap.golden import store  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.numerics.sketch import rowsketch  # noqa: E402
from veosnap.reference import hardware  # noqa: E402
from veosnap.reference.determinism import deterministic  # noqa: E402
from veosnap.reference.inputs import Batch  # noqa: E402
from veosnap.reference.reduce import CandidateReducer, Reducer  # noqa: E402
from veosnap.reference.zoo import Project, load_config  # noqa: E402
from veosnap.render import text as render_text  # noqa: E402
from veosnap.runs.record import build_golden, encode_checked  # noqa: E402

console = Console(width=220)
CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Size:
    """A zoo family at real widths: the toy config with these fields replaced, and its batch."""

    name: str
    family: str  # the toy config it starts from
    fields: dict
    row_tokens: tuple[int, ...] = ()  # lengths of the 4 sequences (4 left-padded rows); () the zoo's own
    candidate: tuple[str, ...] = ("sdpa",)  # backend specs, the first that runs is used


LLAMA_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Llama-3.2-1B's widths at 4 layers (the H200 sizes start from it).
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rope_parameters": LLAMA_ROPE}
SIZES = {s.name: s for s in (
    Size("toy", "qwen3_moe", {}, candidate=("sdpa+grouped_mm", "sdpa")),
    Size("llama-17m", "llama", {"hidden_size": 512, "intermediate_size": 1408, "head_dim": 64,
                                "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
                                "vocab_size": 12000, "max_position_embeddings": 8192},
         row_tokens=(384, 380, 384, 360)),
    Size("qwen3_moe-60m", "qwen3_moe", {"hidden_size": 512, "intermediate_size": 1536, "head_dim": 64,
                                        "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 2,
                                        "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 384,
                                        "vocab_size": 32000, "max_position_embeddings": 8192},
         row_tokens=(256, 250, 256, 240), candidate=("sdpa+grouped_mm", "sdpa")),
    Size("llama-0.1b", "llama", {"hidden_size": 1024, "intermediate_size": 2816, "head_dim": 128,
                                 "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                 "vocab_size": 32000, "max_position_embeddings": 131072,
                                 "rope_parameters": LLAMA_ROPE},
         row_tokens=(512, 500, 512, 480)),
    # The H200 sizes: real widths (Llama-3.2-1B, Qwen3-30B-A3B), few layers, 8k tokens.
    Size("llama-1b", "llama", LLAMA_1B, row_tokens=(2048, 2040, 2048, 2000)),
    Size("llama-hd128", "llama", {**LLAMA_1B, "head_dim": 128, "num_attention_heads": 16},
         row_tokens=(2048, 2040, 2048, 2000)),
    # Llama-3.2-1B's own config (tied embeddings) at 12 of its 16 layers: 1.0B parameters, most of them in the
    # layers, as in the models users train (all 16 need ~142 GiB to record with the float64 twin, by veosnap's
    # estimate: over the H200's 140).
    Size("llama-1b-12l", "llama", {**LLAMA_1B, "num_hidden_layers": 12, "rms_norm_eps": 1e-5,
                                   "tie_word_embeddings": True, "rope_parameters": {**LLAMA_ROPE, "factor": 32.0}},
         row_tokens=(2048, 2040, 2048, 2000)),
    # llama-1b-12l's structure (12 layers, tied, rope) at a narrow width: the check's per-module host cost on a CPU.
    Size("llama-12l-narrow", "llama", {**LLAMA_1B, "hidden_size": 256, "intermediate_size": 512, "head_dim": 32,
                                       "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 12,
                                       "vocab_size": 8000, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                                       "rope_parameters": {**LLAMA_ROPE, "factor": 32.0}},
         row_tokens=(128, 120, 128, 100)),
    Size("qwen3_moe-1b", "qwen3_moe", {"hidden_size": 2048, "intermediate_size": 6144, "head_dim": 128,
                                       "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 1,
                                       "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                       "vocab_size": 151936, "max_position_embeddings": 40960},
         row_tokens=(2048, 2040, 2048, 2000), candidate=("sdpa+grouped_mm", "sdpa")),
)}
DEFAULT_SIZES = ("toy", "llama-hd128", "qwen3_moe-1b") if CUDA else ("toy", "llama-17m", "qwen3_moe-60m", "llama-0.1b")
DEFAULT_DTYPES = ("float32", "bfloat16")


# --- timing and memory ---------------------------------------------------------------------------------


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Phases:
    """Accumulated seconds per phase while `active` (wrapped functions add to it)."""

    active: Phases | None = None
    probe: GilProbe | None = None  # --gil-probe: read at the build's start and end (`build_late`)

    def __init__(self, only: set[str] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.only = only  # the phases timed (None: all); the others run as if untimed (no sync)
        self.t0 = time.perf_counter()  # the check's start (`one_check` sets it)
        self.build_from = 0.0  # seconds from the check's start to the start of its model's build
        self.build_end = 0.0  # ... to its end
        # The plain check's path (`marked`): label, host seconds from t0 at entry and at exit, and CUDA events
        # recorded there (None on the CPU), read once the check is over.
        self.marks: list[tuple[str, float, float, object, object]] = []
        self.t0_event = None  # a CUDA event at t0 (the device idle then): device times on the host's clock
        self.build_late = 0.0  # the GIL probe's lateness during the build (`gil_held_during_builds`)
        self.collections: list[tuple[int, float]] = []  # Python's garbage collections in the check: (generation, s)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def get(self, phase: str) -> float:
        return self.seconds.get(phase, 0.0)


_DEPTH = threading.local()  # one depth for every wrapper: a phase inside another is counted once


def timed(phase: str, fn: Callable, nested: bool = False, host: bool = False) -> Callable:
    """`fn`, adding its time to the active `Phases` under `phase`: only when no other phase is running
    (a phase within another is counted once), unless `nested` (its own depth: the golden's decode and
    decompress nest, and are split by difference). Device work is synchronized around it unless `host`
    (host-only work, which may run on the golden's decode thread: no sync there). Time spent on another
    thread than the main one is added as `bg:<phase>` (off the check's critical path)."""
    depth = threading.local() if nested else _DEPTH

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        phases = Phases.active
        if phases is None or getattr(depth, "n", 0) or (phases.only is not None and phase not in phases.only):
            return fn(*args, **kwargs)
        depth.n = 1
        # Off the main thread (the decode thread; the autograd engine's, where the backward's hooks reduce the
        # gradients on a GPU) only host time: a sync there would stop the device in the middle of the backward.
        main = threading.current_thread() is threading.main_thread()
        if not host and main:
            sync()
        start = time.perf_counter()
        if phase == "build" and not phases.build_from:
            phases.build_from = start - phases.t0
        late = Phases.probe.late if Phases.probe is not None and phase == "build" else 0.0
        if phase == "build" and kwargs.get("vet") is not None:
            kwargs["vet"] = vetting_timed(phases, kwargs["vet"])
        try:
            return fn(*args, **kwargs)
        finally:
            if not host and main:
                sync()
            end = time.perf_counter()
            if phase == "build":
                phases.build_end = end - phases.t0
                if Phases.probe is not None:
                    phases.build_late += Phases.probe.late - late
            phases.add(phase if main else f"bg:{phase}", end - start)
            depth.n = 0

    return wrapper


def vetting_timed(phases: Phases, vet: Callable) -> Callable:
    """A prebuild's vetting (`models.build(vet=)`), its seconds added to `vet`: veosnap's limits and coverage on
    the model as constructed, on the build's path but not the candidate's build (`Row.plain_build_s` leaves it
    out, so e2e own counts it)."""

    def wrapper(model):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        try:
            return vet(model)
        finally:
            phases.add("vet", time.perf_counter() - start)

    return wrapper


def _event() -> object:
    if not CUDA:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def marked(label: str, fn: Callable) -> Callable:
    """`fn`, its entry and exit marked on the plain check's path (`Phases.marks`; main thread only): host times and
    CUDA events, no sync."""

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        phases = Phases.active
        if phases is None or phases.only is None or threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        start, first = time.perf_counter() - phases.t0, _event()
        try:
            return fn(*args, **kwargs)
        finally:
            phases.marks.append((label, start, time.perf_counter() - phases.t0, first, _event()))

    return wrapper


def marked_entry(label: str, factory: Callable) -> Callable:
    """A context manager factory whose managers' entries are marked on the plain check's path (`marked`)."""

    @contextmanager
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        phases = Phases.active
        with ExitStack() as stack:
            if phases is None or phases.only is None or threading.current_thread() is not threading.main_thread():
                yield stack.enter_context(factory(*args, **kwargs))
                return
            start = time.perf_counter() - phases.t0
            value = stack.enter_context(factory(*args, **kwargs))
            phases.marks.append((label, start, time.perf_counter() - phases.t0, None, None))
            yield value

    return wrapper


# The points "to step" is split at (label, 0: entry / 1: exit), and the steps after the step (`+name`: exit).
TO_STEP_POINTS = (("wait", 1), ("pristine", 0), ("pristine", 1), ("g:patch", 1), ("g:timer", 1), ("g:watch", 1),
                  ("g:fault", 1), ("guard", 1), ("settings", 1), ("take", 1), ("run", 0), ("runner", 0),
                  ("runner", 1), ("passes", 0))
TAIL_STEPS = ("grads", "assemble", "read", "compare", "out", "cancel", "layouts")


def path_of(phases: Phases, check_s: float, report_s: float, fwd_bwd_s: float) -> dict[str, float]:
    """Where a plain check's time after its build went, in seconds: from the build's end to the candidate's step
    (`to step`), the step on the device against the candidate alone (`step over`), from the backward's end on
    the device to each later step's end on the host (`+grads`, `+assemble`, `+read`: the compare's one wait for
    the device, `+compare`, `+out`: the check's last layout judged, `+end`: the check returned and the device
    idle), the report.
    Device times come from CUDA events on the host's clock (zero at the check's start, the device idle then); on
    the CPU the step's host times stand in for them."""
    marks = {label: (start, end, first, last) for label, start, end, first, last in phases.marks
             if label not in ("step",)}
    steps = [m for m in phases.marks if m[0] == "step"]
    if not steps:
        return {}
    label, h_in, h_out, e_in, e_out = steps[-1]  # the last pass (a replay would add one more step)
    if CUDA and phases.t0_event is not None:
        d_in, d_out = (phases.t0_event.elapsed_time(e) / 1e3 for e in (e_in, e_out))
    else:
        d_in, d_out = h_in, h_out
    first_in = steps[0][1]
    path = {"build from": phases.build_from, "build": phases.build_end - phases.build_from,
            "to step": first_in - phases.build_end, "step (device)": d_out - d_in,
            "step over": d_out - d_in - fwd_bwd_s, "step starts late": d_in - h_in}
    for name in TAIL_STEPS:
        if name in marks:
            path[f"+{name}"] = marks[name][1] - d_out
    # "to step", split: from the build's end to each later point up to the first step, named by the point it ends
    # at ("guard>": the guard's entry done; "run<": the engine's run begun). The guard waits for the build
    # (`guard.running(ready=)`), so what it sets up before the build's end is off the path and not shown.
    firsts: dict[str, tuple] = {}
    for label, start, end, *_ in phases.marks:
        firsts.setdefault(label, (start, end))  # the guard's exit sets its timer again
    points = sorted((firsts[label][i], f"{label}{'<>'[i]}") for label, i in TO_STEP_POINTS if label in firsts)
    points = [(phases.build_end, "built")] + [p for p in points if p[0] > phases.build_end] + [(first_in, "step<")]
    path["to step parts"] = [[name, b - a] for (a, _), (b, name) in zip(points, points[1:])]
    path["+end"] = check_s - d_out
    path["report"] = report_s
    # The prebuild's vetting (limits and coverage on the model as constructed) is inside the build's time but is
    # veosnap's, on the build's path: counted here, and left out of the build e2e subtracts.
    path["vet"] = phases.get("vet")
    path["gc"] = [[generation, seconds] for generation, seconds in phases.collections]
    path["sum"] = (phases.build_from + path["vet"] + path["to step"] + max(d_in - h_in, 0.0) + path["step over"]
                   + path["+end"] + report_s)
    return path


def _wrap(owner: object, attribute: str, how: str, wrap: Callable[[Callable], Callable]) -> None:
    """`owner.attribute = wrap(owner.attribute)`; a function that has moved is reported, not an error."""
    if not callable(getattr(owner, attribute, None)):
        console.print(f"[yellow]not {how}: {getattr(owner, '__name__', owner)}.{attribute} (moved?)[/yellow]")
        return
    setattr(owner, attribute, wrap(getattr(owner, attribute)))


def instrument() -> None:
    """Wrap the functions whose time a check spends, once. A function that has moved is reported (its
    phase reads 0) rather than failing the run."""
    import veosnap.candidates.layouts.engine as engine_module

    host = {"nested": True, "host": True}
    targets = [
        (store_module, "load", "load", {"host": True}), (background_module, "_head", "head", {"host": True}),
        (background_module._Decode, "result", "wait", {"host": True}),
        (codec_module, "decode", "decode", host), (codec_module, "_decompress", "decompress", host),
        (zoo_module, "load_config", "setup:config", {}), (limits_module, "check_config", "setup:limits", {}),
        (limits_module, "check_batch", "setup:limits", {}), (limits_module, "check_memory", "setup:limits", {}),
        (coverage_module, "require", "setup:coverage", {}), (check_module, "version_drift", "setup:versions", {}),
        (models_module, "build", "build", {}), (prebuild_module.Prebuild, "take", "build:wait", {"host": True}),
        (check_module, "compare", "compare", {}), (Reducer, "keep_tokens", "reduce", {}),
        (Reducer, "keep_rows", "reduce", {}), (CandidateReducer, "finish", "reduce", {}),
        (engine_module, "reduce_gradients", "grads", {}),
        (probes_module, "keep_route", "routes", {}), (engine_module, "assemble", "assemble", {}),
        (engine_module._Runner, "routes_differ", "assemble", {}),
    ]
    for owner, attribute, phase, how in targets:
        _wrap(owner, attribute, "timed", lambda fn: timed(phase, fn, **how))  # noqa: B023 - called at once
    steps = [(prebuild_module.Prebuild, "wait", "wait"), (prebuild_module.Prebuild, "take", "take"),
             (engine_module, "run", "run"), (engine_module._Runner, "__init__", "runner"),
             (engine_module._Runner, "passes", "passes"),
             (engine_module, "forward_backward", "step"), (engine_module, "reduce_gradients", "grads"),
             (engine_module, "assemble", "assemble"), (check_module, "compare", "compare"),
             (numerics_compare_module, "read_together", "read"), (check_module, "_check_loaded", "out"),
             (prebuild_module.Prebuild, "cancel", "cancel"), (check_module, "_check_layouts", "layouts")]
    for owner, attribute, label in steps:
        _wrap(owner, attribute, "marked", lambda fn: marked(label, fn))  # noqa: B023 - called at once
    import veosnap.candidates.guard as guard_module
    import veosnap.candidates.pristine as pristine_module

    import faulthandler
    import signal

    # The guard's setup, in parts (its entry stalled for 2-8 ms after the build at 12 layers of Llama-3.2-1B).
    for owner, attribute, label in ((guard_module, "_patch", "g:patch"), (guard_module, "_watch", "g:watch"),
                                    (faulthandler, "dump_traceback_later", "g:fault"),
                                    (signal, "setitimer", "g:timer")):
        _wrap(owner, attribute, "marked", lambda fn: marked(label, fn))  # noqa: B023 - called at once
    for owner, attribute, label in ((pristine_module, "kept", "pristine"), (check_module, "deterministic", "settings"),
                                    (guard_module, "running", "guard")):
        _wrap(owner, attribute, "marked", lambda factory: marked_entry(label, factory))  # noqa: B023 - called at once
    if getattr(store_module, "decode", None) is not None:
        store_module.decode = codec_module.decode  # store imported it by name


class Peak:
    """Peak memory of a phase: CUDA's allocator high-water mark, or the sampled resident set on the CPU."""

    def __init__(self) -> None:
        self.bytes = 0
        self._stop = threading.Event()

    @contextmanager
    def measure(self) -> Iterator[Peak]:
        if CUDA:
            sync()
            torch.cuda.reset_peak_memory_stats()
            yield self
            sync()
            self.bytes = torch.cuda.max_memory_allocated()
            return
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        try:
            yield self
        finally:
            self._stop.set()
            sampler.join()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as fh:
                self.bytes = max(self.bytes, int(fh.read().split()[1]) * page)
            if self._stop.wait(0.005):
                return


class GilProbe:
    """How late a thread that wants the GIL every `period` seconds gets it: the sum of its lateness past that
    period. While the check's other threads (its reading, the decode, the staging) hold the GIL, a model build
    on its thread waits for it as this probe does, at most as long: the difference between this lateness
    during a check's build and during a build alone estimates how much the check's reading beside the build
    stretched it (which `e2e own` would hide)."""

    def __init__(self, period: float = 0.0005) -> None:
        self.period, self.late, self.wakes = period, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-gil-probe")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(self.period)
            self.late += max(0.0, time.perf_counter() - start - self.period)
            self.wakes += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def gil_held_during_builds(project: Project, key: GoldenKey, backend, toy, dtype: str,  # noqa: ANN001
                           seed: int) -> tuple[float, float, float, float]:
    """The probe's lateness (seconds) during one build alone on a prebuild thread and during one plain check's
    build, and those builds' seconds: (late alone, build alone, late in the check, build in the check)."""
    device = hardware.device_for(hardware.detect())
    probe = GilProbe()
    try:
        before, started = probe.late, time.perf_counter()
        built = prebuild_module.Prebuild(toy, dtype, device, lambda: (seed, lambda model: None)).take(device, seed)
        alone_late, alone_s = probe.late - before, time.perf_counter() - started
        del built
        if CUDA:
            torch.cuda.empty_cache()
        Phases.probe = probe
        _, plain, _, _ = one_check(project, key, backend, only={"build"})
    finally:
        Phases.probe = None
        probe.stop()
    return alone_late, alone_s, plain.build_late, plain.get("build") + plain.get("bg:build")


# --- a scratch project -------------------------------------------------------------------------------


def make_project(root: Path, size: Size) -> Project:
    """A project holding this size's config and test data (random tokens, seeded), no goldens yet."""
    configs, testdata = root / "toy_configs", root / "testdata"
    config = json.loads((ROOT / "toy_configs" / size.family / "config.json").read_text())
    config.update(size.fields)
    (configs / size.name).mkdir(parents=True)
    (configs / size.name / "config.json").write_text(json.dumps(config, indent=2))
    if size.row_tokens:
        testdata.mkdir(parents=True)
        gen = torch.Generator().manual_seed(1234)
        rows = [torch.randint(3, config["vocab_size"], (n,), generator=gen).tolist() for n in size.row_tokens]
        table = pa.table({"id": pa.array(range(len(rows)), pa.int32()),
                          "length": pa.array([len(r) for r in rows], pa.int32()),
                          "tokens": pa.array(rows, pa.list_(pa.int32()))})
        pq.write_table(table, testdata / "sequences.parquet")
    else:
        shutil.copytree(ROOT / "testdata", testdata)
    return Project.resolve(goldens=root / "goldens", configs=configs, testdata=testdata,
                           hardware_class=hardware.detect())


# --- one size ----------------------------------------------------------------------------------------


@dataclass
class Row:
    size: str
    dtype: str
    params: int = 0
    tokens: int = 0
    golden_bytes: int = 0
    sketched: str = ""  # how many tensors are sketched, of how many
    record_s: float = 0.0
    build_s: float = 0.0
    candidate: str = ""
    fwd_bwd_s: float = 0.0
    eager_s: float = 0.0  # the eager reference's forward and backward (no hooks)
    first_fwd_bwd_s: float = 0.0  # the candidate's first step alone (cold allocator, as in a check)
    check_s: float = 0.0
    own_s: float = 0.0
    rest_s: float = 0.0
    phases: dict = field(default_factory=dict)
    serial_check_s: float = 0.0  # the same check with the golden decoded first, on the main thread
    serial_own_s: float = 0.0
    serial_phases: dict = field(default_factory=dict)
    plain_check_s: float = 0.0  # the same check with only the build timed (no syncs added): the median of --plain
    plain_e2e_s: list = field(default_factory=list)  # each plain check's e2e own, seconds, in order
    plain_gc_s: list = field(default_factory=list)  # ... and the seconds of garbage collection in it
    plain_build_s: float = 0.0
    first_check_s: float = 0.0  # --first-check: a plain check before the timed one (the first of this size)
    first_build_s: float = 0.0
    prebuilt: bool = False  # the model was built on the prebuild thread while load, head and setup ran
    build_from_s: float = 0.0  # the plain check: from its start to its model build's start (on the path)
    build_alone_s: float = 0.0  # one build with nothing else running (the candidate's, before the checks)
    path: dict = field(default_factory=dict)  # the plain check's path after its build (`path_of`)
    gil: tuple = ()  # --gil-probe: (late alone, build alone, late in the check, build in the check), seconds
    peak_check: int = 0
    peak_candidate: int = 0
    sketch_gbps: float = 0.0
    copy_gbps: float = 0.0
    passed: bool | None = None
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.own_s / self.fwd_bwd_s if self.fwd_bwd_s else float("nan")

    @property
    def e2e_own_s(self) -> float:
        return self.plain_check_s - self.plain_build_s - self.fwd_bwd_s

    @property
    def e2e_first_s(self) -> float:
        return self.first_check_s - self.first_build_s - self.fwd_bwd_s


def run_size(size: Size, dtype: str, workdir: Path, profile_to: Path | None = None, serial: bool = True,
             profile_stem: str = "profile", first_check: bool = False, gil_probe: bool = False,
             plains: int = 1, sketch: str = "auto") -> Row:
    row = Row(size.name, dtype)
    project = make_project(workdir, size)
    key = GoldenKey(project.hardware_class, size.name, "step", dtype)
    started = time.perf_counter()
    # The recording as `veosnap record` makes it, without its fragility check (which runs the sdpa,
    # grouped_mm and batched_mm candidates against the new golden: checks, timed below, not a recording).
    path = store.path_for(project.goldens, key)
    store.write_bytes(encode_checked(build_golden(project, key, allow_near_ties=True, sketch=sketch), path),
                      path, project.goldens)
    sync()
    row.record_s = time.perf_counter() - started
    row.golden_bytes = path.stat().st_size
    golden = store.read(path)
    row.sketched = f"{len(golden.sketches)}/{len(golden.manifest.tolerance)}"
    batch = Batch.from_golden(golden)
    row.tokens = int(batch.attention_mask.sum())
    toy = load_config(project.configs, size.name)

    backend = None
    for spec in size.candidate:
        try:
            backend = backends.resolve(spec)
            with deterministic():
                (row.fwd_bwd_s, row.peak_candidate, row.params, row.eager_s, row.first_fwd_bwd_s,
                 row.build_alone_s) = candidate_alone(
                    toy, dtype, golden, backend)
            row.candidate = spec
            break
        except (Unsupported, RuntimeError, NotImplementedError) as exc:
            row.note += f"{spec}: {type(exc).__name__} {str(exc)[:80]}; "
    if not row.candidate:
        return row

    # No warm-up check unless `first_check`: the record ran the sketch kernels (compiled) and the candidate
    # alone warmed cuBLAS, but the compare's kernels run for the first time in this check (CUDA loads each
    # kernel at its first launch), so without it the first size's timed phases carry those first-use costs.
    # Then the same check with the golden decoded before anything else (serially, as before the decode
    # thread): what it saves.
    if first_check:
        _, first, row.first_check_s, _ = one_check(project, key, backend, only={"build"})
        row.first_build_s = first.get("build") + first.get("bg:build") - first.get("vet")
    report, phases, row.check_s, row.peak_check = one_check(project, key, backend)
    row.passed = report.passed
    if not report.passed:
        row.note += f"check {report.status}: {report.error or (report.worst and report.worst.name)}; "
    row.build_s = phases.get("build") + phases.get("bg:build") - phases.get("vet")
    row.phases = split_phases(phases)
    row.prebuilt = prebuilt(phases)
    row.own_s = own_time(row.phases, row.prebuilt)
    row.rest_s = row.check_s - row.build_s - row.fwd_bwd_s - (row.own_s - row.phases["report"])
    if serial:
        _, serial_phases, row.serial_check_s, _ = one_check(project, key, backend, serial=True)
        row.serial_phases = split_phases(serial_phases)
        row.serial_own_s = own_time(row.serial_phases, prebuilt(serial_phases))
    # One plain check varies by a few ms from the next (a 60-150 ms step beside a 4 s build): the row shows the
    # median of `plains` of them, its path that check's, and the range.
    runs = []
    for _ in range(max(plains, 1)):
        _, plain, check_s, _ = one_check(project, key, backend, only={"build"})
        build_s = plain.get("build") + plain.get("bg:build") - plain.get("vet")
        runs.append((check_s - build_s - row.fwd_bwd_s, check_s, build_s, plain))
    runs.sort(key=lambda run: run[0])
    row.plain_e2e_s = [run[0] for run in runs]
    row.plain_gc_s = [sum(seconds for _, seconds in run[3].collections) for run in runs]
    _, row.plain_check_s, row.plain_build_s, plain = runs[len(runs) // 2]
    row.build_from_s = plain.build_from
    row.path = path_of(plain, row.plain_check_s, plain.get("report"), row.fwd_bwd_s)
    if gil_probe:
        row.gil = gil_held_during_builds(project, key, backend, toy, dtype, golden.manifest.reference.seed)
    row.sketch_gbps, row.copy_gbps = kernel_throughput(golden, dtype)
    if profile_to is not None:
        try:
            profile_check(project, key, backend, row, profile_to, profile_stem)
        except Exception as exc:  # noqa: BLE001 - the profile must not lose the row's figures
            row.note += f"profile failed: {type(exc).__name__} {str(exc)[:120]}; "
    return row


def one_check(project: Project, key: GoldenKey, backend, serial: bool = False,  # noqa: ANN001, ANN201
              only: set[str] | None = None):
    """One `check` of `backend` against the golden for `key`, then its text and JSON reports: the report, its
    `Phases`, the check's wall seconds and its peak memory. `serial`: the golden is read and decoded whole
    before anything else (no decode thread), as before issue 10's overlap. `only`: the phases timed."""
    phases = Phases(only)
    peak = Peak()
    saved = background_module.read
    if serial:
        def read_serially(path, root=None, advise=lambda exc: exc, start=True):  # noqa: ANN001, ANN202, ARG001
            try:
                return store_module.read(path, root)
            except GoldenError as exc:
                raise advise(exc) from None

        background_module.read = read_serially
    models_module._SKELETONS.clear()  # as in a fresh `veosnap check`: the record built this config's skeleton
    Phases.active = phases
    started_gc: dict[int, float] = {}

    def collected(phase: str, info: dict) -> None:  # a collection stops every thread that wants the GIL
        if phase == "start":
            started_gc[info["generation"]] = time.perf_counter()
        elif info["generation"] in started_gc:
            phases.collections.append((info["generation"], time.perf_counter() - started_gc[info["generation"]]))

    gc.callbacks.append(collected)
    try:
        with peak.measure():
            sync()
            phases.t0_event = _event()
            started = phases.t0 = time.perf_counter()
            report = check_module.check(project, key, backend)
            sync()
            check_s = time.perf_counter() - started
        start = time.perf_counter()
        render_text.checks([report])  # what `veosnap check` prints (`--format json` renders JSON instead)
        phases.add("report", time.perf_counter() - start)
    finally:
        gc.callbacks.remove(collected)
        Phases.active = None
        background_module.read = saved
    return report, phases, check_s, peak.bytes


# --- one check under the profiler -------------------------------------------------------------------


def _labelled(label: str, fn: Callable) -> Callable:
    """`fn` inside a profiler range named `veosnap.<label>` (nothing else: no sync, no timing)."""
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch.profiler.record_function(f"veosnap.{label}"):
            return fn(*args, **kwargs)

    return wrapper


_LABELLED: list[bool] = []


def label_stages() -> None:
    """Profiler ranges around a check's stages, once: the timed phases and the engine's steps between them."""
    if _LABELLED:
        return
    _LABELLED.append(True)
    import veosnap.candidates.layouts.engine as engine_module
    import veosnap.reference.capture as capture_module

    stages = [
        (check_module, "check_layouts", "check"), (zoo_module, "load_checked", "load_checked"),
        (store_module, "load", "load"), (background_module, "_head", "head"),
        (background_module._Decode, "result", "wait"), (check_module, "_check_loaded", "after_load"),
        (limits_module, "check_config", "setup.limits"), (limits_module, "check_batch", "setup.limits"),
        (limits_module, "check_memory", "setup.limits"), (coverage_module, "require", "setup.coverage"),
        (check_module, "version_drift", "setup.versions"), (models_module, "build", "build"),
        (engine_module, "run", "engine.run"), (engine_module._Runner, "passes", "passes"),
        (capture_module, "forward_backward", "forward_backward"), (Reducer, "keep_tokens", "hooks.sketch"),
        (probes_module, "keep_route", "hooks.routes"), (CandidateReducer, "finish", "reduce.finish"),
        (CandidateReducer, "finish_all", "reduce.finish_all"),  # its lone tensors also show as reduce.finish
        (engine_module, "reduce_gradients", "grads"), (engine_module._Runner, "routes_differ", "routes_differ"),
        (engine_module, "assemble", "assemble"), (check_module, "judge", "judge"),
        (check_module, "compare", "compare"),
    ]
    for owner, attribute, label in stages:
        if callable(getattr(owner, attribute, None)):
            setattr(owner, attribute, _labelled(label, getattr(owner, attribute)))


def profile_check(project: Project, key: GoldenKey, backend, row: Row, out: Path,  # noqa: ANN001
                  stem: str = "profile") -> None:
    """One more check (nothing timed, so no added sync) under torch.profiler: `out/<stem>.md` holds veosnap's
    stages (calls, host ms, device ms), the top operators by host self time and by device self time; the
    Chrome trace goes to `out/<stem>_trace.json.gz` when it is under 12 MiB compressed."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    label_stages()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    models_module._SKELETONS.clear()
    sync()
    with profile(activities=activities, record_shapes=False) as prof:
        started = time.perf_counter()
        check_module.check(project, key, backend)
        sync()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    device_attr = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    total_attr = "device_time_total" if hasattr(averages[0], "device_time_total") else "cuda_time_total"
    stages = sorted((e for e in averages if e.key.startswith("veosnap.")), key=lambda e: -e.cpu_time_total)
    lines = [f"# One check of {row.size} {row.dtype} ({row.candidate}) under torch.profiler",
             "", f"torch {torch.__version__}, {torch.cuda.get_device_name() if CUDA else 'CPU'}; wall "
             f"{wall * 1e3:.0f} ms under the profiler (plain check {row.plain_check_s * 1e3:.0f} ms, of it build "
             f"{row.plain_build_s * 1e3:.0f} ms; candidate f+b alone {row.fwd_bwd_s * 1e3:.0f} ms). Host ms of a "
             "stage include the stages inside it and any wait for the device.", "",
             "| stage | calls | host ms | device ms (kernels launched inside) |", "|---|---|---|---|"]
    lines += [f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.1f} | {getattr(e, total_attr, 0) / 1e3:.1f} |"
              for e in stages]
    sort_device = "self_device_time_total" if device_attr == "self_device_time_total" else "self_cuda_time_total"
    lines += ["", "## Top operators by host self time", "", "```",
              averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60), "```"]
    if CUDA:
        lines += ["", "## Top operators by device self time", "", "```",
                  averages.table(sort_by=sort_device, row_limit=30, max_name_column_width=60), "```"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines[:len(stages) + 6]))
    trace = out / f"{stem}_trace.json"
    try:
        prof.export_chrome_trace(str(trace))
        packed = out / f"{stem}_trace.json.gz"
        packed.write_bytes(gzip.compress(trace.read_bytes(), 6))
        if packed.stat().st_size > 12 * 2**20:
            packed.unlink()
    finally:
        trace.unlink(missing_ok=True)


# The phases of a check's own time, in the table's order. On the critical path (the main thread):
ON_PATH = ("load", "head", "wait", "decompress", "parse", "setup", "reduce", "grads", "routes", "assemble", "compare",
           "report")


SETUP = ("config", "limits", "coverage", "versions")  # its parts


def split_phases(phases: Phases) -> dict[str, float]:
    """A check's phases: `decompress` and `parse` (= decode - decompress) on the main thread (a serial read)
    or, as `bg:decompress` and `bg:parse`, on the decode thread (off the critical path: only `wait`, the main
    thread blocked on it, counts)."""
    out = {name: phases.get(name) for name in ON_PATH if name not in ("decompress", "parse", "setup")}
    out["bg:reduce"] = phases.get("bg:reduce")  # the gradients' sketches in the backward's hooks (CUDA: its thread)
    for part in SETUP:
        out[f"setup:{part}"] = phases.get(f"setup:{part}")
    out["setup"] = sum(out[f"setup:{part}"] for part in SETUP)
    for prefix in ("", "bg:"):
        out[f"{prefix}decompress"] = phases.get(f"{prefix}decompress")
        out[f"{prefix}parse"] = phases.get(f"{prefix}decode") - phases.get(f"{prefix}decompress")
    return out


OVERLAPPED = ("load", "head", "setup")  # before the model is taken: off the path while the build runs on its thread


def own_time(phases: dict[str, float], prebuilt: bool = False) -> float:
    """veosnap's own time on the check's critical path: the main thread's phases, less those that ran while the
    model was built on its thread (`prebuilt`: the check waited for that build, so they were not on the path)."""
    return sum(phases[name] for name in ON_PATH) - (sum(phases[name] for name in OVERLAPPED) if prebuilt else 0.0)


def prebuilt(phases: Phases) -> bool:
    """Whether the check's model was built on the prebuild thread and the check waited for it there."""
    return phases.get("bg:build") > 0 and phases.get("build") == 0


def candidate_alone(toy, dtype: str, golden, backend) -> tuple[float, int, int, float, float, float]:  # noqa: ANN001
    """The candidate's forward and backward with no veosnap hook: median seconds of 3 (after one warm-up),
    its peak memory, its parameter count; the eager reference's own forward and backward (median of 2),
    the slower candidate a ratio can also be read against; the candidate's first step (the warm-up:
    the allocator holds only the weights, as in a check, which pays for its activations' first allocation);
    and its model's build, with nothing else running."""
    device = hardware.device_for(hardware.detect())
    sync()
    started = time.perf_counter()
    model = models_module.build(toy, models_module.dtype_from_name(dtype), device, golden.manifest.reference.seed)
    sync()
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    batch = Batch.from_golden(golden).to(device)
    model.train()
    eager = _fwd_bwd_times(model, batch, 3)
    model.zero_grad(set_to_none=True)
    if CUDA:
        torch.cuda.empty_cache()  # the candidate's first step starts as a check's does: only the weights held
    peak = Peak()
    with backend.prepare(model) as candidate:
        times = _fwd_bwd_times(candidate.model, batch, 4, peak)
    del model
    if CUDA:
        torch.cuda.empty_cache()
    return statistics.median(times[1:]), peak.bytes, params, statistics.median(eager[1:]), times[0], build_s


def _fwd_bwd_times(model, batch: Batch, runs: int, peak: Peak | None = None) -> list[float]:  # noqa: ANN001
    """Seconds of each forward and backward, the first (a warm-up) included; `peak` measures the second."""
    times = []
    model.train()
    for i in range(runs):
        model.zero_grad(set_to_none=True)
        with peak.measure() if peak is not None and i == 1 else _nothing():
            sync()
            start = time.perf_counter()
            out = model(**batch.model_kwargs(), use_cache=False)
            out.loss.backward()
            sync()
        times.append(time.perf_counter() - start)
        del out
    model.zero_grad(set_to_none=True)
    return times


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def kernel_throughput(golden, dtype: str) -> tuple[float, float]:  # noqa: ANN001
    """The row sketch's read GB/s on a logits-shaped tensor, and a copy's (read + write) GB/s."""
    spec = golden.sketches["logits"].spec if "logits" in golden.sketches else None
    rows, columns = (spec.rows, spec.columns) if spec else (golden.tensors["logits"].shape[0] *
                                                          golden.tensors["logits"].shape[1],
                                                          golden.tensors["logits"].shape[-1])
    width = spec.width if spec else 64
    device = hardware.device_for(hardware.detect())
    x = torch.randn(rows, columns, device=device).to(models_module.dtype_from_name(dtype))
    reps = 5 if CUDA else 1

    def best(fn: Callable[[], object]) -> float:
        fn()
        out = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
        return min(out)

    nbytes = x.numel() * x.element_size()
    with deterministic():
        sketch_s = best(lambda: rowsketch(x, width, 7))
        copy_s = best(lambda: x.clone())
    return nbytes / sketch_s / 1e9, 2 * nbytes / copy_s / 1e9


# --- the table ---------------------------------------------------------------------------------------


def fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s"


COLUMNS = ("size", "dtype", "params", "tokens", "golden", "sketched", "record", "build", "candidate", "cand f+b",
           "eager f+b", "check", "own", "load/head/wait", "setup (config/limits/coverage/versions)", "reduce (grads)",
           "routes/assemble", "compare", "report", "rest", "own/f+b", "plain check", "build from", "build alone/plain",
           "e2e own/f+b", "e2e first", "cand first f+b",
           "own/eager",
           "decode off path (dec/parse)", "serial own (dec/parse)", "serial/f+b",
           "peak check/cand", "sketch/copy GB/s", "note")


def ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def cells(r: Row) -> list[str]:
    p, q = r.phases, r.serial_phases
    if not r.candidate:
        return [r.size, r.dtype, f"{r.params / 1e6:.1f}M", str(r.tokens), fmt_bytes(r.golden_bytes), r.sketched,
                fmt_s(r.record_s), *[""] * (len(COLUMNS) - 8), r.note]
    return [r.size, r.dtype, f"{r.params / 1e6:.1f}M" if r.params < 1e9 else f"{r.params / 1e9:.2f}B", str(r.tokens),
            fmt_bytes(r.golden_bytes), r.sketched, fmt_s(r.record_s), fmt_s(r.build_s), r.candidate,
            fmt_s(r.fwd_bwd_s), fmt_s(r.eager_s), fmt_s(r.check_s), fmt_s(r.own_s),
            f"{ms(p['load'])}/{ms(p['head'])}/{ms(p['wait'])} ms" + (" (with the build)" if r.prebuilt else ""),
            f"{fmt_s(p['setup'])} ({'/'.join(ms(p['setup:' + part]) for part in SETUP)} ms)"
            + (" (with the build)" if r.prebuilt else ""),
            f"{fmt_s(p['reduce'] + p['grads'])} ({fmt_s(p['grads'])})"
            + (f" + {fmt_s(p['bg:reduce'])} in the backward's hooks" if p.get("bg:reduce") else ""),
            f"{ms(p['routes'])}/{ms(p['assemble'])} ms",
            fmt_s(p["compare"]), fmt_s(p["report"]), ("-" if r.rest_s < 0 else "") + fmt_s(abs(r.rest_s)),
            f"{r.ratio:.2f}", fmt_s(r.plain_check_s) if r.plain_check_s else "", f"{ms(r.build_from_s)} ms",
            f"{fmt_s(r.build_alone_s)} / {fmt_s(r.plain_build_s)}" if r.build_alone_s else "",
            e2e_cell(r),
            f"{r.e2e_first_s / r.fwd_bwd_s:.2f}" if r.first_check_s and r.fwd_bwd_s else "",
            fmt_s(r.first_fwd_bwd_s),
            f"{r.own_s / r.eager_s:.2f}" if r.eager_s else "",
            f"{ms(p['bg:decompress'])}/{ms(p['bg:parse'])} ms",
            f"{fmt_s(r.serial_own_s)} ({ms(q['decompress'])}/{ms(q['parse'])} ms)" if q else "",
            f"{r.serial_own_s / r.fwd_bwd_s:.2f}" if q and r.fwd_bwd_s else "",
            f"{fmt_bytes(r.peak_check)} / {fmt_bytes(r.peak_candidate)}",
            f"{r.sketch_gbps:.1f} / {r.copy_gbps:.1f}", ("" if r.passed else "FAILED ") + r.note]


def print_table(rows: list[Row]) -> str:
    device = torch.cuda.get_device_name() if CUDA else "CPU"
    table = Table(title=f"veosnap at scale on {device} (torch {torch.__version__}; own = load + head + wait + setup + "
                        "reduce + routes + assemble + compare + report, on the check's critical path)")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("size", "dtype", "candidate", "note") else "right")
    for r in rows:
        table.add_row(*cells(r))
    console.print(table)
    md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |" for r in rows]
    return "\n".join(md)


PATH_COLUMNS = ("size", "dtype", "build from", "vet", "to step", "(its parts, each named by the point it ends at)", "step starts late", "step (device) / cand f+b", "step over",
                "+grads", "+assemble", "+read", "+compare", "+out", "+cancel", "+layouts", "+end", "report", "sum", "e2e own",
                "gc: collections (gen 2) ms", "GIL late: alone / in check (builds)", "build stretch (GIL probe est.)")


def path_cells(r: Row) -> list[str]:
    p = r.path
    ms1 = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    return [r.size, r.dtype, ms1(p["build from"]), ms1(p.get("vet", 0.0)), ms1(p["to step"]),
            " ".join(f"{name} {ms1(x)}" for name, x in p.get("to step parts", [])), ms1(p["step starts late"]),
            f"{ms1(p['step (device)'])} / {ms1(r.fwd_bwd_s)}", ms1(p["step over"]),
            *(ms1(p[f"+{k}"]) if f"+{k}" in p else "" for k in TAIL_STEPS),
            ms1(p["+end"]),
            ms1(p["report"]), ms1(p["sum"]), ms1(r.e2e_own_s), gc_cell(p.get("gc", [])), *gil_cells(r)]


def gc_cell(collections: list) -> str:
    """Python's garbage collections during the check, all (of them generation 2), ms: each stops every thread
    that wants the GIL, the check's included."""
    total = sum(seconds for _, seconds in collections)
    full = [seconds for generation, seconds in collections if generation == 2]
    return f"{total * 1e3:.1f} ({len(full)}: {sum(full) * 1e3:.1f})"


def e2e_cell(r: Row) -> str:
    """e2e own / cand f+b of the median plain check, and the range over them when there were several."""
    if not (r.plain_check_s and r.fwd_bwd_s):
        return ""
    cell = f"{r.e2e_own_s / r.fwd_bwd_s:.2f}"
    if len(r.plain_e2e_s) > 1:
        cell += (f" ({r.plain_e2e_s[0] / r.fwd_bwd_s:.2f}-{r.plain_e2e_s[-1] / r.fwd_bwd_s:.2f} over "
                 f"{len(r.plain_e2e_s)}; gc in the slowest {r.plain_gc_s[-1] * 1e3:.0f} ms)")
    return cell


def gil_cells(r: Row) -> list[str]:
    """The GIL probe's lateness during a build alone and during the check's (ms), and what it estimates of how
    much the check's other threads stretched its build: the check's lateness less the alone rate over as long
    (an estimate: the probe samples the GIL every 0.5 ms, as the build's threads ask for it between ops)."""
    if not r.gil:
        return ["", ""]
    late_alone, alone_s, late_check, check_s = r.gil
    extra = late_check - (late_alone / alone_s * check_s if alone_s else 0.0)
    return [f"{late_alone * 1e3:.1f} ({alone_s:.1f} s) / {late_check * 1e3:.1f} ({check_s:.1f} s)",
            f"{max(extra, 0.0) * 1e3:.1f} ms"]


def print_path(rows: list[Row], drawn: bool = True) -> str:
    """The plain checks' paths (`path_of`): ms; + columns count from the backward's end on the device. Drawn on the
    console unless not `drawn`; returned as markdown."""
    table = Table(title="The plain check's path after its build, ms (+: from the backward's end on the device; "
                        "sum = build from + vet + to step + step starts late + step over + end + report)")
    for col in PATH_COLUMNS:
        table.add_column(col, justify="left" if col in ("size", "dtype") else "right")
    shown = [r for r in rows if r.path]
    for r in shown:
        table.add_row(*path_cells(r))
    if drawn:
        console.print(table)
    md = ["| " + " | ".join(PATH_COLUMNS) + " |", "|" + "---|" * len(PATH_COLUMNS)]
    return "\n".join(md + ["| " + " | ".join(path_cells(r)) + " |" for r in shown])


def saved_rows(paths: list[Path]) -> list[Row]:
    """The rows of earlier runs' JSON files (`--json`), sizes prefixed by each file's folder when there are several;
    a file that is not such a list is refused in one line."""
    rows = []
    for path in paths:
        try:
            saved = json.loads(path.read_text())
            loaded = [Row(**fields) for fields in saved]
        except (OSError, ValueError, TypeError) as exc:
            raise SystemExit(f"{path}: not rows of bench_scale.py's --json ({exc})") from None
        for row in loaded:  # named by folder (new-SIZE/, base-SIZE/), or by file where they share one
            label = path.stem if len({p.parent for p in paths}) < len(paths) else path.parent.name
            row.size = f"{label}/{row.size}" if len(paths) > 1 else row.size
        rows += loaded
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new size after this many seconds (the table shows what finished)")
    parser.add_argument("--json", type=Path, help="write the rows here (default: $OUT/bench_scale.json if $OUT)")
    parser.add_argument("--profile", nargs="?", const="last", metavar="SIZE:DTYPE[,SIZE:DTYPE]",
                        help="one more check of SIZE:DTYPE under torch.profiler, to $OUT/profile.md (default: the last "
                             "size, bfloat16 if run); several, comma-separated: $OUT/profile-SIZE-DTYPE.md each")
    parser.add_argument("--no-serial", action="store_true",
                        help="leave out the serial-decode check (the 'serial own' columns): one check less per size")
    parser.add_argument("--plain", type=int, default=1, metavar="N",
                        help="plain checks per row: e2e and the path table are the median one's, with the range")
    parser.add_argument("--first-check", action="store_true",
                        help="one more plain check before the timed one (the 'e2e first' column): the timed phases "
                             "then leave out the process's first-use costs, which that column shows")
    parser.add_argument("--gil-probe", action="store_true",
                        help="one build alone and one more plain check with a GIL probe thread (the 'GIL late' columns "
                             "of the path table): how much the check's reading beside its build could stretch it")
    parser.add_argument("--sketch", default="auto", choices=("auto", "always"),
                        help="the goldens' sketch mode: `always` gives a narrow size the large sizes' path (sketched "
                             "tensors, no isolated layers) for a CPU measure of the per-module host cost")
    parser.add_argument("--show", nargs="+", type=Path, metavar="JSON",
                        help="run nothing: print the path table of rows saved by earlier runs (their --json files; "
                             "with several, each row's size is prefixed by its file's folder, as new-SIZE/ and "
                             "base-SIZE/ of a run against a baseline tree, or by its file's name where they share one)")
    args = parser.parse_args()
    if args.show:
        print(print_path(saved_rows(args.show), drawn=False))
        return
    sizes = [SIZES[name] for name in args.sizes.split(",")]
    dtypes = args.dtypes.split(",")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    json_path = args.json or (out_dir / "bench_scale.json" if out_dir else None)
    instrument()
    profiles: list[tuple[str, ...]] = []
    if args.profile:
        profiles = [(sizes[-1].name, "bfloat16" if "bfloat16" in dtypes else dtypes[-1])] if args.profile == "last" \
            else [tuple(one.split(":")) for one in args.profile.split(",")]
    started = time.perf_counter()
    rows: list[Row] = []
    for size in sizes:
        for dtype in dtypes:
            if time.perf_counter() - started > args.budget_s:
                rows.append(Row(size.name, dtype, note=f"not run: over the {args.budget_s:g} s budget"))
                continue
            console.print(f"[dim]{size.name} {dtype} ...[/dim]")
            with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
                try:
                    where = (out_dir or Path(tempfile.gettempdir()) / "bench_scale_profile") \
                        if (size.name, dtype) in profiles else None
                    stem = "profile" if len(profiles) == 1 else f"profile-{size.name}-{dtype}"
                    row = run_size(size, dtype, Path(tmp), where, serial=not args.no_serial, profile_stem=stem,
                                   first_check=args.first_check, gil_probe=args.gil_probe,
                                   plains=args.plain, sketch=args.sketch)
                except Exception as exc:  # noqa: BLE001 - one size failing must not lose the others' rows
                    row = Row(size.name, dtype, note=f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
            console.print(f"[dim]  {' '.join(cells(row))}  ({time.perf_counter() - started:.0f} s so far)[/dim]")
            if CUDA:
                torch.cuda.empty_cache()
            if json_path:
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    md = print_table(rows) + "\n\n" + print_path(rows)
    if out_dir:
        (out_dir / "bench_scale.md").write_text(md + "\n")
    console.print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
