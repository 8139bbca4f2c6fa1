"""A check builds its model on a thread from its start, while it reads its golden (`reference.prebuild`): the
same model, the same refusals in the same order, and nothing of it outlives the check."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from golden_repo import CLASS
from test_golden_background import copy_golden, edited_logits

from veosnap.candidates import backends
from veosnap.errors import VeosnapError
from veosnap.golden import background
from veosnap.golden.key import GoldenKey
from veosnap.reference import coverage, limits, models, weights
from veosnap.reference.prebuild import Prebuild
from veosnap.reference.zoo import Project, list_models, load_config
from veosnap.runs.check import check
from veosnap.surfaces.cli import main


def builds_by_thread(monkeypatch) -> list[str]:  # noqa: ANN001
    """The thread name of each model build from now on whose weights were drawn (a prebuild constructs its model
    and vets it with the limits first: one they refuse gets no weights and never reaches the device)."""
    names: list[str] = []
    initialize = weights.initialize
    monkeypatch.setattr(weights, "initialize", lambda *a, **k: names.append(threading.current_thread().name)
                        or initialize(*a, **k))
    return names


def plan(seed: int = 0):  # noqa: ANN201
    """A prebuild's plan: `seed`, and a vetting that lets everything through."""
    return lambda: (seed, lambda model: None)


def prebuild_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("veosnap-prebuild")]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("model", "dtype"), [("llama", "float32"), ("qwen3_moe", "bfloat16"),
                                               ("deepseek_v3", "float32")])
def test_the_model_built_on_the_thread_is_bit_identical_to_one_built_here(model, dtype, device):
    toy = load_config(Project.resolve().configs, model)
    here = models.build(toy, models.dtype_from_name(dtype), device, seed=0)
    there = Prebuild(toy, dtype, torch.device(device), plan()).take(device, 0)
    assert there is not None
    mine, theirs = dict(here.state_dict()), dict(there.state_dict())
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert value.dtype == theirs[name].dtype and torch.equal(value, theirs[name]), name


def test_a_model_of_another_seed_or_device_is_not_taken_and_is_taken_once():
    toy = load_config(Project.resolve().configs, "llama")
    assert Prebuild(toy, "float32", torch.device("cpu"), plan(1)).take("cpu", 0) is None
    assert Prebuild(toy, "float32", torch.device("cpu"), plan()).take("meta", 0) is None
    once = Prebuild(toy, "float32", torch.device("cpu"), plan())
    assert once.take("cpu", 0) is not None and once.take("cpu", 0) is None


def test_a_seed_that_cannot_be_had_builds_nothing_and_says_nothing(monkeypatch):
    names = builds_by_thread(monkeypatch)
    toy = load_config(Project.resolve().configs, "llama")

    def refused() -> int:
        raise RuntimeError("the golden's header said no")

    def vet(model) -> None:  # noqa: ANN001
        raise RuntimeError("the limits said no")

    for planned in (refused, lambda: None, lambda: (0, vet)):
        prebuilt = Prebuild(toy, "float32", torch.device("cpu"), planned)
        assert prebuilt.take("cpu", 0) is None
    assert names == []


def test_the_limits_vet_the_model_as_constructed_with_the_skeletons_count(monkeypatch):
    # The thread runs the limits on its own model, constructed but not drawn: the count the meta skeleton gives
    toy = load_config(Project.resolve().configs, "qwen3_moe")
    seen: list[int] = []
    prebuilt = Prebuild(toy, "float32", torch.device("cpu"), lambda: (0, lambda m: seen.append(
        limits.check_model(toy, m))))
    assert prebuilt.take("cpu", 0) is not None
    assert seen == [limits.check_model(toy, models.skeleton(toy))]


def test_a_config_the_limits_passed_is_passed_again_without_a_look(monkeypatch):
    # A pytest session constructs one config's model once per backend and layout, and each prebuild vets it on the
    # build's path: from the second on, the count is the first's, with no walk over the model.
    toy = load_config(Project.resolve().configs, "qwen3_moe")
    first = limits.check_config(toy, models.skeleton(toy))
    monkeypatch.setattr(limits, "check_model", lambda *_: pytest.fail("the model was walked again"))
    assert limits.check_config(toy, models.skeleton(toy)) == first


def test_a_refused_config_is_refused_every_time(monkeypatch):
    base = load_config(Project.resolve().configs, "llama")
    toy = replace(base, config={**base.config, "vocab_size": base.config["vocab_size"] + 7})  # a config unseen here
    monkeypatch.setattr(limits, "MAX_PARAMETERS", 1000)
    for _ in range(2):
        with pytest.raises(VeosnapError, match="over veosnap's limit"):
            limits.check_config(toy)


