"""Minimal reproduction, outside veosnap (torch + transformers only): transformers' `grouped_mm` experts
compute the expert bias gradients of gpt-oss in bfloat16 with an accumulating gather backward, several
times less accurate than the `eager` experts' per-expert sum.

    python tools/repro_moe_bias_grad.py [--tokens 2050] [--hidden 2880] [--devices cpu,cuda]
                                        [--reference-device D] [--out DIR] [--budget-s S]

gpt-oss's experts add their bias per routed row, `bias[expert_ids]`; autograd's backward of that gather
is an accumulating `index_put_` that adds each row's gradient into the expert's bias gradient in the
tensor's own dtype (bfloat16: rounded after every add; on CUDA the rows are sorted by expert and
summed). The `eager` experts add `bias[e]` broadcast over the expert's rows, whose gradient is a sum
reduction with a float accumulator, rounded once. Measured against a float64 run of the same module and
inputs: the max relative row error of each bias gradient, and the ratio of grouped_mm's to eager's (the
veosnap H200 run of 2026-12-01 refused the gpt_oss-real bfloat16 golden as fragile on exactly these
tensors, grouped_mm 3.5x its bound). Prints a table; writes repro.json under --out (or $OUT) if given.

It runs in stages, and each stage's line (elapsed seconds) is printed and repro.json rewritten as soon as
the stage ends (`"done": false` until the last), so a run cut by a timeout still leaves what it measured.
At gpt-oss widths the experts hold 0.8 billion parameters: the weights and inputs are drawn once (float32
values, on the CPU), and the float64 reference runs on `--reference-device` (default: cuda when it is one of
`--devices`, where float64 is fast; the first version drew the weights three times and ran the float64
reference on the CPU, and did not finish within the H200 command's 60 s). After `--budget-s` no new stage
starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

EXPERTS, TOP_K = 32, 4  # gpt-oss-20b


def experts(implementation: str, hidden: int) -> torch.nn.Module:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=hidden, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, num_hidden_layers=1, vocab_size=128)
    config._experts_implementation = implementation
    with torch.device("meta"):  # no allocation: the drawn weights are assigned
        return GptOssExperts(config)


def draw(tokens: int, hidden: int) -> dict:
    """The experts' weights and the inputs, drawn once on the CPU (float32 values: exact in float64)."""
    generator = torch.Generator().manual_seed(0)
    shapes = {n: p.shape for n, p in experts("eager", hidden).named_parameters()}
    weights = {n: torch.randn(s, generator=generator) * 0.02 for n, s in shapes.items()}
    generator = torch.Generator().manual_seed(1)
    return {"weights": weights,
            "x": torch.randn(tokens, hidden, generator=generator),
            "indices": torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)]),
            "weights_routing": torch.softmax(torch.randn(tokens, TOP_K, generator=generator), -1),
            "upstream": torch.randn(tokens, hidden, generator=generator)}


def bias_grads(implementation: str, dtype: torch.dtype, drawn: dict, device: str) -> dict:
    """The bias gradients of one forward and backward of the experts (`implementation`) in `dtype`."""
    hidden = drawn["x"].shape[-1]
    module = experts(implementation, hidden)
    module.load_state_dict({n: w.to(device, dtype) for n, w in drawn["weights"].items()}, assign=True)
    out = module(drawn["x"].to(device, dtype), drawn["indices"].to(device),
                 drawn["weights_routing"].to(device, dtype))
    out.backward(drawn["upstream"].to(device, dtype))
    grads = {n: p.grad.detach().double().cpu() for n, p in module.named_parameters() if n.endswith("_bias")}
    del module, out
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return grads


def worst_row(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)).max().item()


def rows_of(device: str, got: dict, exact: dict) -> list[dict]:
    rows = []
    for name in exact:
        e, g = worst_row(got["eager"][name], exact[name]), worst_row(got["grouped_mm"][name], exact[name])
        rows.append({"device": device, "tensor": name, "eager": e, "grouped_mm": g,
                     "ratio": g / e if e else math.inf})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| device | tensor | eager | grouped_mm | grouped_mm / eager |", "|---|---|---|---|---|"]
    lines += [f"| {r['device']} | {r['tensor']} | {r['eager']:.4f} | {r['grouped_mm']:.4f} | {r['ratio']:.1f}x |"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2050, help="gpt_oss-real's batch: 2 rows, 2050 tokens")
    parser.add_argument("--hidden", type=int, default=2880, help="gpt-oss-20b's hidden and intermediate size")
    parser.add_argument("--devices", help="comma-separated (default: cpu, and cuda where there is one)")
    parser.add_argument("--reference-device", help="where the float64 reference runs (default: cuda if it is one "
                                                   "of --devices, else cpu)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no new stage after this")
    args = parser.parse_args(argv)
    import transformers

    start = time.perf_counter()
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        if device.startswith("cuda") and not torch.cuda.is_available():
            print(f"repro_moe_bias_grad: skipped {device}, no CUDA device here")
    devices = [d for d in devices if not d.startswith("cuda") or torch.cuda.is_available()]
    reference = args.reference_device or next((d for d in devices if d.startswith("cuda")), "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"torch": torch.__version__, "transformers": transformers.__version__, "tokens": args.tokens,
              "hidden": args.hidden, "experts": EXPERTS, "top_k": TOP_K, "reference_device": reference,
              "done": False, "stages": [], "rows": []}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; {args.tokens} tokens, top-{TOP_K} of "
          f"{EXPERTS} experts, hidden {args.hidden}, bfloat16; max relative row error of the bias gradient vs "
          f"float64 (on {reference})", flush=True)

    def stage(what: str) -> None:  # said and saved as soon as it is done
        result["stages"].append({"stage": what, "at_s": round(time.perf_counter() - start, 1)})
        print(f"{time.perf_counter() - start:6.1f} s  {what}", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "repro.json").write_text(json.dumps(result, indent=1))

    def over() -> bool:
        if time.perf_counter() - start <= args.budget_s:
            return False
        stage(f"over --budget-s {args.budget_s:g}: stopped")
        return True

    drawn = draw(args.tokens, args.hidden)
    stage("weights and inputs drawn")
    exact = bias_grads("eager", torch.float64, drawn, reference)
    stage(f"float64 reference ({reference})")
    for device in devices:
        got = {}
        for implementation in ("eager", "grouped_mm"):
            if over():
                break
            got[implementation] = bias_grads(implementation, torch.bfloat16, drawn, device)
            stage(f"{device} bfloat16 {implementation}")
        if len(got) < 2:
            break
        result["rows"] += rows_of(device, got, exact)
        stage(f"{device} rows")
    else:
        result["done"] = True
        stage("done")
    print(table(result["rows"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
