"""The reproduction of docs/findings/fa4-sm90-backward-head-dim.md (`repro_fa4.py`, run from the doc) on the CPU:
it skips cleanly without CUDA, and its measuring (float64 reference,
bf16 sdpa yardstick, the verdict) says ok for a right attention and WRONG for one whose backward is
off, run through a torch stand-in for flash_attn.cute's two entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import findings
import torch
import torch.nn.functional as F

tool = findings.load("repro_fa4.py")


def stand_in(dq_scale: float = 1.0) -> SimpleNamespace:
    """flash_attn.cute's dense and varlen entry points in torch (bf16 sdpa); `dq_scale` != 1 plants a
    backward bug: the query gradient comes out scaled, the forward stays right."""

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * dq_scale

    def varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               window_size=(None, None)):
        assert isinstance(max_seqlen_q, int)
        lens = tuple(int(n) for n in cu_seqlens_q.diff())
        mask = tool.allowed(lens, causal, window_size[0], q.device)
        return tool.torch_attention(ScaleGrad.apply(q), k, v, mask, softmax_scale, sdpa=True), None

    def dense(q, k, v, *, softmax_scale, causal, window_size=(None, None)):
        b, n = q.shape[:2]
        cu = F.pad(torch.full((b,), n).cumsum(0), (1, 0)).to(torch.int32)
        out, _ = varlen(*(t.reshape(b * n, *t.shape[2:]) for t in (q, k, v)), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=n, max_seqlen_k=n, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size)
        return out.reshape(b, n, *out.shape[1:]), None

    return SimpleNamespace(flash_attn_func=dense, flash_attn_varlen_func=varlen)


CPU_CASES = [tool.Case("varlen GQA", (9, 6, 4), 4, 2, 16), tool.Case("dense window", (8,), 2, 2, 8, window=3, dense_batch=2),
             tool.Case("padded to 32", (7, 5), 4, 2, 16, pad_to=32), tool.Case("hd_v narrower", (6, 6), 2, 2, 24, head_dim_v=16)]


def test_a_right_attention_is_within_bf16_noise_on_every_tensor():
    for case in CPU_CASES:
        row = tool.run_case(stand_in(), case, torch.device("cpu"))
        assert row.status == "ok", (case.name, row)
        assert set(row.ratios) == {"out", "dq", "dk", "dv"} and all(r < 2 for r in row.ratios.values())


def test_a_wrong_query_gradient_is_marked_wrong_and_only_there():
    row = tool.run_case(stand_in(dq_scale=1.5), CPU_CASES[0], torch.device("cpu"))
    assert row.status == "WRONG dq", row
    assert row.ratios["dq"] > tool.WRONG and row.ratios["out"] < 2 and row.ratios["dk"] < 2


def test_the_accumulator_rounding_column_flags_the_head_dims_that_disagree():
    assert tool.accum_dims(16) == (16, 32) and tool.accum_dims(48) == (48, 64) and tool.accum_dims(80) == (80, 96)
    assert tool.accum_dims(24) == (32, 32) and tool.accum_dims(64) == (64, 64) and tool.accum_dims(128) == (128, 128)
    assert tool.accum_dims(192) == (192, 192)


def test_without_cuda_it_says_why_and_exits_0(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(out)}
    script = findings.write("repro_fa4.py", tmp_path)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("skip: repro_fa4 needs a CUDA GPU")
    assert not list(out.iterdir())


FAKE_CUTE = '''
"""A torch stand-in for flash_attn.cute with the two faults the reproduction looks for: the query
gradient off by half, and a 0-d tensor max_seqlen refused as CuTe refuses it."""
import torch

def _attend(q, k, v, lens, scale, causal):
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        g = q.shape[1] // k.shape[1]
        qq, kk, vv = (t[sl].transpose(0, 1) for t in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
        s = qq @ kk.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vv).transpose(0, 1))
        start += n
    return torch.cat(outs)

class _HalfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        return g * 1.5

def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, window_size=(None, None)):
    if torch.is_tensor(max_seqlen_q):
        raise ValueError(f"Expected IntTuple, whose leaves are integers, but got {max_seqlen_q}")
    lens = [int(n) for n in cu_seqlens_q.diff()]
    q = _HalfGrad.apply(q) if q.shape[-1] % 32 else q
    return _attend(q, k, v, lens, softmax_scale, causal), None

def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None)):
    b, n = q.shape[:2]
    out = _attend(*(t.reshape(b * n, *t.shape[2:]) for t in (q, k, v)), [n] * b, softmax_scale, causal)
    return out.reshape(b, n, *out.shape[1:]), None
'''


def test_the_whole_script_on_a_stand_in_package_finds_both_faults(tmp_path):
    """main() end to end on the CPU: a stand-in flash_attn.cute (wrong dq at head dims not a multiple of
    32, a tensor max_seqlen refused) makes the table say WRONG dq / ok and name the ValueError."""
    (tmp_path / "site" / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "site" / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "site" / "flash_attn" / "cute" / "__init__.py").write_text(FAKE_CUTE)
    env = {**os.environ, "REPRO_FA4_DEVICE": "cpu", "PYTHONPATH": str(tmp_path / "site")}
    # A budget no run reaches: every case must run whatever the machine's speed (on a slower 2-core box the last
    # cases were cut at 60 s); the subprocess timeout is the guard against a hang.
    # The cases asserted on below: the real-width ones (hd128, 1,536 tokens) cost minutes of float64 on a CPU.
    cases = ["toy llama/qwen/mixtral", "toy hd16 without GQA", "toy deepseek_v3: hd24 (v 16 padded", "toy hd16 GQA, zero",
             "hd64 GQA 16:4"]
    script = findings.write("repro_fa4.py", tmp_path)
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out"), "--budget", "3600",
                             *(f"--case={c}" for c in cases)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["case"]: r for r in __import__("json").loads((tmp_path / "out" / "repro_fa4.json").read_text())["rows"]}
    assert rows["toy llama/qwen/mixtral: hd16, GQA 4:2"]["status"] == "WRONG dq"
    assert rows["toy deepseek_v3: hd24 (v 16 padded to 24), MHA"]["status"] == "WRONG dq"  # 24 % 32: the stand-in's rule
    assert rows["toy hd16 GQA, zero-padded to 32 (workaround)"]["status"] == "ok"
    assert rows["hd64 GQA 16:4, varlen 512+384+128"]["status"] == "ok"
    assert rows["fa4 varlen, max_seqlen=int"]["status"] == "ok"
    tensor = rows["fa4 varlen, max_seqlen=0-d CUDA tensor"]
    assert tensor["status"] == "ERROR in forward"
    assert tensor["note"].startswith("ValueError: Expected IntTuple, whose leaves are integers, but got 32 "
                                     "(innermost flash_attn frame: flash_attn/cute/__init__.py:")
    # transformers 5.24 itself hands the stand-in a 0-d tensor for packed sequences: the ValueError's cause
    hf = rows["transformers _flash_attention_forward(flash_attention_4), packed position_ids"]
    assert hf["status"] == "ERROR in forward" and hf["note"].startswith("ValueError: Expected IntTuple")
    assert "| toy hd16 without GQA (4:4) | q4 kv4 d16 32+29+23+17 causal | 16/32 ! |" in result.stdout
    assert (tmp_path / "out" / "repro_fa4.md").read_text().startswith("fa4 repro: flash-attn-4 (not installed)")
