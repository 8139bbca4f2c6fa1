"""Minimal reproduction, outside veosnap, of torch's compiled flex_attention giving wrong rows on the CPU.

    python tools/repro_flex_cpu.py            # a table: which (heads, length, head_dim) come out wrong
    python tools/repro_flex_cpu.py --json     # the same as JSON (the last line)

Plain torch only: `torch.compile(flex_attention)` on random float32 inputs, no mask and no score_mod, against
a float64 softmax(q k^T / sqrt(d)) v. Seen with torch 2.13.0+cpu on an AVX2 machine (2026-12-02): lengths
that are not a multiple of 16 (8, 24, 40) come out wrong by O(1) in some rows, for most inputs, with 2 heads at
head dims 8 and 16; lengths 16 and 32 are right, and so is the uncompiled flex_attention. The same inputs give
the same wrong output every call (not a race). veosnap's `flex_attention` check of qwen3_vl_moe's vision tower
(2 heads of head_dim 8, images of 8 and 24 patches) fails on such a machine, at its first vision block; the
machines that recorded the cpu goldens did not show it (docs/findings/torch-flex-attention-cpu.md).
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

CASES = [(2, 8, 8), (2, 24, 8), (2, 16, 8), (2, 32, 8), (2, 8, 16), (2, 24, 16), (2, 40, 16), (1, 8, 32)]
TOLERANCE = 1e-4  # float32 attention at these sizes is within ~1e-6 of float64


def wrong_calls(heads: int, length: int, head_dim: int, calls: int = 10, seed: int = 0) -> int:
    """How many of `calls` compiled flex_attention calls on fresh random inputs are wrong (max abs error over
    TOLERANCE, or NaN) against float64 attention."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    generator = torch.Generator().manual_seed(seed)
    wrong = 0
    for _ in range(calls):
        q, k, v = (torch.randn(1, heads, length, head_dim, generator=generator) for _ in range(3))
        out = flex(q, k, v)
        ref = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * head_dim ** -0.5, -1) @ v.double()
        wrong += not (out.double() - ref).abs().max().item() < TOLERANCE
    return wrong


def cpu_flex_is_wrong_here() -> bool:
    """Whether this machine's torch shows the bug (the case that fails most often, on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return wrong_calls(2, 8, 8, calls=5) > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="random inputs per case (default 10)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON last")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as veosnap's checks run; the bug does not need threads
    warnings.simplefilter("ignore")
    rows = [{"heads": h, "length": n, "head_dim": d, "wrong": wrong_calls(h, n, d, args.calls), "calls": args.calls}
            for h, n, d in CASES]
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"compiled flex_attention, float32, no mask")
    print("| heads | length | head_dim | wrong calls |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']} | {r['length']} | {r['head_dim']} | {r['wrong']}/{r['calls']} |")
    if args.json:
        print(json.dumps({"torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
                          "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
