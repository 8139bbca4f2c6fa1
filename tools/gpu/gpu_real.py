"""The real-shape tier on one GPU in one device command: record its goldens and check them with every
legitimate backend, several worker processes sharing the GPU.

    python tools/gpu/gpu_real.py --out DIR [--jobs 4] [--record-jobs 2] [--budget-s 400] [--stop-s 500]
                             [--dtype D]... [--model M]... [--backends B,C] [--no-compile] [--rerecord]
                             [--excuse MODEL/DTYPE:VARIANT=REASON]...
    python tools/gpu/gpu_real.py --plan [--jobs 4] [--have MODEL/DTYPE]... ...   # no GPU: the estimated schedule,
                                                                              # and whether it fits --stop-s

Work comes in units: `record (model, dtype)` and `check (model, dtype, backend)`, the checks after their
golden's record. A golden of this class already in goldens/ is kept and only checked (`--rerecord`
records it again). A record is `veosnap record`: the reference, its float64 twin, then the fragility check
(the shipped `eager`, `sdpa`, and on MoE models `grouped_mm` and `batched_mm`, against the new golden);
their reports are the matrix's cells for those backends, and a golden they fail is FRAGILE: reported, not
written, left out of the tars, unless each failing variant is excused (`--excuse MODEL/DTYPE:VARIANT=REASON`,
as `veosnap record --excuse`: written with the excuse in its manifest, the variant's cell still a fail).
Records run on `--record-jobs` workers that run nothing else, so they stay pristine (as `veosnap record`
requires; a touched process would record in a fresh child and judge again); the other backends run on the
remaining workers. Units are taken smallest model first (a time budget
leaves out the largest), records first (a record a free worker could take keeps its memory from new checks),
a (model, dtype)'s units one at a time and on the worker that built it last (each worker is its own pool), so
each worker draws a model's weights once and keeps them for its next build (`--no-weight-cache`), and a unit
starts only when its memory
estimate (`tools/gpu/realshape_memory.py`: record or check GiB, plus batched_mm's copies of the experts) fits
beside those running, within `--capacity-gib` (default: 92% of the GPU); a check that cannot fit at all
is a skip with the reason. Each worker takes cores / jobs threads. After `--budget-s` seconds nothing new
starts; at `--stop-s` the units still running are abandoned (their workers killed) and what is done is
written, so the command ends within the device call.

Back under DIR (at most 8 files): `real.json` (every unit: start, end, seconds, memory, margins; the matrix),
`real.txt` (the goldens' table, the matrix, the worst ratio per backend: docs/gpu.md's table),
`goldens-real-<class>-N.tar` (at most 15 MiB each; unpack into goldens/), and `details.tar` with the whole
report of each failing or erroring check. Without CUDA (and without --plan) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference.zoo import Project, load_config  # noqa: E402

REAL_BACKENDS = ["eager", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention", "grouped_mm",
                 "batched_mm", "sdpa+grouped_mm", "liger"]
COMPILE_MODELS = ["qwen3-real", "qwen3_moe-real-small"]  # the smallest dense and MoE: compiles take minutes
RECORD_JUDGES = ("eager", "sdpa", "grouped_mm", "batched_mm")  # `record.VARIANTS`, run by the record units
MAX_FILES = 8

# Time model for --plan. Measured first: tools/gpu/gpu_real.py on the H200 (docs/results/h200-2026-12-01b and
# h200-2026-12-01c; 4 workers sharing the GPU, 2 of them recording). A record unit (reference, float64 twin, the
# judges) in seconds, the larger where measured twice (gpt_oss-real bfloat16: 83 s, then 100 s):
H200_RECORD_S = {
    ("qwen2-real", "bfloat16"): 15.1, ("qwen2-real", "float32"): 17.2,
    ("qwen3-real", "bfloat16"): 10.1, ("qwen3-real", "float32"): 9.5,
    ("qwen3_moe-real-small", "bfloat16"): 14.5, ("qwen3_moe-real-small", "float32"): 16.6,
    ("llama-real", "bfloat16"): 43.9, ("llama-real", "float32"): 53.3,
    ("qwen3_moe-real", "bfloat16"): 53.8, ("qwen3_moe-real", "float32"): 67.9,
    ("gpt_oss-real", "bfloat16"): 99.7, ("gpt_oss-real", "float32"): 114.6,
    ("mixtral-real", "bfloat16"): 78.7, ("mixtral-real", "float32"): 139.5,
    ("deepseek_v3-real", "bfloat16"): 174.7, ("deepseek_v3-real", "float32"): 191.5,
}
# A record not measured in its dtype but in the other: the sibling's seconds x this. Measured float32 over
# bfloat16: 0.94-1.26 within one command, 1.38 across two (gpt_oss-real, 83 s and 115 s).
SIBLING_RECORD_FACTOR = 1.4
# Neither measured: B is billions of parameters, Bkt B x thousand batch positions. The upper envelope of the
# measured records (deepseek_v3-real 175 s for 4.0 B, gpt_oss-real 115 s for 2.8 B; mixtral-real 79 s for 3.2 B
# is below it). The first fit (9.2 + 20.4 B + 0.84 Bkt, to the small models of 2026-12-01b) gave deepseek_v3-real
# 99 s: its float32 record was abandoned (docs/gpu.md).
RECORD_FIXED_S = 9.2
RECORD_S_PER_B = 41.0
RECORD_S_PER_BKT = 0.84
# A check's first build in a worker: drawing the weights (measured 11.5-15.6 s per billion parameters: llama-real
# 17 s, qwen3_moe-real 27 s, gpt_oss-real 38 s, mixtral-real 42 s, deepseek_v3-real 63 s; 10.5 before 2026-12-01c).
BUILD_S_PER_B = 16.0
CACHED_BUILD_S_PER_B = 1.5  # the same weights from this worker's cache (llama-real checks 2.3-6 s)
CHECK_FIXED_S = 1.0  # reading the golden, comparing
STEP_S_PER_BKT = {"float32": 0.09, "bfloat16": 0.012}  # one candidate step, TF32 off
COMPILE_S = 50.0  # an inductor compile (qwen3-real: 49-53 s; qwen3_moe-real-small after it: 12-13 s)
FLEX_S = 35.0  # flex_attention's own compiles: 4-6 s on qwen3-real, 13-33 s more than a cached check at real widths
LIGER_MOE_S = 135.0  # liger on a MoE model (qwen3_moe-real-small 131-135 s; mixtral-real's passed 4+ min)
# The same with LIGER_FUSED_MOE_AUTOTUNE=0 (one fixed Triton configuration): 2026-12-02, mixtral-real float32 22 s
# after a cached build, 47-78 s with the first build (qwen3_moe-real, deepseek_v3-real).
LIGER_FIXED_CONFIG_S = 15.0
# The families whose experts liger 0.8.5 replaces with its fused MoE (`LigerExperts`, autotuned Triton GEMMs: the
# 135 s above); on the others (gpt_oss: its clamped SwiGLU experts stay HF's) liger is norms, RoPE and the loss.
LIGER_FUSED_MOE_TYPES = frozenset({"mixtral", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_vl_moe", "deepseek_v2",
                                   "deepseek_v3", "deepseek_v4", "glm4v_moe", "hunyuan_v1_moe"})
PROCESS_START_S = 12.0  # a spawned worker importing torch and transformers


@dataclass(frozen=True)
class Unit:
    kind: str  # "record" | "check"
    model: str
    dtype: str
    backend: str = ""
    gib: float = 0.0  # memory estimate (GPU)
    est_s: float = 0.0  # time estimate (for --plan)
    alone: bool = False  # run with no other unit beside it (a retry after a CUDA OOM among others)
    excuses: tuple[tuple[str, str], ...] = ()  # a record's (variant, reason) pairs: `veosnap record --excuse`

    @property
    def label(self) -> str:
        return f"{self.kind} {self.model} {self.dtype}" + (f" {self.backend}" if self.backend else "")


def record_seconds(model: str, dtype: str, b: float, kt: float) -> float:
    """A record unit's estimate: measured on the H200, else its other dtype's measure x
    SIBLING_RECORD_FACTOR, else the envelope of the measured ones (`b` billions of parameters, `kt` thousand
    batch positions)."""
    if (model, dtype) in H200_RECORD_S:
        return H200_RECORD_S[(model, dtype)]
    sibling = [s for (m, d), s in H200_RECORD_S.items() if m == model and d != dtype]
    if sibling:
        return max(sibling) * SIBLING_RECORD_FACTOR
    return RECORD_FIXED_S + RECORD_S_PER_B * b + RECORD_S_PER_BKT * b * kt


def plan_units(project: Project, models: list[str], dtypes: list[str], specs: list[str],
               compile_models: list[str], cached: bool = True, have: frozenset = frozenset(),
               exclude: frozenset = frozenset(), excuses: dict | None = None,
               liger_autotune: bool = True) -> list[Unit]:
    """Every unit, in the order they are taken: smallest model first; per (model, dtype) its record, then
    its checks (the heaviest backend last). `have`: the (model, dtype) pairs whose golden is kept as it is
    (no record unit; their checks start at once). `exclude`: (model, dtype) pairs left out entirely.
    `excuses`: {(model, dtype): {variant: reason}}, for their records (`veosnap record --excuse`).
    `liger_autotune`: whether liger's fused MoE autotunes (False: `LIGER_FUSED_MOE_AUTOTUNE=0`, one fixed
    configuration per kernel, timed as LIGER_FIXED_CONFIG_S)."""
    from realshape_memory import estimate, planned_gib

    from veosnap.reference import limits, models as vmodels

    from veosnap.reference.probes import find_moe_layers

    sizes = {m: estimate(project, m) for m in models}
    for m, e in sizes.items():
        toy = load_config(project.configs, m)
        e["moe"] = bool(find_moe_layers(vmodels.skeleton(toy)))
        e["liger_moe"] = e["moe"] and vmodels.hf_config(toy).get_text_config().model_type in LIGER_FUSED_MOE_TYPES
    units = []
    for model in sorted(models, key=lambda m: (sizes[m]["parameters"], m)):
        e = sizes[model]
        b, kt = e["parameters"] / 1e9, e["rows"] * e["width"] / 1000
        liger_moe = e.get("liger_moe", True)
        for dtype in [d for d in dtypes if (model, d) not in exclude]:
            record_s = record_seconds(model, dtype, b, kt)
            if (model, dtype) not in have:
                units.append(Unit("record", model, dtype, gib=planned_gib(e, "record", dtype), est_s=record_s,
                                  excuses=tuple(sorted((excuses or {}).get((model, dtype), {}).items()))))
            for i, spec in enumerate([s for s in specs if s not in RECORD_JUDGES]
                                     + (["compile"] if model in compile_models else [])):
                build = (CACHED_BUILD_S_PER_B if cached and i else BUILD_S_PER_B) * b
                liger_s = LIGER_MOE_S if liger_autotune else LIGER_FIXED_CONFIG_S
                extra = {"compile": COMPILE_S, "flex_attention": FLEX_S, "liger": liger_s if liger_moe else 0.0}
                step = CHECK_FIXED_S + STEP_S_PER_BKT[dtype] * b * kt + extra.get(spec, 0.0)
                gib = planned_gib(e, "check", dtype)
                if "batched_mm" in spec.split("+"):  # it copies each chosen expert's weights per token
                    toy = load_config(project.configs, model)
                    gib += limits.batched_mm_bytes(toy, e["rows"] * e["width"], vmodels.dtype_from_name(dtype)) / 2**30
                units.append(Unit("check", model, dtype, spec, gib=gib, est_s=build + step))
    return units


def next_unit(pending: list[Unit], recorded: set[tuple[str, str]], running: list[Unit], capacity_gib: float,
              busy: set[tuple[str, str]], free: tuple[str, ...] = ("record", "check")) -> Unit | None:
    """The first pending unit that may start now: a worker of its kind `free`, its golden recorded (checks),
    no other unit of its (model, dtype) running (one worker draws its weights, the next reuses them), and
    its memory fitting. A unit larger than the whole capacity starts alone; so does a unit marked `alone`,
    and nothing starts beside it (nor after it is next in line, until the GPU has drained).

    Records first: the first record a free record worker could take keeps its room, so a check starts only
    where it leaves room for that record too (a record that fits starts before a check that would not).
    Without it, checks of other goldens kept starting beside a waiting record, and the records (every check
    of their golden waits for them) started late: on the H200 (2026-12-01c) mixtral-real float32's waited for
    gpt_oss-real's checks and was abandoned at --stop-s."""
    used = sum(u.gib for u in running)
    if any(u.alone for u in running):
        return None
    # the memory of the first record a free worker could take (now, or once the memory allows)
    waiting = next((u.gib for u in pending if u.kind == "record" and "record" in free and not u.alone
                    and (u.model, u.dtype) not in busy and running), 0.0)
    for unit in pending:
        pair = (unit.model, unit.dtype)
        if unit.kind not in free:
            continue
        if unit.kind == "check" and pair not in recorded:
            continue
        if pair in busy:
            continue
        if unit.alone:
            return None if running else unit
        if used + unit.gib + (waiting if unit.kind == "check" else 0.0) <= capacity_gib or not running:
            return unit
    return None