TOYS = list_models(Project.resolve().configs, "toy")


@pytest.mark.parametrize("model", TOYS)
def test_the_vetting_finds_on_the_constructed_model_what_the_skeleton_says(model):
    # A check beside a prebuild takes its limits' count and its coverage from the model the thread constructed
    # (`runs.check.Vetted`): they must be the meta skeleton's, for every model of the zoo.
    toy = load_config(Project.resolve().configs, model)
    skeleton = models._build_skeleton(toy)
    found: list = []
    prebuilt = Prebuild(toy, "float32", torch.device("cpu"), lambda: (0, lambda m: found.append(
        (limits.check_model(toy, m), coverage.produces(m)))))
    assert prebuilt.take("cpu", 0) is not None
    assert found == [(limits.check_model(toy, skeleton), coverage.produces(skeleton))]
    assert prebuilt.vetted() is None  # that vetting returned nothing: nothing to read


def test_a_check_beside_its_prebuild_builds_no_skeleton_and_refuses_as_before(tmp_path, monkeypatch, capsys):
    root, _ = copy_golden(tmp_path, "qwen3_moe")
    built: list[str] = []
    construct = models._build_skeleton
    monkeypatch.setattr(models, "_build_skeleton", lambda toy: built.append(toy.name) or construct(toy))
    models._SKELETONS.clear()
    project = Project.resolve(goldens=root, hardware_class=CLASS)
    key = GoldenKey(CLASS, "qwen3_moe", "step", "float32")
    assert check(project, key, backends.resolve("eager")).passed
    assert built == []
    # A golden that does not cover what the model produces is refused from the vetting's facts as from the
    # skeleton's: its last layer's output gone, its hashes recomputed.
    from test_trust_goldens import _drop, forged  # noqa: PLC0415

    (root / key.relpath).write_bytes(forged(key, _drop("layers.1.output")))
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", "qwen3_moe", "--dtype",
                 "float32"])
    assert code == 2
    assert "does not cover what the model produces (no output of decoder layer 1)" in capsys.readouterr().err
    assert built == []


def test_a_check_takes_the_model_built_from_its_start_and_reports_as_before(tmp_path, monkeypatch):
    root, _ = copy_golden(tmp_path, "qwen3_moe")
    names = builds_by_thread(monkeypatch)
    project = Project.resolve(goldens=root, hardware_class=CLASS)
    key = GoldenKey(CLASS, "qwen3_moe", "step", "float32")
    (single, packed) = [check(project, key, backends.resolve("eager"), layout) for layout in ("single", "packed")]
    assert single.passed and packed.passed
    # eager's report says nothing of patches: the thread's build (transformers' init functions patched while it
    # runs) is over before the check snapshots the modeling code
    assert not [note for note in single.notes + packed.notes if "patches" in note]
    assert names == ["veosnap-prebuild qwen3_moe"] * 2
    assert not prebuild_threads()


def test_two_layouts_of_one_check_build_the_first_on_the_thread_and_the_second_here(tmp_path, monkeypatch, capsys):
    root, _ = copy_golden(tmp_path, "llama")
    names = builds_by_thread(monkeypatch)
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", "llama", "--dtype",
                 "float32", "--layout", "single", "--layout", "microbatch"])
    assert code == 0, capsys.readouterr()
    assert names == ["veosnap-prebuild llama", "MainThread"]


