"""flash-attn 4 (flash_attn.cute 4.0.0b36) forward on sm90 at the real-shape goldens' shapes: is the
`single` divergence a kernel bug, or packed sequences reaching the dense (plain causal) entry point?

    python3 tools/repro_fa4_fwd.py            # the table; --out DIR (default $OUT) also writes repro_fa4_fwd.{md,json}

Hypothesis. The real-shape goldens' `single` batch is 2 rows with no padding: row 0 one sequence,
row 1 dozens of packed sequences (position ids restarting, e.g. llama-real: 4096 = one sequence |
40 sequences of 1..438). With no attention mask and batch 2, veosnap's fa4 adapter (and transformers'
`flash_attention_4`, `_is_packed_sequence` needs batch_size == 1) calls the DENSE causal entry point,
so row 1's sequences attend to each other; the eager/sdpa golden masks them per sequence (transformers'
`find_packed_sequence_indices` works per row at any batch size). Expected table:
  A "dense vs golden": row 0 ok, row 1 WRONG       (the failing cells)
  A "dense vs causal": ok                          (the kernel computes exactly what it was asked)
  A "varlen (cu from flat pos ids)": ok            (the fix: cu_seqlens from the flattened position ids)
  B one-factor sweeps (seqlen, batch, head dim, GQA, unequal varlen): all ok
Any B row WRONG would instead point at a kernel bug at that factor.
Measured on the H200 (2026-12-02, flash-attn-4 4.0.0b36): as expected, every row (38 s;
docs/findings/transformers-flash-packed-rows.md).

Error: max |x - ref| over the case (per row of the batch where it has 2), ref = torch sdpa MATH in
float32 on the same bf16 inputs; beside it the same error of torch's own bf16 sdpa (the noise
yardstick) and their ratio. WRONG: ratio over 8. torch + flash_attn.cute only (no veosnap).
"""

from __future__ import annotations

import argparse
import json
import os
import site
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WRONG = 8.0
BUDGET_S = 45.0  # seconds from the script's start (import and JIT included); later cases are listed as not run
START = time.perf_counter()
# testdata/realshape.parquet lengths: ids 40..79 (row 1 of llama/qwen2/qwen3_moe-real), ids 10..35 (qwen3-real)
ROW1_4096 = (1, 127, 128, 129, 255, 256, 257, 63, 64, 65, 200, 31, 17, 300, 2, 90, 129, 45, 70, 33, 120, 9,
             150, 77, 130, 23, 60, 100, 41, 250, 12, 99, 15, 36, 80, 110, 5, 28, 51, 438)
ROW1_600 = (129, 1, 33, 17, 9, 25, 12, 31, 7, 20, 15, 23, 11, 19, 13, 27, 8, 21, 14, 29, 18, 1, 5, 24, 40, 48)
assert sum(ROW1_4096) == 4096 and sum(ROW1_600) == 600


def read_pythonpath_pth_files() -> None:
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if os.path.isdir(entry):
            site.addsitedir(entry)


def rows_positions(rows: list[tuple[int, ...]], dev) -> torch.Tensor:
    """[rows, width] position ids, restarting per sequence (rows must hold the same number of tokens)."""
    return torch.stack([torch.cat([torch.arange(n, device=dev) for n in row]) for row in rows])


def allowed_from_positions(pos: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """[rows, 1, width, width] bool: causal within the row, and within each sequence if per_sequence."""
    width = pos.shape[1]
    i = torch.arange(width, device=pos.device)
    causal = (i[None, :] <= i[:, None])[None].expand(pos.shape[0], -1, -1)
    if per_sequence:
        seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        causal = causal & (seg[:, :, None] == seg[:, None, :])
    return causal[:, None]


def torch_attention(q, k, v, allowed, scale, dtype):
    """[b, s, h, d] attention through torch sdpa in `dtype` (float32: the MATH backend, the reference)."""
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).to(dtype) for t in (q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)))
    if dtype == torch.float32:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


