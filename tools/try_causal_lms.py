"""Try every architecture of transformers' causal-LM auto mapping as a downstream project would (issue 36).

For each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (or those given): write a tiny config into a
scratch project's `toy_configs/` (the config class's own field names, set where it has them: hidden 64, 2
layers, 4 heads, vocab 256, 128 positions, 8 experts top-2, small state-space and MLA sizes, every dropout
0), then run, in process, `veosnap record`, `veosnap check --backend sdpa` and a check of a planted bug
(`tests/faults.py:first_layer_scaled`, decoder layer 0's output 1% too large). Prints one markdown row per
architecture: recorded / checked / bug caught (the first diverging tensor), or veosnap's one-line error.

A failure here is often the generated config's (a family whose sizes must agree in ways this generic
recipe does not know: MLA head dims, a vision tower's defaults), not veosnap's: the row says which line
veosnap printed. `tests/test_any_causal_lm.py` holds the hand-written configs CI runs. CPU only; most
architectures take 1-5 s, hybrids with torch state-space kernels a minute or more.

    python tools/try_causal_lms.py [MODEL_TYPE ...] [--skip MODEL_TYPE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUG = f"{REPO / 'tests' / 'faults.py'}:first_layer_scaled"

# Field names the families use for the same few sizes; each is set only where the config class has it.
SIZES = {
    "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64, "n_embed": 64, "model_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "decoder_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "decoder_attention_heads": 4, "num_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 16,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_hidden_size": 128,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "n_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_chunk_size": 16, "mamba_n_groups": 1,
    "ssm_state_size": 8, "state_size": 8, "time_step_rank": 8, "chunk_size": 16, "n_groups": 1,
}


def tiny(model_type: str) -> dict:
    """A tiny config of `model_type` in its class's own field names, every dropout 0."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    aliases = getattr(cls, "attribute_map", {})
    config = {"model_type": model_type}
    config.update({name: value for name, value in SIZES.items() if name in defaults and name not in aliases})
    config.update({name: 0.0 for name, value in defaults.items() if isinstance(value, float)
                   and ("dropout" in name or name.endswith(("pdrop", "drop_rate")))})
    if isinstance(defaults.get("layer_types"), list) and len(defaults["layer_types"]) != 2:
        config["layer_types"] = (defaults["layer_types"] * 2)[:2]
    if model_type == "gpt_neo":
        config["attention_types"] = [[["global", "local"], 1]]
    if defaults.get("is_decoder") is False:  # an encoder run as a causal decoder
        config["is_decoder"] = True
    return config


def veosnap(*argv: str) -> tuple[int, str, str]:
    from veosnap.surfaces.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except Exception as exc:  # noqa: BLE001 - a traceback is a finding: said in the row
            code, _ = 3, err.write(f"TRACEBACK {type(exc).__name__}: {exc}")
    return code, out.getvalue(), err.getvalue()


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(("veosnap:", "TRACEBACK", "  error:"))]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "").replace("|", "\\|")


def try_one(model_type: str) -> str:
    """The markdown row for `model_type`, tried in a scratch project (the current directory is changed)."""
    root = Path(tempfile.mkdtemp(prefix=f"veosnap-{model_type}-"))
    (root / "toy_configs" / "m").mkdir(parents=True)
    (root / "toy_configs" / "m" / "config.json").write_text(json.dumps(tiny(model_type), indent=1))
    os.chdir(root)
    code, out, err = veosnap("record", "--model", "m", "--dtype", "float32")
    if code != 0:
        return f"| `{model_type}` | no: {last_line(err)} | | |"
    recorded = "yes" + (", routes" if "min router margin" in out else "")
    code, out, err = veosnap("check", "--model", "m", "--dtype", "float32", "--backend", "sdpa")
    checked = "sdpa" if code == 0 and out.startswith("PASS") else "skip (no sdpa)" if code == 0 else \
        f"no: {last_line(out + err)}"
    code, out, err = veosnap("check", "--model", "m", "--dtype", "float32", "--backend", BUG, "--format", "json")
    try:
        first = json.loads(out)["results"][0]["first_divergence"]
    except (ValueError, KeyError, IndexError):
        first = None
    caught = f"yes: {first}" if code == 1 and first else f"no: {last_line(out + err)}"
    return f"| `{model_type}` | {recorded} | {checked} | {caught} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every causal-LM model_type of transformers")
    parser.add_argument("--skip", nargs="*", default=[], help="model_types to leave out")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    print("| `model_type` | recorded | checked | bug caught |\n|---|---|---|---|", flush=True)
    for model_type in args.model_types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type not in args.skip:
            print(try_one(model_type), flush=True)


if __name__ == "__main__":
    sys.exit(main())
