"""Minimal reproduction, outside veosnap, of flash-attn 4 (`flash_attn.cute` 4.0.0b36) on Hopper (sm90):
wrong backward for head dims that are not a multiple of 32, and transformers' `flash_attention_4`
packed path failing with `ValueError: Expected IntTuple, whose leaves are integers, but got 32`.

    python3 tools/repro_fa4.py                    # the table; --out DIR (default $OUT) writes repro_fa4.{md,json}
    python3 tools/repro_fa4.py --budget 150       # seconds; cases not reached are listed as not run
    python3 tools/repro_fa4.py --case "hd64 GQA"  # only the cases whose name starts so (repeatable)

Part 1, the backward. Each case runs flash_attn.cute (varlen entry point for packed sequences, as
frameworks and veosnap's `fa4` backend call it, or the dense one) forward and backward on random
bfloat16 inputs, and the same attention twice in torch: in float64 (the reference) and in bfloat16
through `scaled_dot_product_attention` (the noise yardstick: what an ordinary bf16 kernel gets). Per
tensor (out, dq, dk, dv) it prints the error of fa4 over the error of torch's bf16 sdpa, both against
float64 (max |x - ref| / max |ref|). A ratio near 1 is bf16 noise; WRONG marks a ratio over 8.

Hypothesis (read from the sources): on sm90 the backward kernel (`flash_bwd_sm90.py`) rounds the head
dim of its float32 dQ (and, for grouped-query attention, dK/dV) accumulators up to a multiple of 16,
but `interface._flash_attn_bwd` allocates them and `flash_bwd_postprocess.py` reads them back rounded
up to a multiple of 32 (`hdim_multiple_of = 64 if arch // 10 == 9 and dKV_swapAB else 32`). Where the
two differ (head dims 8, 16, 40, 48, 80, 112: column `accum`, kernel/postprocess) the postprocess
reads the accumulators with the wrong row stride: dq is wrong always, dk/dv with GQA only (without
GQA the kernel stores dk/dv directly). Head dims 24, 32, 64, 96, 128 agree and pass. So veosnap's
toy models (head_dim 16) fail their gradients and deepseek_v3's toy (q/k head dim 24) passes; a
head dim zero-padded to 32 (q, k, v padded, output cropped) is the workaround and is a case below.

Part 2, the packed ValueError. transformers 5.24's `prepare_fa_kwargs_from_position_ids` returns the
longest sequence as a 0-d CUDA tensor (`cu_seq_lens_q.diff().max()`) and `_flash_attention_forward`
passes it on as `max_seqlen_q/k` (it calls `.item()` only while tracing); fa4 on sm90 keeps it a
tensor where it builds CuTe shapes, and CuTe formats the tensor as "32" in its message. The cases
call fa4 with max_seqlen as an int and as a 0-d tensor, and transformers' own `_flash_attention_forward`
with packed position ids, forward and backward, printing each error and the innermost frame.

Needs a CUDA GPU, torch and flash-attn-4 (with nvidia-cutlass-dsl; installed with `pip --target DIR`
on PYTHONPATH, the `.pth` files of the PYTHONPATH entries are read first so `cutlass` imports);
transformers 5.24 for the last cases only. Nothing from veosnap. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import site
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

WRONG = 8.0  # error ratio over torch's bf16 sdpa above which a tensor is marked WRONG
TENSORS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    """One attention call: `lens` packed sequences (varlen) or a dense batch of `batch` x `lens[0]`."""

    name: str
    lens: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int | None = None  # None: = head_dim
    causal: bool = True
    window: int | None = None  # left window in keys (transformers' sliding_window - 1)
    dense_batch: int = 0  # > 0: the dense entry point on [dense_batch, lens[0], ...]
    pad_to: int = 0  # > 0: zero-pad q, k, v head dims to this and crop the output (the workaround)
    expect: str = ""  # what the hypothesis predicts

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim


def accum_dims(head_dim: int) -> tuple[int, int]:
    """The accumulator head dim the sm90 backward kernel uses, and the one its allocation/postprocess use
    (for head dims up to 128, where the kernel does not swap dK/dV operands)."""
    if head_dim > 128:
        rounded = -(-head_dim // 64) * 64
        return rounded, rounded
    return -(-head_dim // 16) * 16, -(-head_dim // 32) * 32


TOY = (32, 29, 23, 17)  # a toy batch's sequence lengths, unpadded into one varlen call as the fa4 backend does
CASES = [  # the most telling first: --budget stops starting new ones
    Case("toy llama/qwen/mixtral: hd16, GQA 4:2", TOY, 4, 2, 16, expect="WRONG dq dk dv"),
    Case("toy hd16 without GQA (4:4)", TOY, 4, 4, 16, expect="WRONG dq"),
    Case("toy deepseek_v3: hd24 (v 16 padded to 24), MHA", TOY, 4, 4, 24, expect="ok"),
    Case("hd24 with GQA 4:2", TOY, 4, 2, 24, expect="ok"),
    Case("toy hd16 GQA, zero-padded to 32 (workaround)", TOY, 4, 2, 16, pad_to=32, expect="ok"),
    Case("hd48 GQA 4:2", TOY, 4, 2, 48, expect="WRONG dq dk dv"),
    Case("hd64 GQA 16:4, varlen 512+384+128", (512, 384, 128), 16, 4, 64, expect="ok"),
    Case("hd128 GQA 32:8, varlen 1024+512", (1024, 512), 32, 8, 128, expect="ok"),
    Case("hd32 GQA 4:2", TOY, 4, 2, 32, expect="ok"),
    Case("hd80 GQA 8:2, varlen 300+200", (300, 200), 8, 2, 80, expect="WRONG dq dk dv"),
    Case("toy gpt_oss: hd16 GQA, window 8", TOY, 4, 2, 16, window=7, expect="WRONG dq dk dv"),
    Case("toy hd16 GQA, dense 2x32", (32,), 4, 2, 16, dense_batch=2, expect="WRONG dq dk dv"),
    Case("hd128 MHA dense 2x512, not causal", (512,), 16, 16, 128, causal=False, dense_batch=2, expect="ok"),
    Case("deepseek_v3 toy raw: hd24, hd_v 16, MHA (no padding)", TOY, 4, 4, 24, head_dim_v=16, expect="ok"),
]


def installed(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(not installed)"


def read_pythonpath_pth_files() -> None:
    """Read the `.pth` files of every PYTHONPATH entry, as Python does for site-packages only (a
    `pip --target` install of nvidia-cutlass-dsl makes `cutlass` importable only through one)."""
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if os.path.isdir(entry):
            site.addsitedir(entry)


def cu_seqlens(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return F.pad(torch.tensor(lens, device=device).cumsum(0), (1, 0)).to(torch.int32)


def allowed(lens: tuple[int, ...], causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """[total, total] bool: which key each query of the packed sequences may attend to."""
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    ok = seq[:, None] == seq[None, :]
    if causal:
        ok &= pos[None, :] <= pos[:, None]
    if window is not None:
        ok &= pos[:, None] - pos[None, :] <= window
    return ok


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    sdpa: bool) -> torch.Tensor:
    """Attention of packed [total, heads, dim] tensors under `mask`: plain math (sdpa=False, for float64)
    or torch's scaled_dot_product_attention (the bf16 yardstick). KV heads are repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, total, dim]
    if sdpa:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
    else:
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v
    return out.transpose(0, 1)


