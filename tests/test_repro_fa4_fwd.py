"""The reproduction of docs/findings/transformers-flash-packed-rows.md (`repro_fa4_fwd.py`, run from the doc) on the
CPU: through torch stand-ins for flash_attn.cute's two entry points, a dense
call of a packed row is WRONG against the per-sequence reference and right against plain causal attention,
and the varlen call with boundaries from the position ids is right: the verdicts the H200 run is read by."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import findings
import pytest
import reference_kernels as rk
import torch

tool = findings.load("repro_fa4_fwd.py")
KERNELS = SimpleNamespace(flash_attn_func=rk.flash_dense, flash_attn_varlen_func=rk.flash_varlen)


def verdict(rows, call, reference):
    return tool.run_case(KERNELS, "case", rows, 4, 2, 32, call, reference, torch.device("cpu"))


def test_a_dense_call_of_a_packed_row_is_wrong_only_against_the_per_sequence_reference() -> None:
    rows = [(16,), (5, 7, 4)]
    dense = verdict(rows, "dense", "per-sequence")
    assert dense["verdict"] == "WRONG" and dense["fa4_err_rows"][0] < dense["fa4_err_rows"][1] / 100
    assert verdict(rows, "dense", "causal")["verdict"] == "ok"
    assert verdict(rows, "varlen", "per-sequence")["verdict"] == "ok"
    assert verdict([(9, 1)], "varlen", "per-sequence")["verdict"] == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tool runs its cases (docs/gpu.md)")
def test_without_cuda_it_says_so_and_exits_0(tmp_path) -> None:
    script = findings.write("repro_fa4_fwd.py", tmp_path)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "no CUDA GPU" in done.stdout