def test_what_the_check_refuses_at_once_is_never_built(tmp_path, monkeypatch, capsys):
    # The limits (run by the thread itself on the peeked batch) and another config: no build on any thread, and
    # the check's own one-line refusal as before.
    root, _ = copy_golden(tmp_path, "llama")
    names = builds_by_thread(monkeypatch)
    monkeypatch.setattr(limits, "_memory", lambda device: (1 << 20, "memory"))
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32"])
    assert code == 2
    assert "more than this machine's 0 GiB of memory" in capsys.readouterr().err
    monkeypatch.undo()
    names = builds_by_thread(monkeypatch)
    configs = tmp_path / "configs"
    (configs / "llama").mkdir(parents=True)
    text = (Project.resolve().configs / "llama" / "config.json").read_text()
    (configs / "llama" / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    code = main(["check", "--goldens", str(root), "--configs", str(configs), "--hardware-class", CLASS, "--model",
                 "llama", "--dtype", "float32"])
    assert code == 2
    assert "recorded from another config" in capsys.readouterr().err
    assert names == []
    assert not prebuild_threads()


def test_a_golden_refused_after_its_model_was_built_leaves_no_build_running(tmp_path, capsys):
    root, path = copy_golden(tmp_path, "llama")
    edited_logits(path)  # the header is sound (the peek reads it), the payload is not
    assert background.peek(path, root) is not None
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32"])
    assert code == 2
    assert "payload hash" in capsys.readouterr().err
    assert not prebuild_threads()


def test_an_unchanged_golden_is_peeked_once_a_process_and_a_rewritten_one_again(tmp_path, monkeypatch):
    # Each check's prebuild peeks its golden's header (a millisecond on the build's path), and a session checks
    # one golden under many backends and layouts. Peeks are kept by the file's identity: a file written since is
    # read again (and a stale hint could only cost a build: the check validates the golden before taking one).
    import os

    root, path = copy_golden(tmp_path, "llama")
    reads: list[str] = []  # the thread of each header parse
    header = background._header
    monkeypatch.setattr(background, "_header", lambda reader: reads.append(threading.current_thread().name)
                        or header(reader))
    checked: list[Path] = []  # the paths whose naming was checked (`store.problem`, 0.3-0.7 ms)
    problem = background.store.problem
    monkeypatch.setattr(background.store, "problem", lambda p, r=None: checked.append(p) or problem(p, r))
    first = background.peek(path, root)
    assert first is not None and background.peek(path, root) == first and reads == ["MainThread"]
    assert checked == [path]  # the kept peek is found by a stat alone
    # Another path to the same file is checked for itself: a link named as another golden gets no hint.
    other = root / CLASS / "llama" / "step-bfloat16.safetensors.zst"
    other.symlink_to(path)
    assert background.peek(other, root) is None and checked == [path, other] and reads == ["MainThread"]
    other.unlink()
    fresh = path.with_name("fresh")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)
    assert background.peek(path, root) == first and reads == ["MainThread"] * 2
    assert check(Project.resolve(goldens=root, hardware_class=CLASS), GoldenKey(CLASS, "llama", "step", "float32"),
                 backends.resolve("eager")).passed
    assert reads == ["MainThread"] * 3  # the check's own read of the golden; its prebuild's peek was kept


def test_a_sketched_goldens_reducer_is_made_on_the_staging_thread_while_the_model_is_built(tmp_path, monkeypatch):
    from veosnap.reference.reduce import CandidateReducer
    from veosnap.runs.record import record

    project = Project.resolve(goldens=tmp_path / "goldens", hardware_class=CLASS)
    record(project, "llama", "float32", sketch="always")
    made: list[str] = []
    init = CandidateReducer.__init__
    monkeypatch.setattr(CandidateReducer, "__init__", lambda self, *a, **k: made.append(
        threading.current_thread().name) or init(self, *a, **k))
    key = GoldenKey(CLASS, "llama", "step", "float32")
    report = check(project, key, backends.resolve("sdpa"))
    assert report.passed and any(result.sketched for result in report.tensors)
    assert made == ["veosnap-stage"]


def test_a_model_constructed_beside_the_threads_construction_keeps_its_init_and_tied_weights(monkeypatch):
    # While a model is constructed, transformers patches the init functions process-wide (no_init_weights): a
    # skeleton constructed meanwhile skipped its init, weight tying included (qwen2's LM head came out untied
    # and a check refused its golden for a missing lm_head gradient). Constructions now take turns.
    toy = load_config(Project.resolve().configs, "qwen2")
    inside, release = threading.Event(), threading.Event()
    auto_class = models.auto_class

    class HeldInside:  # the thread's construction waits, inside no_init_weights, until released
        def __init__(self, cls) -> None:  # noqa: ANN001
            self.cls = cls

        def from_config(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if threading.current_thread().name.startswith("veosnap-prebuild"):
                inside.set()
                release.wait(30)
            return self.cls.from_config(*args, **kwargs)

    monkeypatch.setattr(models, "auto_class", lambda config: HeldInside(auto_class(config)))
    prebuilt = Prebuild(toy, "float32", torch.device("cpu"), plan())
    assert inside.wait(30)
    threading.Timer(0.2, release.set).start()  # only frees the thread: the assert below holds at any timing
    skeleton = models._build_skeleton(toy)
    assert "lm_head.weight" not in dict(skeleton.named_parameters())  # tied to the embedding, as HF ties it
    assert prebuilt.take("cpu", 0) is not None