def max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def fa4_attention(fa, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  max_seqlen: object = None) -> torch.Tensor:
    """flash_attn.cute on packed [total, heads, dim] tensors, as the case says (dense, varlen, padded)."""
    dim, dv = q.shape[-1], v.shape[-1]
    if case.pad_to:
        q, k, v = (F.pad(t, (0, case.pad_to - t.shape[-1])) for t in (q, k, v))
    options = {"softmax_scale": scale, "causal": case.causal}
    if case.window is not None:
        options["window_size"] = (case.window, 0 if case.causal else case.window)
    if case.dense_batch:
        b, n = case.dense_batch, case.lens[0]
        out = _dense_out(fa.flash_attn_func(*(t.reshape(b, n, *t.shape[1:]) for t in (q, k, v)), **options), case)
    else:
        cu = cu_seqlens(case.lens, q.device)
        longest = max(case.lens) if max_seqlen is None else max_seqlen
        out = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                        max_seqlen_k=longest, **options)
        out = out[0] if isinstance(out, tuple) else out
    return out[..., :dv] if case.pad_to else out


def _dense_out(out: object, case: Case) -> torch.Tensor:
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(case.dense_batch * case.lens[0], *out.shape[-2:])


def inputs(case: Case, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = case.dense_batch * case.lens[0] if case.dense_batch else sum(case.lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    q, k = rand(total, case.heads, case.head_dim), rand(total, case.kv_heads, case.head_dim)
    v, dout = rand(total, case.kv_heads, case.dv), rand(total, case.heads, case.dv)
    return q, k, v, dout


def grads(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dtype: torch.dtype
          ) -> dict[str, torch.Tensor]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), **{name: t.grad for name, t in zip(("dq", "dk", "dv"), leaves)}}


