"""How clearly veosnap's routers decide at real expert counts and real hidden sizes.

Builds each MoE family at the real model's hidden size, attention shape, expert count, top-k and group
limit, with a few decoder layers (a router's decision depends on the residual stream it reads, so the
layers in front of it are there), draws its weights as veosnap does (`veosnap.reference.weights`),
runs a batch of short sequences whose tokens are spread over the vocabulary, and reports per MoE layer:
the smallest router margin over the real tokens (logit units; the recorder refuses a golden under the
tie epsilon, 1e-3 in float32 and 0.05 in bfloat16), its 1st percentile, the share of the routing
weight the top expert takes (quantiles), how many experts the batch uses, and how many vocabulary
tokens got a code that decides clearly at design time.

To fit a CPU (2 cores, a few GB), the experts' and dense MLPs' intermediate widths are narrowed
(`CPU_WIDTHS`; every projection is fan-in scaled, so the residual stream's statistics do not depend on
them: `--compare-widths` measures it) and the vocabularies of gpt-oss and DeepSeek-V3 are cut
(`CPU_VOCAB`): hidden sizes, heads, expert counts, top-k and groups are the real ones. With
`--real-widths` (a GPU, or a large machine) nothing is narrowed.

    python tools/measure/router_margins.py [--families qwen3_moe,mixtral,gpt_oss,deepseek_v3]
        [--dtypes float32,bfloat16] [--rows 4] [--length 64] [--layers 3] [--real-widths] [--out DIR]

Prints a table; writes `router_margins.json` under --out (default $OUT when set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.initialization import no_init_weights

from veosnap.reference import models, weights
from veosnap.reference.inputs import IGNORE_INDEX, Batch
from veosnap.reference.probes import find_moe_layers, record_routes

# The real models' configs (from their config.json on the Hub), layer counts cut.
REAL = {
    "qwen3_moe": ("Qwen/Qwen3-30B-A3B", dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
        num_hidden_layers=3, tie_word_embeddings=False)),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=32768, num_hidden_layers=3, sliding_window=None, tie_word_embeddings=False)),
    "gpt_oss": ("openai/gpt-oss-20b", dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        rms_norm_eps=1e-5, sliding_window=128, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attention_bias=True, swiglu_limit=7.0, num_hidden_layers=3, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        max_position_embeddings=131072)),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, vocab_size=129280, rms_norm_eps=1e-6, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096,
        num_hidden_layers=3, tie_word_embeddings=False)),
}
FFN_KEYS = ("intermediate_size", "moe_intermediate_size")
# What the CPU run narrows: MLP and expert widths (a quarter, DeepSeek-V3's 256 experts to 32 wide) and
# the largest embedding tables (the codebook, 4096 codes, is the same at any vocabulary of 4096 or more).
CPU_WIDTHS = {
    "qwen3_moe": {"intermediate_size": 1536, "moe_intermediate_size": 192},
    "mixtral": {"intermediate_size": 1792},
    "gpt_oss": {"intermediate_size": 720},
    "deepseek_v3": {"intermediate_size": 4608, "moe_intermediate_size": 32},
}
CPU_VOCAB = {"qwen3_moe": 32768, "gpt_oss": 32768, "deepseek_v3": 16384}


def build(fields: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The HF eager model for `fields` with veosnap's weights, built without HF's own random init."""
    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with warnings.catch_warnings(), models.quiet_transformers(), no_init_weights():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=models.REFERENCE_ATTN, experts_implementation=models.REFERENCE_EXPERTS,
            dtype=dtype)
    weights.initialize(model, seed=0)
    return model.eval()


def batch(vocab: int, rows: int, length: int) -> Batch:
    """`rows` sequences of `length` tokens drawn uniformly from [3, vocab), not padded."""
    gen = torch.Generator().manual_seed(20261130)
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    labels = ids.clone()
    labels[:, 0] = IGNORE_INDEX
    return Batch(ids, torch.ones_like(ids), torch.arange(length).repeat(rows, 1), labels)


