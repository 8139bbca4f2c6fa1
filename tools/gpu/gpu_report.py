"""Turn what `tools/gpu/gpu_session.py` brought back into docs/gpu.md's tables and a compact JSON.

    python tools/gpu/gpu_report.py --matrix DIR1/matrix.json --layouts DIR2/layouts.json \
        [--liger DIR3/liger.json] --out docs/gpu-results.json > tables.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def cell_text(cell: dict) -> str:
    ratio = cell.get("worst_ratio")
    if cell["status"] in ("skip", "error"):
        return cell["status"]
    return f"{cell['status']} {ratio:.2g}x" if ratio is not None else cell["status"]


def table(cells: list[dict], column: str) -> list[str]:
    columns = list(dict.fromkeys(c[column] for c in cells))
    grid: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for c in cells:
        grid[(c["model"], c["dtype"])][c[column]] = cell_text(c)
    lines = ["| model | dtype | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for (model, dtype), row in grid.items():
        lines.append(f"| {model} | {dtype} | " + " | ".join(row.get(col, "") for col in columns) + " |")
    return lines


def reasons(cells: list[dict], column: str) -> list[str]:
    seen: dict[str, list[str]] = defaultdict(list)
    for c in cells:
        if c["status"] in ("skip", "error", "fail") and c.get("reason"):
            seen[f"{c['status']} {c[column]}: {c['reason']}"].append(f"{c['model']} {c['dtype']}")
    return [f"- {why} ({', '.join(where)})" for why, where in seen.items()]


def compact(report: dict) -> dict:
    return {k: report[k] for k in ("model", "dtype", "backend", "status", "worst", "first_divergence")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, required=True)
    parser.add_argument("--layouts", type=Path, required=True)
    parser.add_argument("--liger", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    m, lay = json.loads(args.matrix.read_text()), json.loads(args.layouts.read_text())
    single = m["single"]["cells"] + m.get("compile", {}).get("cells", [])
    liger = json.loads(args.liger.read_text())["results"] if args.liger else []
    if liger:  # the re-run after the logits fix replaces the first liger cells
        fixed = {(r["model"], r["dtype"]): r for r in liger}
        for c in single:
            r = fixed.get((c["model"], c["dtype"])) if c["backend"] == "liger" else None
            if r:
                c.update(status=r["status"].lower(), worst_ratio=(r["worst"] or {}).get("ratio"),
                         reason=r["first_divergence"] and f"first divergence: {r['first_divergence']}")
    summary = {"env": m["env"], "layouts_env": lay["env"], "nproc": lay["nproc"], "backends": single,
               "layouts": lay["layouts"]["cells"], "precision": [compact(r) for r in m["precision"]],
               "cross_class": [compact(r) for r in m["cross_class"]]}
    args.out.write_text(json.dumps(summary, indent=1))
    print("### Backends (single GPU)\n")
    print("\n".join(table(single, "backend")), "\n")
    print("\n".join(reasons(single, "backend")), "\n")
    print(f"### Layouts ({lay['nproc']} GPUs, NCCL; backend eager)\n")
    print("\n".join(table(lay["layouts"]["cells"], "layout")), "\n")
    print("\n".join(reasons(lay["layouts"]["cells"], "layout")), "\n")
    print("### Precision regression and cross-class\n")
    print("| model | dtype | fp8_attention_probabilities | low_precision_attention | cpu golden checked here |")
    print("|---|---|---|---|---|")
    prec = {(r["model"], r["dtype"], r["backend"].rsplit(":", 1)[-1]): r for r in m["precision"]}
    cross = {(r["model"], r["dtype"]): r for r in m["cross_class"]}
    for (model, dtype), r in cross.items():
        cells = [prec.get((model, dtype, f)) for f in ("fp8_attention_probabilities", "low_precision_attention")]
        text = [f"{c['status']} {c['worst']['ratio']:.2g}x" if c and c["worst"] else "" for c in cells]
        print(f"| {model} | {dtype} | {text[0]} | {text[1]} | {r['status']} {r['worst']['ratio']:.2g}x |")


if __name__ == "__main__":
    main()