@dataclass
class Row:
    case: str
    shape: str
    accum: str
    expect: str
    status: str = "not run"
    ratios: dict[str, float] = field(default_factory=dict)  # fa4 error / sdpa bf16 error, per tensor
    errors: dict[str, float] = field(default_factory=dict)  # fa4 error against float64
    noise: dict[str, float] = field(default_factory=dict)  # sdpa bf16 error against float64
    seconds: float = 0.0
    note: str = ""


def run_case(fa, case: Case, device: torch.device) -> Row:
    kernel, post = accum_dims(case.pad_to or case.head_dim)
    lens = f"{case.dense_batch}x{case.lens[0]}" if case.dense_batch else "+".join(map(str, case.lens))
    shape = (f"q{case.heads} kv{case.kv_heads} d{case.head_dim}" + (f"/{case.dv}" if case.dv != case.head_dim else "")
             + f" {lens}" + (" causal" if case.causal else "") + (f" w{case.window}" if case.window is not None else ""))
    row = Row(case.name, shape, f"{kernel}/{post}" + ("" if kernel == post else " !"), case.expect)
    q, k, v, dout = inputs(case, device)
    scale = 1.0 / math.sqrt(case.head_dim)
    if case.dense_batch:
        lens_mask = (case.lens[0],) * case.dense_batch
    else:
        lens_mask = case.lens
    mask = allowed(lens_mask, case.causal, case.window, device)
    start = time.perf_counter()
    ref = grads(lambda q, k, v: torch_attention(q, k, v, mask, scale, sdpa=False), q, k, v, dout, torch.float64)
    noise = grads(lambda q, k, v: torch_attention(q, k, v, mask, scale, sdpa=True), q, k, v, dout, torch.bfloat16)

    def call(q, k, v):
        return fa4_attention(fa, case, q, k, v, scale)

    try:
        got = grads(call, q, k, v, dout, torch.bfloat16)
        if q.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:  # a refusal or a crash is the case's result
        row.status, row.note = "ERROR", describe(exc)
        row.seconds = round(time.perf_counter() - start, 1)
        return row
    for name in TENSORS:
        row.errors[name] = max_rel(got[name], ref[name])
        row.noise[name] = max_rel(noise[name], ref[name])
        row.ratios[name] = row.errors[name] / max(row.noise[name], 1e-12)
    bad = [name for name in TENSORS if row.ratios[name] > WRONG]
    row.status = "WRONG " + " ".join(bad) if bad else "ok"
    row.seconds = round(time.perf_counter() - start, 1)
    return row


