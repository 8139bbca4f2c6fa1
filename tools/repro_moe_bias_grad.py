"""Minimal reproduction, outside veosnap (torch + transformers only): transformers' `grouped_mm` experts
compute the expert bias gradients of gpt-oss in bfloat16 with an accumulating gather backward, several
times less accurate than the `eager` experts' per-expert sum.

    python tools/repro_moe_bias_grad.py [--tokens 2050] [--hidden 2880] [--devices cpu,cuda] [--out DIR]

gpt-oss's experts add their bias per routed row, `bias[expert_ids]`; autograd's backward of that gather
is an accumulating `index_put_` that adds each row's gradient into the expert's bias gradient in the
tensor's own dtype (bfloat16: rounded after every add; on CUDA the rows are sorted by expert and
summed). The `eager` experts add `bias[e]` broadcast over the expert's rows, whose gradient is a sum
reduction with a float accumulator, rounded once. Measured against a float64 run of the same module and
inputs: the max relative row error of each bias gradient, and the ratio of grouped_mm's to eager's (the
veosnap H200 run of 2026-12-01 refused the gpt_oss-real bfloat16 golden as fragile on exactly these
tensors, grouped_mm 3.5x its bound). Prints a table; writes repro.json under --out (or $OUT) if given.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def experts(implementation: str, dtype: torch.dtype, hidden: int, device: str) -> torch.nn.Module:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=hidden, num_local_experts=32,
                          num_experts_per_tok=4, num_hidden_layers=1, vocab_size=128)
    config._experts_implementation = implementation
    module = GptOssExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.02)
    return module.to(device=device, dtype=dtype)


def bias_grads(implementation: str, dtype: torch.dtype, tokens: int, hidden: int, device: str) -> dict:
    module = experts(implementation, dtype, hidden, device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    indices = torch.stack([torch.randperm(32, generator=generator)[:4] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 4, generator=generator, dtype=torch.float64), -1)
    upstream = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    out = module(x.to(device, dtype), indices.to(device), weights.to(device, dtype))
    out.backward(upstream.to(device, dtype))
    return {n: p.grad.detach().double().cpu() for n, p in module.named_parameters() if n.endswith("_bias")}


def worst_row(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)).max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2050, help="gpt_oss-real's batch: 2 rows, 2050 tokens")
    parser.add_argument("--hidden", type=int, default=2880, help="gpt-oss-20b's hidden and intermediate size")
    parser.add_argument("--devices", help="comma-separated (default: cpu, and cuda where there is one)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    import transformers

    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = bias_grads("eager", torch.float64, args.tokens, args.hidden, "cpu")
    rows = []
    for device in devices:
        got = {impl: bias_grads(impl, torch.bfloat16, args.tokens, args.hidden, device)
               for impl in ("eager", "grouped_mm")}
        for name in exact:
            e, g = worst_row(got["eager"][name], exact[name]), worst_row(got["grouped_mm"][name], exact[name])
            rows.append({"device": device, "tensor": name, "eager": e, "grouped_mm": g, "ratio": g / e})
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; {args.tokens} tokens, top-4 of 32 "
          f"experts, hidden {args.hidden}, bfloat16; max relative row error of the bias gradient vs float64")
    print("| device | tensor | eager | grouped_mm | grouped_mm / eager |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['tensor']} | {r['eager']:.4f} | {r['grouped_mm']:.4f} | {r['ratio']:.1f}x |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "repro.json").write_text(json.dumps({"torch": torch.__version__, "tokens": args.tokens,
                                                         "hidden": args.hidden, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