def cu_from_positions(pos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What transformers' prepare_fa_kwargs_from_position_ids gives for the FLATTENED position ids."""
    flat = pos.reshape(-1)
    starts = (flat == flat.min()).nonzero().view(-1)
    cu = torch.cat([starts, torch.tensor([flat.numel()], device=pos.device)]).to(torch.int32)
    return cu, int(cu.diff().max())


def first(out):
    return out[0] if isinstance(out, tuple) else out


def run_case(fa, name, rows, hq, hkv, d, call, golden, dev, seed=0):
    """rows: per batch row, its sequence lengths. call: 'dense' or 'varlen'. golden: 'per-sequence'
    (the eager/sdpa golden's mask) or 'causal' (plain causal over the row, what dense computes)."""
    pos = rows_positions(rows, dev)
    b, s = pos.shape
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b, s, hq, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    scale = d ** -0.5
    t0 = time.perf_counter()
    if call == "dense":
        out = first(fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True))
    else:
        cu, longest = cu_from_positions(pos)
        out = first(fa.flash_attn_varlen_func(q.reshape(b * s, hq, d), k.reshape(b * s, hkv, d),
                                              v.reshape(b * s, hkv, d), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=scale,
                                              causal=True)).reshape(b, s, hq, d)
    if q.is_cuda:
        torch.cuda.synchronize()
    fa_s = time.perf_counter() - t0
    allowed = allowed_from_positions(pos, golden == "per-sequence")
    ref = torch_attention(q, k, v, allowed, scale, torch.float32)
    noise = torch_attention(q, k, v, allowed, scale, torch.bfloat16).float()
    err_rows = [(out[r].float() - ref[r]).abs().max().item() for r in range(b)]
    noise_err = (noise - ref).abs().max().item()
    ratio = max(err_rows) / max(noise_err, 1e-6)
    return {"case": name, "call": call, "vs": golden, "batch": b, "width": s,
            "sequences": [len(r) for r in rows], "heads": f"{hq}/{hkv}", "head_dim": d,
            "fa4_err_rows": err_rows, "sdpa_bf16_err": noise_err, "ratio": ratio,
            "verdict": "WRONG" if ratio > WRONG else "ok", "fa4_call_s": round(fa_s, 2)}


def cases():
    one4096, one600 = (4096,), (600,)
    A = [  # the goldens' own batches (2 rows, no padding, row 1 packed)
        ("A llama-real  dense vs golden", [one4096, ROW1_4096], 32, 8, 128, "dense", "per-sequence"),
        ("A llama-real  dense vs causal", [one4096, ROW1_4096], 32, 8, 128, "dense", "causal"),
        ("A llama-real  varlen(flat pos)", [one4096, ROW1_4096], 32, 8, 128, "varlen", "per-sequence"),
        ("A qwen2-real  dense vs golden", [one4096, ROW1_4096], 14, 2, 64, "dense", "per-sequence"),
        ("A qwen2-real  varlen(flat pos)", [one4096, ROW1_4096], 14, 2, 64, "varlen", "per-sequence"),
        ("A qwen3-real  dense vs golden", [one600, ROW1_600], 16, 8, 128, "dense", "per-sequence"),
        ("A qwen3-real  varlen(flat pos)", [one600, ROW1_600], 16, 8, 128, "varlen", "per-sequence"),
        ("A q3moe-real  dense vs golden", [one4096, ROW1_4096], 32, 4, 128, "dense", "per-sequence"),
        ("A q3moe-small dense (1 row 600)", [one600], 16, 8, 128, "dense", "per-sequence"),
    ]
    B = [(f"B seqlen {n}", [(n,)], 32, 8, 128, "dense", "causal") for n in (128, 512, 1024, 2048, 4096)]
    B += [
        ("B batch 2 equal 4096", [one4096, one4096], 32, 8, 128, "dense", "causal"),
        ("B head_dim 64 (14/2)", [one4096], 14, 2, 64, "dense", "causal"),
        ("B GQA 1 (32/32)", [one4096], 32, 32, 128, "dense", "causal"),
        ("B GQA 8 (32/4)", [one4096], 32, 4, 128, "dense", "causal"),
        ("B varlen unequal 2049+1", [(2049, 1)], 32, 8, 128, "varlen", "per-sequence"),
        ("B varlen row1 packed", [ROW1_4096], 32, 8, 128, "varlen", "per-sequence"),
        ("B dense 1 packed row", [ROW1_4096], 32, 8, 128, "dense", "per-sequence"),  # WRONG expected too
    ]
    return A + B


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to run")
        return 0
    read_pythonpath_pth_files()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import flash_attn.cute as fa
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, sm{''.join(map(str, torch.cuda.get_device_capability()))}")
    start, results = START, []
    for name, rows, hq, hkv, d, call, golden in cases():
        if time.perf_counter() - start > BUDGET_S:
            results.append({"case": name, "verdict": "not run (budget)"})
            continue
        try:
            results.append(run_case(fa, name, rows, hq, hkv, d, call, golden, dev))
        except Exception as exc:  # noqa: BLE001
            results.append({"case": name, "verdict": f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
        torch.cuda.empty_cache()
    lines = ["| case | call | vs | seqs/row | heads | hd | fa4 max err (per row) | bf16 sdpa err | ratio | verdict | fa4 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "ratio" not in r:
            lines.append(f"| {r['case']} | | | | | | | | | {r['verdict']} | |")
            continue
        errs = ", ".join(f"{e:.4f}" for e in r["fa4_err_rows"])
        lines.append(f"| {r['case']} | {r['call']} | {r['vs']} | {r['sequences']} | {r['heads']} | {r['head_dim']} | "
                     f"{errs} | {r['sdpa_bf16_err']:.4f} | {r['ratio']:.1f} | {r['verdict']} | {r['fa4_call_s']} |")
    table = "\n".join(lines)
    print(table)
    print(f"total {time.perf_counter() - start:.1f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "repro_fa4_fwd.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "repro_fa4_fwd.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