def describe(exc: BaseException) -> str:
    """`Type: message` and the innermost frame of the libraries (flash_attn, cutlass, transformers)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if any(part in f.filename for part in ("flash_attn", "cutlass", "transformers"))]
    where = ""
    if frames:
        inner = [f for f in frames if "flash_attn" in f.filename] or frames
        f = inner[-1]
        where = f" (innermost flash_attn frame: {'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} in {f.name})"
    message = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {message}{where}"


def packed_cases(fa, device: torch.device) -> list[Row]:
    """fa4's varlen call with max_seqlen as an int and as a 0-d tensor, and transformers' flash_attention_4
    path with packed position ids (what the `flash_attention_4` backend's packed layout runs)."""
    case = Case("", TOY, 4, 2, 64)  # a head dim whose backward is right, so only the max_seqlen differs
    scale = 1.0 / math.sqrt(case.head_dim)
    rows = []
    longest = torch.tensor(max(case.lens), device=device, dtype=torch.int32)
    tried = [("fa4 varlen, max_seqlen=int", lambda q, k, v: fa4_attention(fa, case, q, k, v, scale)),
             ("fa4 varlen, max_seqlen=0-d CUDA tensor", lambda q, k, v: fa4_attention(fa, case, q, k, v, scale, longest))]
    try:
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        pos = torch.cat([torch.arange(n, device=device) for n in case.lens])[None]

        def hf(q, k, v):
            out = _flash_attention_forward(q[None], k[None], v[None], None, query_length=q.shape[0], is_causal=True,
                                           position_ids=pos, softmax_scale=scale,
                                           attn_implementation="flash_attention_4")
            return out[0]

        tried.append(("transformers _flash_attention_forward(flash_attention_4), packed position_ids", hf))
    except Exception as exc:
        rows.append(Row("transformers flash_attention_4 packed", "", "", "", "ERROR", note=f"import: {describe(exc)}"))
    q, k, v, dout = inputs(case, device)
    for name, fn in tried:
        row = Row(name, f"q4 kv2 d64 {'+'.join(map(str, case.lens))} causal", "", "")
        start = time.perf_counter()
        for stage in ("forward", "backward"):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            try:
                out = fn(*leaves)
                if stage == "backward":
                    out.backward(dout)
                if q.is_cuda:
                    torch.cuda.synchronize()
                row.status = "ok" if stage == "backward" else "forward ok"
            except Exception as exc:
                row.status, row.note = f"ERROR in {stage}", describe(exc)
                break
        row.seconds = round(time.perf_counter() - start, 1)
        rows.append(row)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| case | shape | accum (kernel/post) | out | dq | dk | dv | verdict | predicted | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r.ratios[n]:.3g}x" if n in r.ratios else "-" for n in TENSORS]
        verdict = r.status + (f": {r.note}" if r.note else "")
        lines.append(f"| {r.case} | {r.shape} | {r.accum} | {' | '.join(cells)} | {verdict} | {r.expect} | {r.seconds} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the cases (default 150)")
    parser.add_argument("--case", action="append", default=[], metavar="NAME",
                        help="run only the cases whose name starts with NAME (repeatable; default: all)")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.case or any(c.name.startswith(name) for name in args.case)]
    if args.case and not cases:
        parser.error(f"--case: no case name starts with {', '.join(map(repr, args.case))}")
    device = torch.device(os.environ.get("REPRO_FA4_DEVICE", "cuda"))  # cpu: the tests' stand-in package
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skip: repro_fa4 needs a CUDA GPU (flash_attn.cute runs on sm80+; its backward on sm90+)")
        return 0
    read_pythonpath_pth_files()
    try:
        import flash_attn.cute as fa
    except Exception as exc:
        print(f"skip: flash_attn.cute does not import: {type(exc).__name__}: {exc}"[:300])
        return 0
    label = f"flash-attn-4 {installed('flash-attn-4')}"
    cuda = device.type == "cuda"
    env = {"library": label, "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else "cpu",
           "nvidia-cutlass-dsl": installed("nvidia-cutlass-dsl"), "transformers": installed("transformers")}
    print(json.dumps(env), flush=True)
    start, rows = time.perf_counter(), []

    def save() -> None:  # after every case: a run cut short by a timeout still leaves what it measured
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "repro_fa4.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]},
                                                               indent=1))

    for case in cases:
        if time.perf_counter() - start > args.budget:
            rows.append(Row(case.name, "", "", case.expect, "not run", note="past the budget"))
            continue
        try:
            rows.append(run_case(fa, case, device))
        except Exception as exc:  # the torch side (memory, a poisoned CUDA context): the case's ERROR
            rows.append(Row(case.name, "", "", case.expect, "ERROR", note=describe(exc)))
        r = rows[-1]
        print(f"{r.case}: {r.status} {' '.join(f'{n} {v:.3g}x' for n, v in r.ratios.items())} {r.note} ({r.seconds}s)",
              flush=True)
        save()
    if time.perf_counter() - start <= args.budget + 30:
        rows.extend(packed_cases(fa, device))
    else:
        rows.append(Row("packed ValueError cases", "", "", "", "not run", note="past the budget"))
    text = (f"fa4 repro: {label}, torch {env['torch']}, {env['gpu']} ({env['capability']}); "
            f"ratios: max error vs float64 over torch bf16 sdpa's (WRONG: > {WRONG:g}x)\n\n" + table(rows))
    print("\n" + text, flush=True)
    save()
    if args.out:
        (args.out / "repro_fa4.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
