"""Everything veosnap does on a GPU machine, in phases that fit one device command each.

    python tools/gpu_session.py record  --out DIR   # this class's goldens, float32 and bfloat16, verified:
                                                    # every scenario each model runs (step, train, vision, audio)
    python tools/gpu_session.py matrix  --out DIR   # GPU backends x zoo; precision regression; cross-class
    python tools/gpu_session.py matrix --scenario vision --scenario audio --out DIR   # the multimodal goldens
    python tools/gpu_session.py layouts --out DIR   # layouts on this machine's GPUs (NCCL), all models

Each phase writes JSON and a text table under DIR (and `record` a tar of the goldens) so a lent
machine's results come back whole. It runs with the machine's own torch/triton and whichever
transformers is first on the path (a newer wheel can be carried); the versions are recorded. The ten
models of issue 15 need transformers 5.24 (carry its wheel): 5.17's omni thinkers name their parameters
differently and its rotary embeddings break the float64 noise run (docs/models.md).

`record --model M --scenario S` narrows a run; past `--budget-s` (default 420 s) the rest is left out and
printed as the command that records it, so each command stays under the device's limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

from veosnap.candidates import backends  # noqa: E402
from veosnap.errors import VeosnapError  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference import hardware, scenarios  # noqa: E402
from veosnap.reference.zoo import Project, load_config  # noqa: E402
from veosnap.render import json as render_json  # noqa: E402
from veosnap.render import text as render_text  # noqa: E402
from veosnap.runs import matrix, record, verify  # noqa: E402
from veosnap.runs.check import check  # noqa: E402

GPU_BACKENDS = ["eager", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention",
                "grouped_mm", "batched_mm", "sdpa+grouped_mm", "liger", "flash_attention_2"]
COMPILE_MODELS = ["llama", "qwen3_moe"]  # inductor compiles take tens of seconds per model
LAYOUTS = ["packed", "microbatch", "ddp", "fsdp2", "hsdp", "ep", "sp", "sp_packed", "sp_fsdp2", "sp_ep", "cp", "cp_packed",
           "tp"]  # tp last: a tp crash ends the torchrun


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "hardware_class": hardware.detect()}
    if torch.cuda.is_available():  # the record phase also runs on the CPU (tools/simulate_class.py)
        import triton

        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                   cuda=torch.version.cuda, triton=triton.__version__)
    return env


def save(out: Path, name: str, data: object) -> None:
    (out / name).write_text(json.dumps(data, indent=2, default=str))


def record_keys(project: Project, models: list[str], chosen: list[str]) -> list[tuple[str, str, str]]:
    """(model, scenario, dtype) of every golden `record` writes: each scenario a model can run (or those
    `chosen` it can), in the form that has a golden file (frozen_vision is checked against vision's)."""
    keys = []
    for model in models or project.models():
        config = load_config(project.configs, model).config
        names = [s.name for s in scenarios.applicable(config) if not chosen or s.name in chosen]
        for name in dict.fromkeys(GoldenKey(project.hardware_class, model, n).recorded.scenario for n in names):
            keys += [(model, name, dtype) for dtype in ("float32", "bfloat16")]
    return keys


def phase_record(project: Project, out: Path, models: list[str], chosen: list[str], budget_s: float) -> None:
    rows, left = [], []
    started = time.perf_counter()
    for model, scenario, dtype in record_keys(project, models, chosen):
        if time.perf_counter() - started > budget_s:
            left.append((model, scenario))
            continue
        t = time.perf_counter()
        try:
            outcome = record.record(project, model, dtype, scenario=scenario)
        except VeosnapError as exc:  # a fragile or near-tie golden: said, and the others still recorded
            rows.append({"model": model, "dtype": dtype, "scenario": scenario, "error": str(exc)})
            print(f"NOT recorded {model} {scenario} {dtype}: {exc}", flush=True)
            continue
        rows.append({"model": model, "dtype": dtype, "scenario": scenario, "written": outcome.written,
                     "seconds": round(time.perf_counter() - t, 2), "min_margin": outcome.min_margin,
                     "bytes": outcome.path.stat().st_size})
        print(f"{'recorded' if outcome.written else 'unchanged'} {outcome.key} in {rows[-1]['seconds']} s, "
              f"min margin {outcome.min_margin}", flush=True)
    if left:
        rest = " ".join(f"--model {m}" for m in dict.fromkeys(m for m, _ in left))
        print(f"budget of {budget_s:g} s spent: {len(left)} goldens left; record them with\n"
              f"  python tools/gpu_session.py record {rest}", flush=True)
    # verify takes goldens roots (<class>/<model>/<file> under them): the root, then this class's results
    results = [r for r in verify.verify([project.goldens]) if r.key and r.key.hardware_class == project.hardware_class]
    bad = [r.line() for r in results if not r.ok]
    print(f"verified {len(results)} goldens: {len(bad)} bad", *bad, sep="\n", flush=True)
    save(out, "record.json", {"env": environment(), "goldens": rows, "verify_bad": bad,
                              "left": [list(k) for k in dict.fromkeys(left)]})
    with tarfile.open(out / f"goldens-{project.hardware_class}.tar", "w") as tar:
        tar.add(project.goldens / project.hardware_class, arcname=project.hardware_class)


def phase_scenarios(project: Project, out: Path, chosen: list[str]) -> None:
    """matrix --scenario S: the GPU backends on every model that runs S (the multimodal goldens)."""
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:100]}", flush=True)
    results: dict = {"env": environment()}
    for name in chosen:
        models = [m for m in project.models() if scenarios.get(name).applies(load_config(project.configs, m).config)]
        result = matrix.run_matrix(project, models, ["float32", "bfloat16"], GPU_BACKENDS, on_cell=progress,
                                   scenario=name)
        results[name] = render_json.matrix_dict(result)
        with open(out / "matrix-scenarios.txt", "a") as fh:
            fh.write(f"scenario {name}\n{render_text.matrix(result)}\n")
        save(out, "matrix-scenarios.json", results)
        print(render_text.matrix(result), flush=True)


