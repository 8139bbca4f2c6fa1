"""Bring your own model (docs/own-models.md): a project's own toy configs beside the bundled zoo, routers
veosnap cannot read said out loud, configs below veosnap's limits refused in one line, and goldens that
legitimate kernels already fail refused before they are written."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO

from veosnap.candidates import pristine
from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.numerics import tolerance
from veosnap.surfaces.cli import main

JETMOE = {  # a tiny JetMoE: mixture-of-experts MLPs and attention, routed by JetMoE's own top-k gating
    "model_type": "jetmoe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "kv_channels": 16, "intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}
JETMOE_ROUTERS = ["model.layers.0.mlp.router", "model.layers.0.self_attention.experts.router",
                  "model.layers.1.mlp.router", "model.layers.1.self_attention.experts.router"]


def zoo_config(name: str, **changes: object) -> dict:
    return {**json.loads((REPO / "toy_configs" / name / "config.json").read_text()), **changes}


@pytest.fixture
def own_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A project directory with a toy_configs/ of its own and no goldens yet; the current directory."""
    monkeypatch.chdir(tmp_path)

    def add(name: str, config: dict) -> Path:
        path = tmp_path / "toy_configs" / name / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))
        return path

    return add


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.heavy
def test_routers_veosnap_cannot_read_are_named_by_record_the_golden_and_every_report(own_project, capsys):
    own_project("jetmoe", JETMOE)
    code, out, err = run(capsys, "record", "--model", "jetmoe", "--dtype", "float32")
    assert code == 0 and out.startswith(f"wrote     goldens/{CLASS}/jetmoe/step-float32.safetensors.zst")
    said = re.fullmatch(r"veosnap: warning: (\S+): routes not captured for (.*) \(JetMoeTopKGating returns "
                        r"\((.*)\); veosnap reads routers that return their logits over the experts \(alone or "
                        r"first\) to blocks that call their experts with \(hidden_states, top_k_index, top_k_weights\)\)\n",
                        err)
    assert said, err
    assert said.group(1) == f"goldens/{CLASS}/jetmoe/step-float32.safetensors.zst"
    assert said.group(2).split(", ") == JETMOE_ROUTERS
    assert said.group(3).startswith("int64 [")  # what it returns instead: sorted token indices, gates, sizes

    golden = store.read(Path("goldens") / CLASS / "jetmoe" / "step-float32.safetensors.zst")
    (unread,) = [a for a in golden.manifest.absent if a.kind == "router_unread"]  # why the golden has no routes
    assert list(unread.names) == JETMOE_ROUTERS and unread.reason.startswith("JetMoeTopKGating returns (int64 [")
    assert golden.route_layers() == []  # no routes stored: none read, none invented

    code, out, _ = run(capsys, "check", "--model", "jetmoe", "--dtype", "float32", "--backend", "sdpa",
                       "--format", "json")
    (note,) = json.loads(out)["results"][0]["notes"]
    assert code == 0
    assert note.startswith(f"routes not captured for {', '.join(JETMOE_ROUTERS)} (JetMoeTopKGating returns (")
    assert note.endswith("routing is not compared, a routing bug shows only in the outputs")
    code, out, _ = run(capsys, "show", str(golden.path))
    assert code == 0 and "routes not captured for model.layers.0.mlp.router" in out


def test_the_zoo_models_routers_are_all_read(repo_project):
    for model in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"):
        golden = store.read(store.path_for(repo_project.goldens, GoldenKey(CLASS, model, "step", "float32")))
        assert golden.route_layers() and not golden.manifest.absent, model


@pytest.mark.parametrize("name, config, message", [
    ("small_vocab", zoo_config("llama", vocab_size=128),
     "vocab_size 128 is too small for the test data: the golden's batch ({data}, sequences 0, 1, 2, 3) holds token "
     "ids up to 250, so vocab_size must be at least 251"),
    ("many_experts", zoo_config("qwen3_moe", hidden_size=16, num_experts=64, num_experts_per_tok=8),
     "hidden_size 16 is below the number of experts plus one (64, top-8): veosnap's toy routers give each expert one "
     "hidden dimension of the token code and read one more as an offset, so hidden_size must be at least 65"),
    ("short", zoo_config("llama", max_position_embeddings=16),
     "max_position_embeddings 16 is below the longest sequence of the golden's batch (32 tokens, {data}, sequences "
     "0, 1, 2, 3); it must be at least 32"),
])
def test_a_config_below_a_limit_is_one_line_naming_the_file_and_the_limit(own_project, capsys, name, config, message):
    path = own_project(name, config)
    code, out, err = run(capsys, "record", "--model", name, "--dtype", "float32")
    data = REPO / "testdata" / "sequences.parquet"
    assert (code, out) == (2, "")
    assert err == f"veosnap: error: {Path('toy_configs') / name / 'config.json'}: {message.format(data=data)}\n"
    assert path.is_file() and not Path("goldens", CLASS, name).exists()


def test_a_config_at_the_limit_records(own_project, capsys):
    # The limit: one hidden dimension per expert for the token code, and one for the routers' offset.
    own_project("at_limit", zoo_config("qwen3_moe", hidden_size=33, num_experts=32, num_experts_per_tok=4))
    code, out, err = run(capsys, "record", "--model", "at_limit", "--dtype", "float32")
    assert code == 0, err
    assert "min router margin" in out


