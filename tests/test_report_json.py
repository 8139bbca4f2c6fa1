"""The JSON report carries what a picture of a failure needs: where each tensor sits in the model,
its worst rows (which tokens), and route flips per expert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import faults
from veosnap.golden import names, store
from veosnap.surfaces.cli import main

FAULTS_FILE = Path(__file__).with_name("faults.py")


def check_json(project, capsys, fault: str, model: str = "qwen3_moe") -> dict:  # noqa: ANN001
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]
    code = main(["check", *dirs, "--model", model, "--dtype", "float32", "--backend", f"{FAULTS_FILE}:{fault}",
                 "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == (0 if doc["passed"] else 1)
    return doc["results"][0]


def test_worst_rows_name_the_tokens_of_the_leaking_sequence(repo_project, capsys):
    result = check_json(repo_project, capsys, "pad_leak")
    tensors = {t["name"]: t for t in result["tensors"]}
    layer1 = tensors["layers.1.output"]
    assert (layer1["stage"], layer1["group"], layer1["layer"]) == ("forward", "output", 1)
    assert layer1["rows_over"] == 17 and layer1["rows"] == 86  # the 17 real tokens of the leaking sequence
    worst = layer1["worst_rows"]
    assert len(worst) == 5 and all(w["batch"] == faults.PAD_LEAK_ROW for w in worst)
    assert worst[0]["ratio"] == layer1["ratio"] and worst[0]["error"] == layer1["error"]
    assert [w["ratio"] for w in worst] == sorted((w["ratio"] for w in worst), reverse=True)
    assert f"row {worst[0]['batch']} pos {worst[0]['pos']} (token {worst[0]['token']})" in layer1["where"]
    grad = tensors["grad.model.layers.1.self_attn.o_proj.weight"]
    assert (grad["stage"], grad["group"], grad["layer"]) == ("gradient", "attention", 1)
    assert grad["worst_rows"][0]["batch"] is None and grad["worst_rows"][0]["row"] >= 0
    assert tensors["loss"]["worst_rows"] == []  # one value: no rows to rank
    assert result["next"].startswith("veosnap check --model qwen3_moe --dtype float32 --backend ")


def test_route_flips_are_counted_per_expert(repo_project, capsys):
    result = check_json(repo_project, capsys, "one_token_rerouted")
    first, second = result["routes"]
    assert first["clear_flips"] == 1 and sum(first["gained"]) == 1 and sum(first["lost"]) == 1
    gained, lost = first["gained"].index(1), first["lost"].index(1)
    assert gained != lost
    assert len(first["gained"]) == len(first["lost"]) == 8  # qwen3_moe's 8 experts
    # The fault moves the batch's last token; the golden sent it to `lost` and not to `gained`.
    gold = store.read(repo_project.goldens / repo_project.hardware_class / "qwen3_moe" / "step-float32.safetensors.zst")
    experts = gold.tensors[f"routes.{first['layer']}.experts"]
    assert first["first_flipped_token"] == experts.shape[0] - 1
    assert lost in experts[-1].tolist() and gained not in experts[-1].tolist()
    assert sum(second["gained"]) == sum(second["lost"]) == 0


def test_a_passing_check_has_no_next_step(repo_project, capsys):
    dirs = ["--goldens", str(repo_project.goldens), "--configs", str(repo_project.configs)]
    assert main(["check", *dirs, "--model", "llama", "--dtype", "float32", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["next"] is None


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_every_zoo_tensor_has_a_place(repo_project, model):
    gold = store.read(repo_project.goldens / repo_project.hardware_class / model / "step-float32.safetensors.zst")
    layers = sum(name.endswith(".output") for name in gold.compared_names())
    for name in gold.compared_names():
        where = names.parse(name)
        assert where.group != "other", name
        if name.startswith("grad.") and ".layers." in name:
            assert where.stage == "gradient" and 0 <= where.layer < layers, name
    assert names.parse("grad.model.layers.0.mlp.gate_proj.weight").group == "mlp"  # a dense MLP, not a router
    assert names.parse("grad.model.layers.0.mlp.gate.weight").group == "router"
    update = names.parse("update.model.layers.1.self_attn.q_norm.weight")
    assert (update.stage, update.group, update.layer) == ("update", "norm", 1)
