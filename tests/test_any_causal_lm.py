"""Any causal LM (docs/own-models.md, "Architectures"): a tiny config of each architecture transformers' causal-LM
auto mapping builds is recorded and checked in a project of its own, as a user would, and a bug planted in its
first decoder layer is caught there. The decoder layers, their outputs, the experts and routers are found from
the model's structure (GPT-2's `transformer.h`, BERT's `bert.encoder.layer`, Mamba's `backbone.layers`), so no
architecture needs a line of veosnap code; one that cannot be supported is refused in one line, before a golden
is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from golden_repo import CLASS, REPO

from veosnap.surfaces.cli import main

BUG = f"{REPO / 'tests' / 'faults.py'}:first_layer_scaled"

# Tiny shapes in each family's own field names: hidden 64, 2 layers, 4 heads, vocab 256 (the test data's ids go
# to 250), 128 positions, and the zoo's special tokens (veosnap's limits: docs/own-models.md).
SPECIAL = {"vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 128}
GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "max_position_embeddings": 128, "is_decoder": True}
BART = {"d_model": 64, "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4,
        "encoder_attention_heads": 4, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "max_position_embeddings": 128,
        "decoder_start_token_id": 1}
MOE = {**LLAMA, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

ARCHITECTURES: dict[str, dict] = {
    # decoder-only transformers, each family spelling its sizes its own way
    "gpt2": GPT2,
    "openai-gpt": GPT2,
    "gpt_bigcode": GPT2,
    "gptj": {**GPT2, "rotary_dim": 16},
    "codegen": {**GPT2, "n_ctx": 128, "rotary_dim": 16},
    "ctrl": {**GPT2, "dff": 128},
    "gpt_neo": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 128,
                "attention_types": [[["global", "local"], 1]]},
    "gpt_neox": LLAMA,
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
    "falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    "mpt": {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
    "opt": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 128,
            "word_embed_proj_dim": 64, "max_position_embeddings": 128},
    "xglm": {"d_model": 64, "num_layers": 2, "attention_heads": 4, "ffn_dim": 128, "max_position_embeddings": 128},
    "biogpt": {**BERT, "is_decoder": False},
    "gemma": {**LLAMA, "head_dim": 16},
    "gemma2": {**LLAMA, "head_dim": 16},
    "gemma3_text": {**LLAMA, "head_dim": 16},
    "phi": LLAMA,
    "phi3": LLAMA,
    "mistral": LLAMA,
    "olmo2": LLAMA,
    "cohere": LLAMA,
    "stablelm": LLAMA,
    "starcoder2": LLAMA,
    "persimmon": LLAMA,
    "glm": {**LLAMA, "head_dim": 16},
    # encoders and encoder-decoders run as a causal decoder
    "bert": BERT,
    "roberta": BERT,
    "electra": {**BERT, "embedding_size": 64},
    "bart": BART,
    "mbart": BART,
    "whisper": {**BART, "max_target_positions": 128},
    # state-space models: no attention at all
    "mamba": {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 8},
    "falcon_mamba": {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 8},
    # mixture-of-experts: the MoE blocks, their experts and routers found by shape, every token's route recorded
    "olmoe": {**LLAMA, "num_experts": 8, "num_experts_per_tok": 2},
    "flex_olmo": {**LLAMA, "num_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {**LLAMA, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 32},
    "glm4_moe": {**LLAMA, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1},
    "dots1": {**LLAMA, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1},
}
MOE_ROUTED = {"olmoe", "flex_olmo", "granitemoe", "qwen2_moe", "glm4_moe", "dots1"}
# No sdpa attention: state-space layers only (Mamba), or attention logits soft-capped (Gemma 2), which transformers
# computes in eager only.
NO_SDPA = {"mamba", "falcon_mamba", "gemma2"}

# What veosnap cannot support, and the one line that says why (refused before a golden is written).
REFUSED: dict[str, tuple[dict, str]] = {
    # CPM-Ant's layers run its own prompt positions before the batch's tokens: no layer output per token
    "cpmant": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
               "CpmAntForCausalLM: decoder layer cpmant.encoder.layers.0 returns hidden states [4, 64, 64], not one "
               "per token of the batch [4, 32], so veosnap cannot compare its output token by token"),
}


def tiny(model_type: str, fields: dict) -> dict:
    """The config file of a tiny `model_type`: its fields, and every dropout of its config class set to 0 (GPT-2's
    keep 0.1 by default; the golden is one deterministic step)."""
    defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
    dropouts = {name: 0.0 for name, value in defaults.items() if isinstance(value, float)
                and ("dropout" in name or name.endswith(("pdrop", "drop_rate")))}
    return {"model_type": model_type, **SPECIAL, **dropouts, **fields}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A downstream project with a toy_configs/ of its own and no goldens yet; the current directory."""
    monkeypatch.chdir(tmp_path)

    def add(name: str, config: dict) -> Path:
        path = tmp_path / "toy_configs" / name / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))
        return path

    return add


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """A command's exit code, its report (past the project header a check opens with) and its stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    if out.startswith("project "):
        header, _, out = out.partition("\n\n")
        assert header.startswith(f"project {Path.cwd()}: goldens goldens"), header
    return code, out, err


@pytest.mark.heavy
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_a_tiny_config_records_checks_and_catches_a_bug_in_its_first_layer(project, capsys, model_type):
    name = f"my{model_type}".replace("-", "_")
    project(name, tiny(model_type, ARCHITECTURES[model_type]))
    code, out, err = run(capsys, "record", "--model", name, "--dtype", "float32")
    assert code == 0 and out.startswith(f"wrote     goldens/{CLASS}/{name}/step-float32.safetensors.zst"), err
    assert ("min router margin" in out) == (model_type in MOE_ROUTED), out  # every MoE layer's routes recorded

    code, out, err = run(capsys, "check", "--model", name, "--dtype", "float32", "--backend", "sdpa")
    if model_type in NO_SDPA:  # no sdpa attention to swap in: a skip that says so, and the reference again
        assert code == 0 and "does not support an attention implementation through torch.nn.functional.scaled_dot_" \
                             "product_attention" in out, out + err
        code, out, err = run(capsys, "check", "--model", name, "--dtype", "float32", "--backend", "eager")
        assert code == 0 and out.startswith(f"PASS  {CLASS}/{name}/step-float32  backend=eager"), out + err
    else:
        assert code == 0 and out.startswith(f"PASS  {CLASS}/{name}/step-float32  backend=sdpa"), out + err

    # Layer 0's output 1% too large: the check fails, and names that layer as where the forward first diverges.
    code, out, err = run(capsys, "check", "--model", name, "--dtype", "float32", "--backend", BUG, "--format", "json")
    (result,) = json.loads(out)["results"]
    assert code == 1 and result["status"] == "FAIL", out + err
    assert result["first_divergence"].startswith("layer 0 (layers.0.output, "), result["first_divergence"]


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_an_architecture_veosnap_cannot_support_is_refused_in_one_line(project, capsys, model_type):
    fields, why = REFUSED[model_type]
    path = project(model_type, tiny(model_type, fields))
    code, out, err = run(capsys, "record", "--model", model_type, "--dtype", "float32")
    assert (code, out) == (2, "")
    assert err.startswith("veosnap: error: ") and err.count("\n") == 1 and why in err, err
    assert path.is_file() and not Path("goldens").exists()


def test_a_router_that_takes_every_expert_records_routes_nothing_can_flip(project, capsys):
    # Kimi-Linear's tiny config leaves top-k at its default, all 8 experts: every margin is the largest float32
    # (no unchosen expert to lose to), as a hash router's, not an infinity the manifest cannot hold.
    zoo = json.loads((REPO / "toy_configs" / "qwen3_moe" / "config.json").read_text())
    project("every_expert", {**zoo, "num_experts_per_tok": zoo["num_experts"]})
    code, out, err = run(capsys, "record", "--model", "every_expert", "--dtype", "float32")
    assert code == 0 and "min router margin 3.4e+38" in out, out + err
    assert run(capsys, "check", "--model", "every_expert", "--dtype", "float32", "--backend", "sdpa")[0] == 0


def test_the_decoder_stack_is_found_once_per_model_and_again_when_a_candidate_rebuilt_it(monkeypatch):
    # A check asks for it some six times (limits, coverage, each pass's hooks): one search, revalidated by its path.
    import torch
    from torch import nn

    from veosnap.reference import models, probes
    from veosnap.reference.zoo import Project, load_config

    model = models.build(load_config(Project.resolve().configs, "llama"), torch.float32)
    searches: list[int] = []
    search = probes._decoder_stack
    monkeypatch.setattr(probes, "_decoder_stack", lambda m: searches.append(1) or search(m))
    probes._STACKS.pop(model, None)  # the build asked already
    first = probes.decoder_stack(model)
    assert probes.decoder_stack(model) == first and probes.decoder_layers(model) is first[1] and len(searches) == 1
    model.model.layers = nn.ModuleList(list(model.model.layers)[:1])  # a candidate that rebuilt the stack
    assert probes.decoder_stack(model) == ("model.layers", model.model.layers) and len(searches) == 2
    # A hook on a layer that refers to the model (a candidate's patch) does not keep the model alive through the cache.
    import gc
    import weakref

    model.model.layers[0].register_forward_hook(lambda *_, owner=model: None)
    gone = weakref.ref(model)
    del model, first
    gc.collect()
    assert gone() is None