def test_a_project_with_its_own_configs_still_reaches_the_bundled_zoo_by_name(own_project, capsys):
    own_project("mine", zoo_config("qwen3", num_hidden_layers=1))
    # The project's goldens are its own (./goldens), so llama has none yet: the advice says how, and works.
    code, _, err = run(capsys, "check", "--model", "llama", "--dtype", "float32")
    assert code == 2
    advice = re.search(r"record this one on that hardware with `([^`]*)`", err)
    assert advice and advice.group(1) == "veosnap record --model llama --dtype float32", err
    code, out, err = run(capsys, "record", "--model", "llama", "--dtype", "float32")
    assert code == 0, err
    assert out.startswith(f"wrote     goldens/{CLASS}/llama/step-float32.safetensors.zst  (config from veosnap's bundled "
                          f"zoo: {REPO / 'toy_configs' / 'llama' / 'config.json'})\n          certified: catches ")
    assert run(capsys, "check", "--model", "llama", "--dtype", "float32")[0] == 0
    # Left out, --model means the project's own zoo: its one model (no golden yet, and the advice runs).
    code, _, err = run(capsys, "check", "--dtype", "float32")
    assert code == 2 and f"no golden for {CLASS}/mine/step-float32" in err
    advice = re.search(r"record it with `([^`]*)`", err).group(1)
    assert main(shlex.split(advice)[1:]) == 0
    capsys.readouterr()
    assert run(capsys, "check", "--dtype", "float32")[0] == 0
    # A name in neither zoo is an error about the config, not advice to record what cannot be.
    code, _, err = run(capsys, "check", "--model", "nope")
    assert code == 2 and "no such toy config (models in toy_configs: mine; bundled: deepseek_v3, " in err
    assert ", gpt_oss, " in err and ", llama, " in err  # the bundled zoo, every tier, by name
    assert "record" not in err


def test_a_golden_legitimate_kernels_fail_is_refused_unless_allowed(scratch_project, capsys, monkeypatch):
    # Bounds at a tenth of the reference's own noise: sdpa, an equally good kernel, cannot meet them.
    monkeypatch.setitem(tolerance.ALPHA, "float32", 0.1)
    monkeypatch.setitem(tolerance.FLOOR, "float32", 1e-12)
    # Those bounds exist in this process only, so it records here: as pristine as a fresh one for this test,
    # which patches nothing a candidate could (earlier tests of the session may have run candidates).
    monkeypatch.setattr(pristine, "_touched", False)
    dirs = ["--goldens", str(scratch_project.goldens), "--configs", str(scratch_project.configs),
            "--testdata", str(scratch_project.testdata)]
    code, out, err = run(capsys, "record", *dirs, "--model", "llama", "--dtype", "float32")
    assert (code, out) == (2, "")
    said = re.fullmatch(rf"veosnap: error: {CLASS}/llama/step-float32: fragile golden, not written: legitimate "
                        r"variants of the reference exceed its bounds \(sdpa: (\S+) (\S+)x(, .*)?\); every candidate "
                        r"would fail where they do\. .* or keep it with `(veosnap record [^`]*)`\n", err)
    assert said, err
    assert float(said.group(2)) > 1 and "eager" not in err  # the reference itself reproduces its golden
    assert not (scratch_project.goldens / CLASS).exists()  # nothing written
    assert not pristine.touched()  # the variants it ran are veosnap's own: the next recording stays here

    assert main(shlex.split(said.group(4))[1:]) == 0  # the advice, as printed
    out, err = capsys.readouterr()
    assert out.startswith("wrote ")
    written = scratch_project.goldens / CLASS / "llama" / "step-float32.safetensors.zst"
    assert err.startswith(f"veosnap: warning: {written}:"
                          " fragile golden written (--allow-fragile): legitimate variants exceed its bounds (sdpa: ")


def test_the_fragility_check_runs_veosnaps_own_variants_and_leaves_the_process_pristine(scratch_project, capsys,
                                                                                       monkeypatch):
    from faults import swapped_activation

    from veosnap.candidates import backends

    monkeypatch.setattr(pristine, "_touched", False)  # as a fresh `veosnap record` starts
    monkeypatch.setitem(backends._REGISTRY, "sdpa", backends.Registered(swapped_activation))  # a conftest's "sdpa"
    dirs = ["--goldens", str(scratch_project.goldens), "--configs", str(scratch_project.configs),
            "--testdata", str(scratch_project.testdata)]
    for dtype in ("float32", "bfloat16"):  # the second is recorded in this process too
        code, out, err = run(capsys, "record", *dirs, "--model", "llama", "--dtype", dtype)
        assert (code, err) == (0, "") and out.startswith("wrote ")  # veosnap's sdpa ran, not the planted one
        assert not pristine.touched()
    assert run(capsys, "check", *dirs, "--model", "llama", "--dtype", "float32", "--backend", "sdpa")[0] == 1
    assert pristine.touched()  # a check runs whatever "sdpa" names now: recording then moves to a fresh process