def phase_matrix(project: Project, out: Path) -> None:
    models = project.models()
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:100]}", flush=True)
    results: dict = {"env": environment()}
    single = matrix.run_matrix(project, models, ["float32", "bfloat16"], GPU_BACKENDS, on_cell=progress)
    results["single"] = render_json.matrix_dict(single)
    (out / "matrix.txt").write_text(render_text.matrix(single))
    save(out, "matrix.json", results)  # saved as each part ends: a run cut short still brings back the rest
    print(render_text.matrix(single), flush=True)

    # A precision regression: exact in float32, it must fail the bfloat16 goldens.
    precision = []
    for model in models:
        for dtype in ("float32", "bfloat16"):
            for fault in ("fp8_attention_probabilities", "low_precision_attention"):
                r = check(project, GoldenKey(project.hardware_class, model, "step", dtype),
                                backends.resolve(f"{ROOT}/tests/faults.py:{fault}"))
                precision.append(render_json.check_dict(r))
                print(f"precision {fault} {model} {dtype}: {r.status} {r.worst.ratio if r.worst else ''}", flush=True)
    results["precision"] = precision
    save(out, "matrix.json", results)

    # Cross-class: the cpu goldens checked here, explicitly (the default refuses).
    cross = []
    cpu = Project.resolve(goldens=project.goldens, configs=project.configs, testdata=project.testdata,
                          hardware_class="cpu")
    for model in models:
        for dtype in ("float32", "bfloat16"):
            r = check(cpu, GoldenKey("cpu", model, "step", dtype), backends.resolve("eager"), cross_class=True)
            cross.append(render_json.check_dict(r))
            print(f"cross-class cpu golden {model} {dtype}: {r.status} worst {r.worst.name if r.worst else ''} "
                  f"{r.worst.ratio if r.worst else ''}", flush=True)
    results["cross_class"] = cross
    save(out, "matrix.json", results)

    compiled = matrix.run_matrix(project, COMPILE_MODELS, ["float32", "bfloat16"], ["compile"], on_cell=progress)
    results["compile"] = render_json.matrix_dict(compiled)
    save(out, "matrix.json", results)
    with open(out / "matrix.txt", "a") as fh:
        fh.write("\n" + render_text.matrix(compiled))
    print(render_text.matrix(compiled), flush=True)


def phase_layouts(project: Project, out: Path, nproc: int, models: list[str]) -> None:
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.layout}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:120]}", flush=True)
    result = matrix.run_matrix(project, models or project.models(), ["float32", "bfloat16"], ["eager"], LAYOUTS,
                               check_cells=matrix.default_check(nproc), on_cell=progress)
    (out / "layouts.txt").write_text(render_text.matrix(result))
    print(render_text.matrix(result), flush=True)
    save(out, "layouts.json", {"env": environment(), "nproc": nproc, "layouts": render_json.matrix_dict(result)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("record", "matrix", "layouts"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--nproc", type=int, default=0, help="layouts: processes (default: every GPU)")
    parser.add_argument("--model", action="append", help="record, layouts: only these models (default: all)")
    parser.add_argument("--scenario", action="append",
                        help="record: only these scenarios (default: every one); matrix: the GPU backends on these "
                             "scenarios' goldens instead of the step matrix")
    parser.add_argument("--budget-s", type=float, default=420.0, help="record: stop starting goldens after this")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(environment()), flush=True)
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    if args.phase == "record":
        phase_record(project, args.out, args.model or [], args.scenario or [], args.budget_s)
    elif args.phase == "matrix" and args.scenario:
        phase_scenarios(project, args.out, args.scenario)
    elif args.phase == "matrix":
        phase_matrix(project, args.out)
    else:
        phase_layouts(project, args.out, args.nproc or torch.cuda.device_count(), args.model or [])


if __name__ == "__main__":
    main()
