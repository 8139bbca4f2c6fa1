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

Estimates, not measurements (the H200 run of `tools/gpu_session.py realshape` measures peaks). Prints
a markdown table; `--json` for machines.

    python tools/realshape_memory.py [--model NAME]... [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from veosnap.reference import limits, models
from veosnap.reference.zoo import Project, load_config
from veosnap.runs.record import golden_batch

ATTENTION_TRANSIENT = 2  # scores and masked scores, alive while one layer's softmax runs
H200_GIB = 139.8  # what torch reports as the H200's total memory
CPU_BUDGET_GIB = 12.0  # what a recording may take on the 24 GiB, 2-core CI machine shared with others


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
            "tokens": tokens, "sequences": len(toy.batch.sequences), "distinct_ids": toy.batch.distinct,
            "record_gib": record / 2**30, "check_gib": check / 2**30}


def _real(toy) -> str:  # noqa: ANN001
    try:
        return json.loads((toy.path.parent / "veosnap.json").read_text()).get("real_config", "")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    project = Project.resolve()
    rows = [estimate(project, name) for name in args.model or project.models("real")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| model | real config | parameters | batch rows x width (tokens, sequences) | record GiB (est.) | "
          "check GiB (est.) | where it can be recorded |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        where = ("cpu + H200" if r["record_gib"] <= CPU_BUDGET_GIB else
                 "H200" if r["record_gib"] <= H200_GIB else "too big for one H200")
        print(f"| {r['model']} | {r['real_config']} | {r['parameters'] / 1e9:.2f}B | {r['rows']} x {r['width']} "
              f"({r['tokens']}, {r['sequences']}) | {r['record_gib']:.1f} | {r['check_gib']:.1f} | {where} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