def measure(family: str, dtype_name: str, args: argparse.Namespace) -> dict:
    real, fields = REAL[family]
    fields = dict(fields, num_hidden_layers=args.layers)
    if "layer_types" in fields:
        fields["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(args.layers)]
    if not args.real_widths:
        fields.update(args.widths.get(family, CPU_WIDTHS[family]))
        fields["vocab_size"] = CPU_VOCAB.get(family, fields["vocab_size"])
    start = time.time()
    model = build(fields, models.dtype_from_name(dtype_name)).to(args.device)
    built = time.time() - start
    moe = find_moe_layers(model)
    inputs = batch(fields["vocab_size"], args.rows, args.length).to(args.device)
    with torch.no_grad(), record_routes(model) as routes:
        model(**inputs.model_kwargs(with_labels=False), use_cache=False)
    codes = model.get_input_embeddings().weight.detach().float().cpu()[:, : moe[0].num_experts]
    routers = [weights._code_router(model, m, 0) for m in moe]  # noqa: SLF001 - a measurement of the design
    design = torch.cat([weights._decides_clearly(routers, chunk) for chunk in codes.split(8192)])  # noqa: SLF001
    layers = []
    for layer, rec in sorted(routes.items()):
        share = rec.weights.float().max(dim=-1).values / rec.weights.float().sum(dim=-1)
        used = torch.bincount(rec.experts.reshape(-1), minlength=moe[0].num_experts)
        layers.append({
            "layer": layer, "tokens": int(rec.margin.numel()), "min_margin": float(rec.margin.min()),
            "p1_margin": float(rec.margin.quantile(0.01)),
            "top_share_q10_q50_q90": [round(float(q), 3) for q in share.quantile(torch.tensor([0.1, 0.5, 0.9]))],
            "experts_used": int((used > 0).sum()), "experts": moe[0].num_experts,
        })
    params = sum(p.numel() for p in model.parameters())
    del model, routers
    gc.collect()
    return {"family": family, "real": real, "dtype": dtype_name, "hidden": fields["hidden_size"],
            "top_k": moe[0].top_k, "layers_built": fields["num_hidden_layers"], "vocab": fields["vocab_size"],
            "ffn": {k: fields[k] for k in FFN_KEYS if k in fields}, "params": params, "build_s": round(built, 1),
            "design_clear": float((design >= weights.DESIGN_MARGIN).float().mean()),
            "design_min": float(design.min()), "moe_layers": layers,
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(REAL))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3, help="decoder layers (DeepSeek-V3: the first dense)")
    parser.add_argument("--real-widths", action="store_true", help="real MLP/expert widths and vocabularies")
    parser.add_argument("--compare-widths", action="store_true",
                        help="also measure each family with its CPU expert widths doubled (do margins depend on them?)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    runs = [(family, dtype_name, {}) for family in args.families.split(",") for dtype_name in args.dtypes.split(",")]
    if args.compare_widths:
        runs += [(family, "float32", {k: 2 * v for k, v in CPU_WIDTHS[family].items()})
                 for family in args.families.split(",")]
    for family, dtype_name, widths in runs:
        args.widths = {family: widths} if widths else {}
        results.append(measure(family, dtype_name, args))
        r = results[-1]
        print(f"# {family} {dtype_name}: {r['params'] / 1e6:.0f}M params, ffn {r['ffn']}, built in {r['build_s']} s, "
              f"peak RSS {r['peak_rss_gb']} GB", flush=True)
    print(f"\n{'family':12} {'dtype':9} {'hidden':>6} {'experts':>8} {'vocab':>7} {'ffn':>6} {'layer':>5} "
          f"{'tokens':>6} {'min margin':>10} {'p1':>6} {'top share q10/50/90':>20} {'used':>8} {'clear codes':>11}")
    for r in results:
        ffn = r["ffn"].get("moe_intermediate_size", r["ffn"].get("intermediate_size"))
        for layer in r["moe_layers"]:
            q = "/".join(f"{v:.2f}" for v in layer["top_share_q10_q50_q90"])
            print(f"{r['family']:12} {r['dtype']:9} {r['hidden']:>6} {layer['experts']:>4} k{r['top_k']:<2} "
                  f"{r['vocab']:>7} {ffn:>6} {layer['layer']:>5} {layer['tokens']:>6} {layer['min_margin']:>10.3f} "
                  f"{layer['p1_margin']:>6.2f} {q:>20} {layer['experts_used']:>4}/{layer['experts']:<3} "
                  f"{r['design_clear']:>10.1%}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "router_margins.json").write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
