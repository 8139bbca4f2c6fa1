"""The reproduction of docs/findings/transformers-flex-sinks-lse-bf16.md (`repro_flex_sinks_lse.py`, run from
the doc): transformers' flex renormalisation for attention sinks, with the log-sum-exp rounded to bfloat16,
moves heads systematically; kept in float32 it does not."""

from __future__ import annotations

import findings

tool = findings.load("repro_flex_sinks_lse.py")


def test_the_bfloat16_log_sum_exp_shifts_a_head_several_times_more_than_float32_and_eager():
    worst = {name: max(map(abs, shifts)) for name, shifts in tool.measure().items()}
    rounded = worst["flex, lse in bfloat16 (transformers)"]
    assert rounded > 5 * worst["flex, lse kept in float32"] and rounded > 2 * worst["eager, bfloat16"], worst