def fitting(units: list[Unit], capacity_gib: float) -> tuple[list[Unit], list[tuple[Unit, str]]]:
    """The checks that fit the GPU, and those that cannot, with the reason (batched_mm at real shapes:
    its copies of the experts' weights take hundreds to thousands of GiB)."""
    keep, declined = [], []
    for u in units:
        if u.kind == "check" and u.gib > capacity_gib:
            declined.append((u, f"needs about {u.gib:,.0f} GiB (batched_mm copies each chosen expert's weights per "
                                f"token), over the {capacity_gib:.0f} GiB here"))
        else:
            keep.append(u)
    return keep, declined


def _free(workers: dict[str, int], running: list[Unit]) -> tuple[str, ...]:
    return tuple(k for k, n in workers.items() if sum(u.kind == k for u in running) < n)


def simulate(units: list[Unit], workers: dict[str, int], capacity_gib: float, budget_s: float = math.inf,
             have: frozenset = frozenset()) -> dict:
    """The schedule `run` would follow if every unit took its estimate: when each starts and ends.
    `workers`: how many workers take records and how many take checks."""
    clock, pending, running, recorded, rows = PROCESS_START_S, list(units), [], set(have), []
    while pending or running:
        busy = {(u.model, u.dtype) for u, _ in running}
        now = [u for u, _ in running]
        unit = None if clock > budget_s else next_unit(pending, recorded, now, capacity_gib, busy, _free(workers, now))
        if unit is not None:
            pending.remove(unit)
            running.append((unit, clock + unit.est_s))
            rows.append({"unit": unit.label, "start": clock, "end": clock + unit.est_s, "gib": unit.gib})
            continue
        if not running:  # over the budget (or nothing can ever start): the rest is not reached
            break
        done = min(running, key=lambda r: r[1])
        running.remove(done)
        clock = done[1]
        if done[0].kind == "record":
            recorded.add((done[0].model, done[0].dtype))
    return {"end_s": clock, "started": rows, "not_reached": [u.label for u in pending]}


