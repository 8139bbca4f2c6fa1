"""The real-shape tier's sizes: parameters, batch, and the memory a recording and a check need.

For each config of the real tier (or `--model NAME`), counted on the meta device (nothing is
allocated): parameters, the golden batch's rows, width and real tokens, and estimates of peak memory

- record: the golden's dtype run and its float64 twin (`limits.RECORD_BYTES_PER_PARAMETER` per
  parameter: weights and gradients in float32 and float64) and the float64 run's activations (the
  float32 run's are freed before it starts): per `limits.check_memory` (hidden values per layer and
  token, three logit copies) plus eager attention's score matrices (rows x heads x width^2: the
  probabilities each layer keeps for backward, and `ATTENTION_TRANSIENT` more while one layer runs),
  which `limits.check_memory` leaves out;
- check: float32 weights and gradients, and the same activations in float32.

Estimates, not measurements (`tools/gpu/gpu_real.py` reports each unit's peak on the H200). They are upper
bounds of what torch allocates: the H200 run of 2026-12-01 measured 61-100% of the record estimate and
54-100% of the check estimate (`H200_MEASURED_GIB`). `planned_gib` is what `tools/gpu/gpu_real.py` schedules
with: the measured peak plus the allocator's headroom where there is one, else the estimate. Prints a
markdown table; `--json` for machines.

`--measure` measures instead, on this machine (CPU: resident memory): it records each model's float32
step golden into a scratch directory phase by phase, as `veosnap record` and `veosnap refresh` run it
when they write (the reference and its float64 twin, then the fragility variants, each a check), and
prints each phase's peak resident set (VmHWM, reset between phases) and what stays resident after it.

    python tools/gpu/realshape_memory.py [--model NAME]... [--json]
    python tools/gpu/realshape_memory.py --measure [--model NAME]... [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from veosnap.reference import limits, models
from veosnap.reference.zoo import Project, load_config
from veosnap.runs.record import golden_batch

ATTENTION_TRANSIENT = 2  # scores and masked scores, alive while one layer's softmax runs
H200_GIB = 139.8  # what torch reports as the H200's total memory
CPU_BUDGET_GIB = 12.0  # what a recording may take on the 24 GiB, 2-core CI machine shared with others

# Peak GPU memory allocated (GiB) on the H200 by tools/gpu/gpu_real.py, 2026-12-01 (docs/results/h200-2026-12-01b
# and -01c): a record (the same in both dtypes: its float64 twin dominates) and the largest check of each dtype.
H200_MEASURED_GIB = {
    "qwen2-real": {"record": 49.0, "bfloat16": 21.2, "float32": 24.6},
    "qwen3-real": {"record": 7.7, "bfloat16": 3.1, "float32": 3.9},
    "qwen3_moe-real-small": {"record": 7.1, "bfloat16": 1.9, "float32": 3.6},
    "llama-real": {"record": 72.1, "bfloat16": 29.7, "float32": 36.1},
    "qwen3_moe-real": {"record": 81.1, "bfloat16": 32.0, "float32": 40.6},
    "mixtral-real": {"record": 63.9, "bfloat16": 21.0},
    "gpt_oss-real": {"record": 62.9, "bfloat16": 18.6, "float32": 27.4},
    "deepseek_v3-real": {"record": 75.4, "bfloat16": 24.4},
}
# What a worker's caching allocator holds beyond its peak allocation. Without expandable segments the
# llama-real record held 133.8 GiB for a 72 GiB peak (another worker's check ran out of memory beside it);
# tools/gpu/gpu_real.py sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and empties the cache per unit.
ALLOCATOR_HEADROOM = 1.25


def planned_gib(estimated: dict, kind: str, dtype: str) -> float:
    """The GiB a unit (`kind`: record or check) is scheduled with: measured peak x headroom, else the
    estimate (`estimated`: a row of `estimate`)."""
    measured = H200_MEASURED_GIB.get(estimated["model"], {}).get("record" if kind == "record" else dtype)
    if measured is not None:
        return measured * ALLOCATOR_HEADROOM
    return estimated["record_gib" if kind == "record" else "check_gib"]


def estimate(project: Project, name: str) -> dict:
    toy = load_config(project.configs, name)
    text = models.hf_config(toy).get_text_config()
    params = sum(p.numel() for p in models.skeleton(toy).parameters())
    batch = golden_batch(project, toy)
    rows, width = batch.rows, batch.width
    positions = rows * width
    tokens = int(batch.attention_mask.sum())
    hidden, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    heads = text.num_attention_heads
    activations = positions * (layers * hidden * limits.HIDDEN_VALUES_PER_LAYER + vocab * limits.LOGIT_COPIES)
    attention = rows * heads * width * width * (layers + ATTENTION_TRANSIENT)
    record = params * limits.RECORD_BYTES_PER_PARAMETER + (activations + attention) * 8
    check = params * limits.CHECK_BYTES_PER_PARAMETER + (activations + attention) * 4
    return {"model": name, "real_config": _real(toy), "parameters": params, "rows": rows, "width": width,
            "tokens": tokens, "sequences": len(toy.batch.sequences) if toy.batch else rows,
            "distinct_ids": toy.batch.distinct if toy.batch else None,
            "record_gib": record / 2**30, "check_gib": check / 2**30}


def _measured(model: str) -> str:
    m = H200_MEASURED_GIB.get(model, {})
    show = [f"{m[k]:.0f}" if k in m else "?" for k in ("record", "bfloat16", "float32")]
    return f"{show[0]}, {show[1]} / {show[2]}" if m else "not measured"


def _real(toy) -> str:  # noqa: ANN001
    try:
        return json.loads((toy.path.parent / "veosnap.json").read_text()).get("real_config", "")
    except OSError:
        return ""


def _rss_gib() -> tuple[float, float]:
    """(peak since the last reset, now) of this process's resident set, GiB (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmHWM"].split()[0]) / 2**20, int(fields["VmRSS"].split()[0]) / 2**20)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def measure(project: Project, name: str, dtype: str) -> list[dict]:
    """Peak and remaining resident memory of each phase of recording `name`'s step golden (written:
    the variants run), in a scratch goldens directory."""
    import gc
    import tempfile
    import time

    from veosnap.candidates import backends, pristine
    from veosnap.golden.key import GoldenKey
    from veosnap.runs.check import check
    from veosnap.runs.record import _MOE_ONLY, VARIANTS, batched_mm_too_large, build_golden

    rows = []
    with tempfile.TemporaryDirectory(prefix="veosnap-memory-") as scratch:
        project = Project(Path(scratch), project.configs, project.testdata, project.hardware_class)
        key = GoldenKey(project.hardware_class, name, "step", dtype)

        def phase(label, fn):  # noqa: ANN001, ANN202
            gc.collect()
            _reset_peak()
            t0 = time.perf_counter()
            result = fn()
            gc.collect()
            peak, now = _rss_gib()
            rows.append({"model": name, "dtype": dtype, "phase": label, "peak_gib": peak, "after_gib": now,
                         "seconds": time.perf_counter() - t0})
            print(f"  {name} {dtype} {label}: peak {peak:.1f} GiB, {now:.1f} GiB after, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            return result

        golden = phase("reference + float64 twin", lambda: build_golden(project, key))
        moe = bool(golden.route_layers())
        for variant in VARIANTS:
            if variant in _MOE_ONLY and not moe:
                continue
            if variant == "batched_mm" and batched_mm_too_large(project, golden):
                rows.append({"model": name, "dtype": dtype, "phase": "variant batched_mm: left out (too large)",
                             "peak_gib": 0.0, "after_gib": 0.0, "seconds": 0.0})
                continue
            with pristine.own_variants():
                phase(f"variant {variant} (a check)",
                      lambda v=variant: check(project, key, backends.shipped(v), gold=golden))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", action="store_true", help="measure a recording's phases here (resident memory)")
    parser.add_argument("--dtype", default="float32", help="--measure: the golden's dtype (default float32)")
    args = parser.parse_args(argv)
    project = Project.resolve()
    if args.measure:
        rows = [r for name in args.model or project.models("real") for r in measure(project, name, args.dtype)]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print("| model | dtype | phase | peak GiB | GiB after | seconds |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['dtype']} | {r['phase']} | {r['peak_gib']:.1f} | {r['after_gib']:.1f} | "
                  f"{r['seconds']:.0f} |")
        return 0
    rows = [estimate(project, name) for name in args.model or project.models("real")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| model | real config | parameters | batch rows x width (tokens, sequences) | record GiB (est.) | "
          "check GiB (est.) | H200 peak GiB: record, check bf16 / f32 | where it can be recorded |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        where = ("cpu + H200" if r["record_gib"] <= CPU_BUDGET_GIB else
                 "H200" if r["record_gib"] <= H200_GIB else "too big for one H200")
        print(f"| {r['model']} | {r['real_config']} | {r['parameters'] / 1e9:.2f}B | {r['rows']} x {r['width']} "
              f"({r['tokens']}, {r['sequences']}) | {r['record_gib']:.1f} | {r['check_gib']:.1f} | "
              f"{_measured(r['model'])} | {where} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
