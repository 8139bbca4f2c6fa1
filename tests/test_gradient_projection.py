"""A bfloat16 gradient 1% too large fails: its projection onto the golden is judged against the reference's own
rounding (`veosnap.numerics.projection`), where its row error alone is not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from golden_repo import CLASS, REPO

from veosnap.candidates import backends
from veosnap.errors import GoldenError
from veosnap.golden import codec, names, store
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import Tolerance
from veosnap.numerics import projection
from veosnap.render import json as json_report
from veosnap.render import text
from veosnap.runs.check import check

SCALED = Path(__file__).with_name("scaled_faults.py")


def bf16_key(project, model: str = "llama") -> GoldenKey:  # noqa: ANN001
    key = GoldenKey(project.hardware_class, model, "step", "bfloat16")
    golden = store.read(project.goldens / key.relpath)
    if not any(t.scale_bound is not None for t in golden.manifest.tolerance.values()):
        pytest.skip(f"{key} was recorded before projection bounds (tools/data/add_projection_bounds.py)")
    return key


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_one_weights_gradient_one_percent_too_large_fails_on_its_projection(repo_project, model):
    report = check(repo_project, bf16_key(repo_project, model), backends.resolve(f"{SCALED}:one_gradient_scaled"))
    assert not report.passed and not report.error
    scaled = [t for t in report.tensors if not t.passed]
    assert [t.name for t in scaled] == [t.name for t in scaled if isinstance(t.parsed, names.Grad)]
    worst = report.ranked()[0]
    assert worst.error <= worst.bound  # its row error alone passes: the rounding hides 1%
    # 1% in float32, rounded to bfloat16 with the gradient
    assert re.match(r"scaled \+(0\.9\d|1\.0\d)%: projection onto the golden ", worst.where) and worst.scale_ratio > 1
    assert "q_proj.weight" in worst.name and "layers.0." in worst.name
    doc = json.loads(json_report.checks([report]))["results"][0]
    shown = next(t for t in doc["tensors"] if t["name"] == worst.name)
    assert shown["scale_bound"] == worst.scale_bound and abs(shown["scale"] - 0.01) < 1e-3
    assert worst.name in text.checks([report])


@pytest.mark.parametrize("backend", ["sdpa", "sdpa+grouped_mm"])
def test_legitimate_kernels_pass_their_gradients_projections(repo_project, backend):
    report = check(repo_project, bf16_key(repo_project, "qwen3_moe"), backends.resolve(backend))
    assert report.passed, text.checks([report])
    judged = [t for t in report.tensors if t.scale_bound is not None]
    assert judged and max(t.scale_ratio for t in judged) < 0.5


def test_float32_goldens_carry_no_projection_bound(repo_project):
    golden = store.read(repo_project.goldens / GoldenKey(repo_project.hardware_class, "llama", "step", "float32").relpath)
    assert all(t.scale_bound is None for t in golden.manifest.tolerance.values())


def test_a_projection_bound_edited_apart_from_its_noise_is_refused_in_one_line(repo_project, tmp_path):
    key = bf16_key(repo_project)
    golden = codec.decode((repo_project.goldens / key.relpath).read_bytes(), key)
    name = next(n for n, t in golden.manifest.tolerance.items() if t.scale_bound is not None)
    tol = golden.manifest.tolerance[name]
    golden.manifest.tolerance[name] = Tolerance(tol.noise, tol.bound, tol.scale_noise, tol.scale_bound * 10)
    path = tmp_path / key.relpath
    path.parent.mkdir(parents=True)
    path.write_bytes(codec.encode(golden))
    with pytest.raises(GoldenError) as refused:
        store.read(path, root=tmp_path)
    assert f"tolerance of {name!r}: projection bound" in str(refused.value) and "\n" not in str(refused.value)


def test_a_golden_recorded_before_projection_bounds_is_checked_by_row_error_and_says_so(repo_project, tmp_path):
    key = bf16_key(repo_project)
    golden = codec.decode((repo_project.goldens / key.relpath).read_bytes(), key)
    golden.manifest.tolerance = {n: Tolerance(t.noise, t.bound) for n, t in golden.manifest.tolerance.items()}
    path = tmp_path / "goldens" / key.relpath
    path.parent.mkdir(parents=True)
    path.write_bytes(codec.encode(golden))
    from dataclasses import replace

    project = replace(repo_project, goldens=tmp_path / "goldens")
    report = check(project, key, backends.resolve(f"{SCALED}:one_gradient_scaled"))
    assert report.passed  # what the projection catches, row error alone cannot
    assert any("recorded before projection bounds" in note for note in report.notes), report.notes


def test_the_committed_low_precision_goldens_carry_them():
    paths = sorted((REPO / "goldens" / CLASS).glob("*/step-bfloat16.safetensors.zst"))
    if not paths:
        pytest.skip(f"this checkout lacks the committed {CLASS} goldens (a device call carries only some)")
    for path in paths:
        m = store.read_manifest(path, REPO / "goldens")
        grads = [t for n, t in m.tolerance.items() if isinstance(names.parse(n), names.Grad)]
        assert grads and all(t.scale_bound is not None for t in grads), path


def test_a_refresh_adds_the_bounds_to_a_golden_recorded_before_them(tmp_path, capsys):
    from golden_repo import copy_zoo

    from veosnap.surfaces.cli import main

    project = copy_zoo(tmp_path)
    key = bf16_key(project)
    path = project.goldens / key.relpath
    golden = store.read(path)
    golden.manifest.tolerance = {n: Tolerance(t.noise, t.bound) for n, t in golden.manifest.tolerance.items()}
    path.write_bytes(codec.encode(golden))
    assert main(["refresh", "--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata",
                 str(project.testdata), "--model", "llama", "--dtype", "bfloat16", "--reason", "projection"]) == 0
    assert "gradient projection bound(s) added" in capsys.readouterr().out
    assert all(t.scale_bound is not None for n, t in store.read(path).manifest.tolerance.items()
               if isinstance(names.parse(n), names.Grad))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("batch", [None, 100], ids=["batched", "batches-of-100-values"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_projections_of_many_gradients_at_once_are_each_ones_alone(device, batch, monkeypatch):
    # A check queues every whole gradient's projection after the backward, the gradients of one dtype laid end
    # to end in one buffer: each must be the one `projection` gives that gradient alone, an all-zero or empty
    # golden's 0, wherever the buffers are cut (a gradient larger than a buffer goes alone).
    if batch is not None:
        monkeypatch.setattr(projection, "BATCH", batch)
        monkeypatch.setattr(projection, "BATCH_CUDA", batch)
    torch.manual_seed(0)
    pairs = []
    for shape, scale in (((2048,), 1.01), ((64, 33), 0.97), ((5, 7, 3), 1.0), ((), 1.02), ((0,), 1.0)):
        golden = torch.randn(shape).to(torch.bfloat16)
        pairs.append(((golden.float() * scale + 1e-3 * torch.randn(shape)).to(torch.bfloat16), golden))
    pairs.append((torch.ones(10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.bfloat16)))
    pairs.append((torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4).to(torch.bfloat16)))  # dtypes apart
    together = projection.projections_later(pairs, device=device).read()
    alone = [projection.projection(c, g) for c, g in pairs]
    assert together == pytest.approx(alone, rel=1e-12, abs=1e-15)
    assert together[0] == pytest.approx(0.01, abs=2e-3) and together[1] == pytest.approx(-0.03, abs=2e-3)
    assert together[-3:-1] == [0.0, 0.0]


def test_a_projection_onto_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"\(6,\) tensor onto a \(2, 3\) one"):
        projection.projections_later([(torch.ones(6), torch.ones(2, 3))])
