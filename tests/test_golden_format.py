"""The golden's vocabulary and manifest: every tensor name parses and prints back, and a golden read from
disk encodes to the same bytes (the typed manifest loses nothing)."""

from __future__ import annotations

import functools
import json

import pytest
from golden_repo import CLASS, REPO, committed_tier, needs_goldens

from veosnap.golden import codec, names, store
from veosnap.golden.manifest import Manifest, TrainHyper
from veosnap.reference import scenarios
from veosnap.reference.zoo import Project, list_models, load_config


@pytest.mark.parametrize("text, kind", [
    ("inputs.input_ids", names.Input("input_ids")),
    ("loss", names.LOSS),
    ("logits", names.LOGITS),
    ("layers.12.output", names.LayerOutput(12)),
    ("grad.model.layers.1.self_attn.o_proj.weight", names.Grad("model.layers.1.self_attn.o_proj.weight")),
    ("routes.3.experts", names.Route(3, "experts")),
    ("routes.3.weights", names.Route(3, "weights")),
    ("train.loss", names.TRAIN_LOSS),
    ("train.grad_norm", names.TRAIN_GRAD_NORM),
    ("update.lm_head.weight", names.Update("lm_head.weight")),
])
def test_every_kind_of_name_parses_and_prints_back(text, kind):
    assert names.parse(text) == kind
    assert str(kind) == text


def test_what_a_name_says_about_its_tensor():
    grad = names.parse("grad.model.layers.1.self_attn.o_proj.weight")
    assert (grad.layer, grad.within_layer, grad.module) == (1, "self_attn.o_proj", "model.layers.1.self_attn.o_proj")
    assert grad.per_parameter and not grad.token_rows and grad.compared
    assert names.parse("grad.lm_head.weight").layer is None
    assert names.parse("logits").token_rows and names.parse("routes.0.weights").token_rows
    assert not names.parse("routes.0.experts").compared and not names.parse("inputs.labels").compared
    assert names.layer_of("model.layers.7.mlp.gate") == 7 and names.layer_of("model.norm") is None


@pytest.mark.parametrize("text", ["layers.01.output", "routes.1.scores", "grad.", "inputs.", "lossy", "layers.x.output"])
def test_anything_else_is_not_a_golden_tensor(text):
    assert names.try_parse(text) is None
    with pytest.raises(ValueError):
        names.parse(text)


ZOO = Project.resolve(goldens=REPO / "goldens", configs=REPO / "toy_configs", testdata=REPO / "testdata",
                      hardware_class=CLASS)


@functools.cache
def committed() -> list:
    """Every golden this checkout holds, read."""
    return [(key, path, store.read(path)) for key, path in store.list_goldens(REPO / "goldens")]


@pytest.mark.parametrize("hardware_class, tier", [("cpu", "toy"), ("cpu", "real"), ("cuda-sm90", "toy"),
                                                  ("cuda-sm90", "real")])
def test_each_class_holds_every_golden_of_its_tier(hardware_class, tier):
    """Each class holds every toy model's scenarios that have a golden file of their own, in both dtypes (100);
    the cpu class also the two real-shape goldens recorded on a CPU, the cuda-sm90 class the 16 real-shape ones
    recorded on the H200 (every real-shape config in both dtypes, by tools/gpu/gpu_real.py; docs/gpu.md)."""
    files = committed_tier(hardware_class, tier)
    if tier == "toy":
        expected = {(model, scenario.recorded, dtype) for model in ZOO.models()
                    for scenario in scenarios.applicable(load_config(ZOO.configs, model).config)
                    for dtype in ("float32", "bfloat16")}
    elif hardware_class == "cpu":
        expected = {(model, "step", "float32") for model in ("qwen3-real", "qwen3_moe-real-small")}
    else:  # gpt_oss-real bfloat16 is recorded with its excuse
        expected = {(model, "step", dtype) for model in list_models(ZOO.configs, "real")
                    for dtype in ("float32", "bfloat16")}
    keys = [store.key_of(path, REPO / "goldens") for path in files]
    assert {(k.model, k.scenario, k.dtype) for k in keys} == expected


def test_every_tensor_of_every_committed_golden_has_a_name():
    for key, _, golden in committed():
        for name in golden.tensors:
            assert str(names.parse(name)) == name, (key, name)


def test_committed_goldens_encode_to_their_own_bytes():
    """The typed manifest reproduces every field: a golden read and written again is byte-identical."""
    for key, path, golden in committed():
        assert codec.encode(golden) == path.read_bytes(), key
        assert json.loads(Manifest.from_json(golden.manifest.to_json(), key).to_json()) == \
            json.loads(golden.manifest.to_json())


@needs_goldens("cpu", "qwen3_moe")
def test_the_manifest_is_typed():
    g = store.read(REPO / "goldens" / "cpu" / "qwen3_moe" / "train-float32.safetensors.zst")  # reads on any machine
    assert isinstance(g.manifest.reference.train, TrainHyper) and g.manifest.reference.seed == 0
    assert g.manifest.reference.batch.sequences == (0, 1, 2, 3)
    assert g.manifest.provenance.cpu_threads == 1 and g.manifest.provenance.cuda is None
    assert set(g.manifest.min_margin) == set(g.route_layers()) == {0, 1}
    assert set(g.experts()) == {0, 1} and g.experts()[0].dtype.is_floating_point is False