# --- in the worker processes ------------------------------------------------------------------------

_CACHE: dict = {}


def _worker_init(threads: int, weight_cache: bool) -> None:
    torch.set_num_threads(threads)
    if weight_cache:
        _cache_weights()


def _cache_weights() -> None:
    """Keep the last model's drawn weights in this worker: the next build of the same config, dtype and seed
    copies them instead of drawing them again (the same values: they are what the draw produced)."""
    from veosnap.reference import weights

    draw = weights.initialize

    def initialize(model: torch.nn.Module, seed: int) -> None:
        targets = dict(model.named_parameters())
        targets.update((n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in weights.SEEDED_BUFFERS)
        key = (seed, type(model).__name__, model.config.to_json_string(),
               tuple((n, tuple(t.shape), str(t.dtype)) for n, t in targets.items()))
        kept = _CACHE.get(key)
        if kept is None:
            draw(model, seed)
            _CACHE.clear()  # one model's weights at a time (host memory)
            _CACHE[key] = {n: t.detach().to("cpu", copy=True) for n, t in targets.items()}
            return
        with torch.no_grad():
            for n, t in targets.items():
                t.copy_(kept[n])

    weights.initialize = initialize


def _release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0.0


def _reserved_gib() -> float:
    """What the caching allocator held at most: what the other workers could not have (the H200 run's
    llama-real record allocated 72 GiB at most but held 134 GiB before expandable segments)."""
    return round(torch.cuda.max_memory_reserved() / 2**30, 1) if torch.cuda.is_available() else 0.0


def out_of_memory(out: dict) -> bool:
    """Whether a unit's outcome is a CUDA out-of-memory error (a check's report or a record's status)."""
    said = f"{getattr(out.get('report'), 'error', None) or ''} {out.get('status', '')}"
    return "OutOfMemoryError" in said or "CUDA out of memory" in said


def run_unit(project: Project, unit: Unit) -> dict:
    """One unit, in a worker: a record's row and its judges' reports, or a check's report (pickled back).
    The worker's cached GPU memory is given back after it, for the units of the other workers."""
    try:
        return _run_unit(project, unit)
    finally:
        _release()


def _run_unit(project: Project, unit: Unit) -> dict:
    from veosnap.candidates import backends, pristine
    from veosnap.golden import store
    from veosnap.errors import VeosnapError
    from veosnap.runs import record
    from veosnap.runs.check import check, excused_notes

    _release()
    key = GoldenKey(project.hardware_class, unit.model, "step", unit.dtype)
    t = time.perf_counter()
    if unit.kind == "check":
        report = check(project, key, backends.resolve(unit.backend))
        return {"report": report, "seconds": round(time.perf_counter() - t, 1), "peak_gib": _peak_gib(),
                "reserved_gib": _reserved_gib(), "pid": os.getpid()}
    try:
        assert not pristine.touched(), "a record worker ran a candidate"  # else `recorded` records in a child
        golden = record.recorded(project, key).golden
        data, note = record.stored_bytes(project, golden)
        row = {"status": "recorded", "record_s": round(time.perf_counter() - t, 1), "peak_gib": _peak_gib(),
               "reserved_gib": _reserved_gib(),
               "bytes": len(data), "min_margin": min(golden.manifest.min_margin.values(), default=None), "note": note}
    except Exception as exc:  # noqa: BLE001 - one golden's failure (an OOM, a near-tie) must not end the run
        return {"status": f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
                "seconds": round(time.perf_counter() - t, 1), "peak_gib": _peak_gib(), "reserved_gib": _reserved_gib(),
                "pid": os.getpid()}
    # The fragility check of `veosnap record`, its reports kept: the matrix's cells for these backends.
    reports = {}
    moe = bool(golden.route_layers())
    for variant in RECORD_JUDGES:
        if variant in ("grouped_mm", "batched_mm") and not moe:
            continue
        if variant == "batched_mm" and record.batched_mm_too_large(project, golden):
            reports[variant] = "batched_mm left out of the fragility check: its copies of the experts' weights " \
                               "exceed record.BATCHED_MM_JUDGE_LIMIT"
            continue
        _release()
        with pristine.own_variants():
            reports[variant] = check(project, key, backends.shipped(variant), gold=golden)
    # Decided as `veosnap record` decides: excused variants (`--excuse`) go into the manifest, and their
    # reports say so; any other failing variant, or an excuse for one that passes, refuses the golden.
    judgments = [record.Judgment(v, "not run", r) if isinstance(r, str) else record.judgment(v, r)
                 for v, r in reports.items()]
    excuses = dict(unit.excuses)
    fragile = [j.variant for j in judgments if j.failed and j.variant not in excuses]
    path = store.path_for(project.goldens, key)
    written = False
    try:
        record.settle(key, golden, judgments, excuses, allow_fragile=False, command="gpu_real")
    except VeosnapError as exc:
        if not fragile:  # a stale excuse (its variant passes): said as the status; fragile ones in the table
            row["status"] = f"refused: {exc}"[:400]
    else:
        written = True
        data, row["note"] = record.stored_bytes(project, golden)  # with the excuses in its manifest
        row["bytes"] = len(data)
        store.write_bytes(data, path, project.goldens)
        for variant, report in reports.items():
            if not isinstance(report, str):
                report.notes[:0] = excused_notes(golden, variant)
    return {**row, "fragile": fragile, "excused": sorted(golden.manifest.excused), "judges": reports,
            "path": str(path.relative_to(project.goldens)), "written": written,
            "seconds": round(time.perf_counter() - t, 1), "pid": os.getpid()}


# --- in the parent ----------------------------------------------------------------------------------


def run(project: Project, units: list[Unit], workers: dict[str, int], capacity_gib: float, budget_s: float,
        stop_s: float = math.inf, weight_cache: bool = True, on_done=None, work=None,  # noqa: ANN001
        have: frozenset = frozenset()) -> dict:
    """Run `units` on worker processes (`workers`: how many take records, how many checks) within the
    memory capacity and time budget. Returns every unit's outcome (with its start and end, seconds from the
    start) and what was not reached.

    Each worker is its own one-process pool, and a check goes to the worker that built its (model, dtype)
    last where that one is free: a shared pool handed a golden's next check to whichever worker was idle,
    which drew the weights again (mixtral-real's second check took 41 s instead of 5 on the H200).
    A unit that ran out of GPU memory while another unit ran beside it is taken again once, alone (the
    estimates are of allocated memory; another worker's allocator may hold more). `work(project, unit)` is
    what a worker runs (`run_unit`; tests pass a stand-in)."""
    work = work or run_unit
    start = time.perf_counter()
    threads = max(1, (os.cpu_count() or 1) // sum(workers.values()))
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked

    def pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=context, initializer=_worker_init, initargs=(threads, weight_cache))

    slots = [{"kind": kind, "pool": pool(), "last": None} for kind, n in workers.items() for _ in range(n)]
    pending, running, recorded, failed, results = list(units), {}, set(have), set(), []
    where: dict = {}  # future -> its slot
    began: dict = {}  # future -> its start, s
    shared: dict = {}  # future -> whether another unit ran beside it at some time

    def idle(kind: str) -> list[dict]:
        return [w for w in slots if w["kind"] == kind and w not in where.values()]

    def slot_for(unit: Unit) -> dict:
        free = idle(unit.kind)
        own = [w for w in free if w["last"] == (unit.model, unit.dtype)]  # it holds these weights
        spent = [w for w in free if w["last"] is None or not any((u.model, u.dtype) == w["last"] for u in pending)]
        return (own or spent or free)[0]  # else one whose weights no pending unit needs, else any

    while pending or running:
        for unit in [u for u in pending if u.kind == "check" and (u.model, u.dtype) in failed]:
            pending.remove(unit)
            results.append({"unit": unit, "status": "not run: its golden was not written"})
        now = list(running.values())
        unit = None if time.perf_counter() - start > budget_s else next_unit(
            pending, recorded, now, capacity_gib, {(u.model, u.dtype) for u in now},
            tuple(k for k in ("record", "check") if idle(k)))
        if unit is not None:
            pending.remove(unit)
            for other in running:
                shared[other] = True
            slot = slot_for(unit)
            future = slot["pool"].submit(work, project, unit)
            slot["last"] = (unit.model, unit.dtype)
            where[future], began[future] = slot, time.perf_counter() - start
            shared[future] = bool(running)
            running[future] = unit
            print(f"{began[future]:6.0f} s  start {unit.label} ({unit.gib:.0f} GiB est."
                  f"{', alone' if unit.alone else ''})", flush=True)
            continue
        if not running:
            break
        left = None if math.isinf(stop_s) else max(1.0, stop_s - (time.perf_counter() - start))
        done, _ = wait(list(running), timeout=left, return_when=FIRST_COMPLETED)
        if not done:  # past --stop-s: abandon what still runs, so the command ends with its results written
            for future, u in running.items():
                results.append({"unit": u, "status": f"abandoned at --stop-s {stop_s:g}",
                                "start_s": round(began[future], 1)})
            running.clear()
            for slot in slots:
                for process in list(getattr(slot["pool"], "_processes", {}).values()):
                    process.kill()
                slot["pool"].shutdown(wait=False, cancel_futures=True)
            return {"results": results, "not_reached": [u.label for u in pending],
                    "seconds": time.perf_counter() - start}
        for future in done:
            unit = running.pop(future, None)
            slot = where.pop(future)
            times = {"start_s": round(began.pop(future), 1), "end_s": round(time.perf_counter() - start, 1)}
            try:
                out = future.result()
            except BrokenProcessPool as exc:  # its worker died (a CUDA fault, the OOM killer): a fresh one
                out = {"status": f"worker died: {exc}"}
                slot["pool"].shutdown(wait=False, cancel_futures=True)
                slot["pool"], slot["last"] = pool(), None
            except Exception as exc:  # noqa: BLE001
                out = {"status": f"{type(exc).__name__}: {exc}".splitlines()[0][:400]}
            if out_of_memory(out) and shared.pop(future, False) and not unit.alone:
                pending.insert(0, dataclasses.replace(unit, alone=True))
                print(f"{time.perf_counter() - start:6.0f} s  OOM   {unit.label} beside other units: again, alone",
                      flush=True)
                continue
            if unit.kind == "record":
                (recorded if out.get("written") else failed).add((unit.model, unit.dtype))
            results.append({"unit": unit, **out, **times})
            if on_done:
                on_done(results[-1], time.perf_counter() - start)
    for slot in slots:
        slot["pool"].shutdown(wait=True)
    return {"results": results, "not_reached": [u.label for u in pending], "seconds": time.perf_counter() - start}


def _summaries(project: Project, done: dict, out: Path, models: list[str], dtypes: list[str],  # noqa: ANN202
               specs: list[str]):
    """The goldens' rows (fragile ones marked), and the matrices (single backends, compile)."""
    import gpu_session

    from veosnap.runs import matrix

    def cell(unit: Unit, backend: str, r: object, seconds: float = 0.0) -> matrix.Cell:
        if isinstance(r, str):
            return matrix.Cell(unit.model, unit.dtype, backend, matrix.SINGLE, "skip", reason=r)
        return dataclasses.replace(matrix.Cell.from_report(r, seconds), backend=backend)

    cells, goldens = [], []
    for r in done["results"]:
        unit = r["unit"]
        if unit.kind == "record":
            cells += [cell(unit, v, report) for v, report in r.get("judges", {}).items()]
            goldens.append({"model": unit.model, "dtype": unit.dtype,
                            **{k: v for k, v in r.items() if k not in ("unit", "judges")}})
        elif "report" in r:
            cells.append(cell(unit, unit.backend, r["report"], r["seconds"]))
        elif r.get("status") == "skip":
            cells.append(cell(unit, unit.backend, r["reason"]))
        else:
            cells.append(matrix.Cell(unit.model, unit.dtype, unit.backend, matrix.SINGLE, "error",
                                     reason=r.get("status", "")))
    for label in done["not_reached"]:
        kind, model, dtype, *backend = label.split(" ")
        if kind == "check":
            cells.append(matrix.Cell(model, dtype, backend[0], matrix.SINGLE, "skip", reason="NotRun: over --budget-s"))
    for label in done["not_reached"]:
        kind, model, dtype, *_ = label.split(" ")
        if kind == "record":
            goldens.append({"model": model, "dtype": dtype, "status": "not run (over --budget-s)"})
    rows = [matrix.Row(m, d) for m in models for d in dtypes if any((c.model, c.dtype) == (m, d) for c in cells)]
    columns = list(dict.fromkeys([*(j for j in RECORD_JUDGES if any(c.backend == j for c in cells)), *specs]))
    single = matrix.Matrix(rows, [matrix.Column(s) for s in columns], [c for c in cells if c.backend != "compile"])
    compiled = matrix.Matrix([r for r in rows if any(c.backend == "compile" and (c.model, c.dtype) == (r.model, r.dtype)
                                                     for c in cells)],
                             [matrix.Column("compile")], [c for c in cells if c.backend == "compile"])
    data = {"single": gpu_session._finish_matrix(single, out, "single"),
            "compile": gpu_session._finish_matrix(compiled, out, "compile")}
    return goldens, single, compiled, data


def existing(project: Project, models: list[str], dtypes: list[str]) -> frozenset:
    """The (model, dtype) pairs whose step golden of this class is in the project already."""
    from veosnap.golden import store

    return frozenset((m, d) for m in models for d in dtypes
                     if store.path_for(project.goldens, GoldenKey(project.hardware_class, m, "step", d)).exists())


def phase_real(project: Project, out: Path, models: list[str], dtypes: list[str], specs: list[str],
               compile_models: list[str], workers: dict[str, int], capacity_gib: float, budget_s: float,
               stop_s: float = math.inf, weight_cache: bool = True, keep_goldens: bool = False,
               exclude: frozenset = frozenset(), excuses: dict | None = None, liger_autotune: bool = True) -> dict:
    """Record and check; write DIR's files; return what `real.json` holds. The goldens already in
    the project are checked as they are, not recorded again (`keep_goldens`). `excuses`, `liger_autotune`: see
    `plan_units`."""
    import gpu_session

    from veosnap.render import text as render_text
    from veosnap.runs import verify

    have = existing(project, models, dtypes) if keep_goldens else frozenset()
    units, too_large = fitting(plan_units(project, models, dtypes, specs, compile_models, weight_cache, have,
                                          exclude, excuses, liger_autotune), capacity_gib)
    plan = simulate(units, workers, capacity_gib, budget_s, have)
    if have:
        print(f"kept as they are (checked, not recorded): {sorted(have)}", flush=True)
    jobs = sum(workers.values())
    print(f"{len(units)} units on {workers} workers within {capacity_gib:.0f} GiB; estimated end "
          f"{plan['end_s']:.0f} s, not reached by the estimate: {len(plan['not_reached'])}", flush=True)

    def progress(r: dict, at: float) -> None:
        status = r.get("status") or r["report"].status
        ratio = r["report"].worst.ratio if "report" in r and r["report"].worst else ""
        print(f"{at:6.0f} s  done  {r['unit'].label}: {status} {ratio} ({r.get('seconds', '')} s, "
              f"{r.get('peak_gib', '')} GiB)", flush=True)

    done = run(project, units, workers, capacity_gib, budget_s, stop_s, weight_cache, on_done=progress, have=have)
    done["results"] += [{"unit": u, "status": "skip", "reason": why} for u, why in too_large]
    goldens, single, compiled, data = _summaries(project, done, out, models, dtypes, specs)
    mine = {(g["model"], g["dtype"]) for g in goldens if g.get("written")}
    checked = [r for r in (verify.verify([project.goldens]) if mine else [])
               if r.key and r.key.hardware_class == project.hardware_class
               and (r.key.model, r.key.dtype) in mine and r.key.scenario == "step"]
    bad = [r.line() for r in checked if not r.ok]
    keep = [project.goldens / g["path"] for g in goldens if g.get("written")]
    tars = gpu_session.pack_tars(keep, project.goldens, out, f"goldens-real-{project.hardware_class}")
    table = ["| model | dtype | status | record s | with judges s | peak GiB | golden KiB | min margin | fragile |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in goldens:
        status = g.get("status", "") + (" FRAGILE, not written" if g.get("fragile") else "") + \
            (f" (excused: {', '.join(g['excused'])})" if g.get("excused") else "")
        table.append(f"| {g['model']} | {g['dtype']} | {status} | {g.get('record_s', '')} | {g.get('seconds', '')} | "
                     f"{g.get('peak_gib', '')} | {round(g['bytes'] / 1024) if 'bytes' in g else ''} | "
                     f"{g.get('min_margin', '')} | {', '.join(g.get('fragile', [])) or ''} |")
    text = "\n".join([*table, f"verified {len(checked)}: {len(bad)} bad", *bad, f"tars: {tars}",
                      f"not reached: {done['not_reached']}",
                      f"{done['seconds']:.0f} s on {jobs} workers ({workers})", "",
                      render_text.matrix(single), gpu_session._worst_table(single),
                      *([render_text.matrix(compiled), gpu_session._worst_table(compiled)] if compiled.cells else [])])
    units_rows = [{"unit": r["unit"].label, **{k: v for k, v in r.items() if k not in ("unit", "report", "judges")},
                   **({"status": r["report"].status} if "report" in r else {})} for r in done["results"]]
    result = {"env": gpu_session.environment(), "workers": workers, "capacity_gib": capacity_gib, "budget_s": budget_s,
              "weight_cache": weight_cache, "seconds": done["seconds"], "plan": plan, "units": units_rows,
              "goldens": goldens, "verify_bad": bad, "tars": tars, "not_reached": done["not_reached"], **data}
    gpu_session.save(out, "real.json", result)
    (out / "real.txt").write_text(text + "\n")
    print(text, flush=True)
    gpu_session._bundle_details(out, {"real.json", "real.txt", *[t for t in tars if not t.startswith("LEFT OUT")]})
    for folder in sorted((d for d in out.rglob("*") if d.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()  # bundled into details.tar
    files = [f for f in out.iterdir() if f.is_file()]
    if len(files) > MAX_FILES:
        print(f"WARNING: {len(files)} files to bring back, over {MAX_FILES}: run again with fewer --model", flush=True)
    return result


def parse_excuses(items: list[str], parser: argparse.ArgumentParser) -> dict:
    """`--excuse MODEL/DTYPE:VARIANT=REASON` options as {(model, dtype): {variant: reason}}."""
    from veosnap.errors import VeosnapError
    from veosnap.runs import record

    found: dict = {}
    for item in items:
        golden, _, excuse = item.partition(":")
        pair = tuple(golden.split("/", 1))
        if len(pair) != 2 or pair[1] not in ("float32", "bfloat16") or not excuse:
            parser.error(f"--excuse {item}: expected MODEL/DTYPE:VARIANT=REASON, e.g. "
                         "gpt_oss-real/bfloat16:grouped_mm=<why>")
        try:
            found.setdefault(pair, {}).update(record.parse_excuses([excuse]))
        except VeosnapError as exc:
            parser.error(str(exc))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--jobs", type=int, default=4, help="worker processes sharing the GPU (default 4)")
    parser.add_argument("--record-jobs", type=int, help="of which take records only (default: 2, at most half)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start nothing new after this (default 400)")
    parser.add_argument("--stop-s", type=float, default=500.0,
                        help="abandon what still runs and write the results (default 500)")
    parser.add_argument("--capacity-gib", type=float, help="GPU memory the units may share (default: 92%% of it)")
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"), help="default: both")
    parser.add_argument("--model", action="append", help="default: the real tier")
    parser.add_argument("--backends", help="comma-separated (default: REAL_BACKENDS that run here)")
    parser.add_argument("--no-compile", action="store_true", help=f"leave out compile on {', '.join(COMPILE_MODELS)}")
    parser.add_argument("--no-weight-cache", action="store_true", help="draw every model's weights in every check")
    parser.add_argument("--plan", action="store_true", help="print the estimated schedule; run nothing")
    parser.add_argument("--no-liger-autotune", action="store_true",
                        help="set LIGER_FUSED_MOE_AUTOTUNE=0 for the workers (liger's fused MoE runs one fixed "
                             "configuration per kernel, not autotuned; real.json's env says so); also when set already")
    parser.add_argument("--exclude", action="append", default=[], metavar="MODEL/DTYPE",
                        help="leave this (model, dtype) out: no record, no checks (e.g. gpt_oss-real/bfloat16)")
    parser.add_argument("--excuse", action="append", default=[], metavar="MODEL/DTYPE:VARIANT=REASON",
                        help="record this golden although the fragility check's VARIANT fails it, for REASON (as "
                             "`veosnap record --excuse`; e.g. gpt_oss-real/bfloat16:grouped_mm=...)")
    parser.add_argument("--have", action="append", default=[], metavar="MODEL/DTYPE",
                        help="--plan only: count this golden as there already (one an earlier command of the same "
                             "session records), so the plan has its checks and no record")
    parser.add_argument("--rerecord", action="store_true",
                        help="record every golden again (default: the goldens of this class already in goldens/ "
                             "are kept and only checked)")
    args = parser.parse_args(argv)
    if args.no_liger_autotune:
        os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "0"  # the workers inherit it
    autotune = os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() not in ("0", "false", "no")
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                              hardware_class="cuda-sm90" if args.plan else None)
    models = args.model or project.models("real")
    for m in models:
        load_config(project.configs, m)
    dtypes = args.dtype or ["bfloat16", "float32"]
    exclude = frozenset(tuple(pair.split("/", 1)) for pair in args.exclude)
    for pair in exclude:
        if len(pair) != 2 or pair[1] not in ("float32", "bfloat16"):
            parser.error(f"--exclude {'/'.join(pair)}: expected MODEL/DTYPE, e.g. gpt_oss-real/bfloat16")
    excuses = parse_excuses(args.excuse, parser)
    specs = args.backends.split(",") if args.backends else REAL_BACKENDS
    compile_models = [] if args.no_compile else [m for m in COMPILE_MODELS if m in models]
    cache = not args.no_weight_cache
    args.record_jobs = args.record_jobs or max(1, min(2, args.jobs // 2))
    if not 0 < args.record_jobs < args.jobs:
        parser.error("--record-jobs must be at least 1 and less than --jobs")
    workers = {"record": args.record_jobs, "check": args.jobs - args.record_jobs}
    if args.plan:
        capacity = args.capacity_gib or 0.92 * 139.8
        have = frozenset() if args.rerecord else existing(project, models, dtypes)
        have |= frozenset(tuple(pair.split("/", 1)) for pair in args.have)
        units, too_large = fitting(plan_units(project, models, dtypes, specs, compile_models, cache, have, exclude,
                                              excuses, autotune), capacity)
        plan = simulate(units, workers, capacity, args.budget_s, have)
        serial = sum(u.est_s for u in units)
        print(f"| unit | GiB (est.) | start s | end s |\n|---|---|---|---|")
        for r in plan["started"]:
            print(f"| {r['unit']} | {r['gib']:.0f} | {r['start']:.0f} | {r['end']:.0f} |")
        for u, why in too_large:
            print(f"| {u.label} | {u.gib:,.0f} | declined: {why} | |")
        print(f"\n{len(units)} units, {serial:.0f} s one after another; on {args.jobs} workers "
              f"({args.record_jobs} recording) within {capacity:.0f} GiB "
              f"the estimate ends at {plan['end_s']:.0f} s; not reached within --budget-s {args.budget_s:g}: "
              f"{len(plan['not_reached'])} ({', '.join(plan['not_reached'][:12])}"
              f"{' ...' if len(plan['not_reached']) > 12 else ''})")
        fits = not plan["not_reached"] and plan["end_s"] <= args.stop_s
        print(f"{'fits' if fits else 'DOES NOT FIT'}: the estimate ends at {plan['end_s']:.0f} s, --stop-s "
              f"{args.stop_s:g}, {len(plan['not_reached'])} not reached")
        return 0
    # Set before the workers start (they inherit it): freed blocks go back to the GPU instead of staying
    # reserved in fragments, so workers sharing the GPU see what the others no longer use.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not torch.cuda.is_available():
        print("gpu_real: skipped, no CUDA device here (it records and checks the cuda real-shape goldens; "
              "--plan estimates without one)")
        return 0
    from veosnap.candidates import backends

    here = set(backends.runnable_builtins())
    runnable = [s for s in specs if all(p in here for p in s.split("+"))]
    print(f"not installed here: {sorted(set(specs) - set(runnable))}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    capacity = args.capacity_gib or 0.92 * torch.cuda.get_device_properties(0).total_memory / 2**30
    phase_real(project, args.out, models, dtypes, runnable, compile_models, workers, capacity, args.budget_s,
               args.stop_s, cache, keep_goldens=not args.rerecord, exclude=exclude, excuses=excuses,
               liger_autotune=autotune)
    return 0


if __name__ == "__main__":
    # Run as the module `gpu_real` (tools/ is on the path, also in the spawned workers), so what the workers
    # unpickle (units, their function) is `gpu_real.*`, never this script's `__main__.*`.
    import gpu_real

    sys.exit(gpu_real.main())
