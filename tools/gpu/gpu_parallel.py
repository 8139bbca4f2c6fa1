"""Parallel layouts on this machine's GPUs (NCCL): the `_StridedShard` repro, then every parallel layout.

    python tools/gpu/gpu_parallel.py --dtype float32  --out $OUT     # ~3-4 min on 2 H200s
    python tools/gpu/gpu_parallel.py --dtype bfloat16 --out $OUT

On a CPU machine it runs the same on gloo (`--nproc 2`, the cpu goldens). It writes
`$OUT/parallel-<dtype>.json` (every report) and `$OUT/parallel-<dtype>.txt` (the table), and prints:

1. **The repro** (one torchrun, a few seconds): a `[4, 8, 3]` tensor placed `_StridedShard(dim=1,
   split_factor=2)` on a 1-D mesh of 2 ranks, as transformers' `packed_colwise` places the fused gate/up
   experts of every MoE model under tensor parallel. `torch full_tensor()` says whether this torch can
   gather it (torch 2.11: `ValueError: use_strided_shard_as_shard_order is True, but placements ...
   unable to be interpreted into a corresponding shard_order`; 2.12+ falls back to a greedy plan);
   `veosnap gather` must say `ok` everywhere: it is what `tp` now uses for such gradients.
2. **The table**, one torchrun per model with every layout: look for `tp` PASS on qwen3_moe, mixtral and
   deepseek_v3 (before: error, from the gather above), `fsdp2`/`hsdp`/`ep` PASS on deepseek_v3 bfloat16
   (before: `FSDP expects uniform original parameter dtype`), and `sp*`/`cp*` PASS on every model (skips
   say why: a dense model has no experts for `sp_ep`). A cell is the status and the worst error/bound
   ratio; below the table, every error line and skip reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYOUTS = ["fsdp2", "hsdp", "ep", "sp", "sp_packed", "sp_fsdp2", "sp_ep", "cp", "cp_packed", "tp"]  # tp last:
# a crash inside torch's DTensor there would end the shared torchrun before the others


def repro(out: Path) -> None:
    """Run under torchrun: can torch, and can veosnap, gather a `_StridedShard(1, 2)` DTensor?"""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from veosnap.reference.probes import _gather_strided

    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    full = torch.arange(4 * 8 * 3, dtype=torch.float32, device=device).reshape(4, 8, 3)
    # Rank r's shard, as transformers' PackedColwiseParallel lays it out: chunk r of each half of dim 1.
    halves = full.chunk(2, dim=1)
    local = torch.cat([half.chunk(dist.get_world_size(), dim=1)[rank] for half in halves], dim=1)
    placed = DTensor.from_local(local, mesh, [_StridedShard(1, split_factor=2)], run_check=False)
    result = {"torch": torch.__version__}
    try:
        result["torch full_tensor()"] = "ok" if torch.equal(placed.full_tensor(), full) else "WRONG VALUES"
    except Exception as exc:  # noqa: BLE001 - the finding itself
        result["torch full_tensor()"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
    gathered = _gather_strided(placed)
    result["veosnap gather"] = "ok" if gathered is not None and torch.equal(gathered, full) else "WRONG"
    if rank == 0:
        (out / "strided.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def run_repro(out: Path, nproc: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--repro", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    path = out / "strided.json"
    if not path.is_file():
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(path.read_text())


def cell(report) -> str:  # noqa: ANN001
    """A report as the support matrix draws its cell."""
    from veosnap.render.view import cell_text
    from veosnap.runs.matrix import Cell

    return cell_text(Cell.from_report(report))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "parallel-out")))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--nproc", type=int, default=0, help="processes (default: every GPU, else 2)")
    p.add_argument("--model", action="append", help="only these models (default: every zoo model)")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--repro", action="store_true", help=argparse.SUPPRESS)  # one torchrun rank of the repro
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.repro:
        repro(args.out)
        return

    import torch
    import transformers

    from veosnap.candidates import backends
    from veosnap.golden.key import GoldenKey
    from veosnap.reference.zoo import Project
    from veosnap.render import json as render_json
    from veosnap.runs.check import check_layouts

    nproc = args.nproc or torch.cuda.device_count() or 2
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {nproc} processes", flush=True)
    strided = run_repro(args.out, nproc)
    print("_StridedShard(1, split_factor=2) on a 1-D mesh:", json.dumps(strided), flush=True)

    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    eager = backends.resolve("eager")
    rows, reports, notes = [], [], {}
    for model in args.model or project.models():
        start = time.perf_counter()
        key = GoldenKey(project.hardware_class, model, "step", args.dtype)
        got = check_layouts(project, key, eager, LAYOUTS, nproc=nproc, timeout_s=args.timeout)
        seconds = time.perf_counter() - start
        rows.append([model, *(cell(r) for r in got), f"{seconds:.0f}"])
        print(" | ".join(rows[-1]), flush=True)
        for r in got:
            reports.append(render_json.check_dict(r))
            if r.error or r.skipped:
                what = f"{'error' if r.error else 'skip'} {r.layout}: {r.error or r.skipped}"
                notes.setdefault(what, []).append(model)

    header = ["model", *LAYOUTS, "s"]
    lines = [f"{args.dtype}, {nproc} processes, {project.hardware_class}, torch {torch.__version__}",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [f"- {what} ({', '.join(models)})" for what, models in notes.items()]
    lines.append(f"- _StridedShard repro: {json.dumps(strided)}")
    table = "\n".join(lines)
    (args.out / f"parallel-{args.dtype}.txt").write_text(table + "\n")
    (args.out / f"parallel-{args.dtype}.json").write_text(json.dumps(
        {"torch": torch.__version__, "transformers": transformers.__version__, "nproc": nproc,
         "strided_repro": strided, "reports": reports}, indent=2, default=str))
    print(table, flush=True)


if __name__ == "__main__":
    main()
