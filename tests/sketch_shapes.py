"""Golden tensor shapes of real-width models, computed from their configs (nothing is allocated).

Used by tests/test_sketch.py (the planner's budget at about 1B parameters) and by
tools/measure/sketch_accuracy.py (the sizes table of docs/sketch.md). Parameter names follow transformers 5
(fused experts: `mlp.experts.gate_up_proj` (E, 2 * moe_inter, hidden), `mlp.experts.down_proj`
(E, hidden, moe_inter)), as the toy goldens show.
"""

from __future__ import annotations

from dataclasses import dataclass

from veosnap.numerics.sketch import TensorShape

VOCAB = 151936
HEAD_DIM = 128


@dataclass(frozen=True)
class RealShape:
    """The widths of a real model that matter for a golden's size."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int = 0  # dense MLP
    experts: int = 0  # MoE: experts per layer, their width, tokens per expert choice
    moe_intermediate: int = 0
    top_k: int = 0
    tied: bool = False  # tie_word_embeddings: the embedding gradient is dense (it is the LM head's)


QWEN3_0_6B = RealShape("qwen3-0.6b-like", hidden=1024, heads=16, kv_heads=8, intermediate=3072, tied=True)
QWEN3_1_7B = RealShape("qwen3-1.7b-like", hidden=2048, heads=16, kv_heads=8, intermediate=6144, tied=True)
QWEN3_30B_A3B = RealShape("qwen3-30b-a3b-like", hidden=2048, heads=32, kv_heads=4, experts=128,
                          moe_intermediate=768, top_k=8)
REAL_SHAPES = (QWEN3_0_6B, QWEN3_1_7B, QWEN3_30B_A3B)


def golden_shapes(model: RealShape, layers: int, tokens: int = 8192, dtype: str = "bfloat16",
                  batch: int = 4) -> tuple[list[TensorShape], int]:
    """The golden's toleranced tensors (as the planner sees them) and the bytes of the rest (inputs,
    route ids and margins), for `layers` decoder layers and `tokens` tokens in `batch` rows."""
    seq = tokens // batch
    h, q, kv = model.hidden, model.heads * HEAD_DIM, model.kv_heads * HEAD_DIM
    out = [
        TensorShape("loss", (), "float32", sketchable=False),
        TensorShape("logits", (batch, seq, VOCAB), dtype),
        TensorShape("grad.model.norm.weight", (h,), dtype),
        TensorShape("grad.model.embed_tokens.weight", (VOCAB, h), dtype,
                    support_rows=None if model.tied else tokens),
    ]
    if not model.tied:
        out.append(TensorShape("grad.lm_head.weight", (VOCAB, h), dtype))
    fixed = 4 * tokens * 8  # inputs: ids, mask, positions, labels (int64)
    for i in range(layers):
        p = f"grad.model.layers.{i}."
        out += [
            TensorShape(f"layers.{i}.output", (batch, seq, h), dtype),
            TensorShape(p + "input_layernorm.weight", (h,), dtype),
            TensorShape(p + "post_attention_layernorm.weight", (h,), dtype),
            TensorShape(p + "self_attn.q_proj.weight", (q, h), dtype),
            TensorShape(p + "self_attn.k_proj.weight", (kv, h), dtype),
            TensorShape(p + "self_attn.v_proj.weight", (kv, h), dtype),
            TensorShape(p + "self_attn.o_proj.weight", (h, q), dtype),
            TensorShape(p + "self_attn.q_norm.weight", (HEAD_DIM,), dtype),
            TensorShape(p + "self_attn.k_norm.weight", (HEAD_DIM,), dtype),
        ]
        if model.experts:
            e, mi = model.experts, model.moe_intermediate
            out += [
                TensorShape(p + "mlp.gate.weight", (e, h), dtype),
                TensorShape(p + "mlp.experts.gate_up_proj", (e, 2 * mi, h), dtype),
                TensorShape(p + "mlp.experts.down_proj", (e, h, mi), dtype),
                TensorShape(f"routes.{i}.weights", (tokens, model.top_k), dtype, sketchable=False),
            ]
            fixed += tokens * model.top_k * 4 + tokens * 4  # expert ids (int32), margins (float32)
        else:
            inter = model.intermediate
            out += [
                TensorShape(p + "mlp.gate_proj.weight", (inter, h), dtype),
                TensorShape(p + "mlp.up_proj.weight", (inter, h), dtype),
                TensorShape(p + "mlp.down_proj.weight", (h, inter), dtype),
            ]
    return out, fixed


def parameters(model: RealShape, layers: int) -> int:
    """The model's parameter count at `layers` layers (from the gradient shapes)."""
    shapes, _ = golden_shapes(model, layers, tokens=8)
    return sum(_numel(t.shape) for t in shapes if t.name.startswith("grad."))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
