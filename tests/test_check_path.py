"""A check in process waits for its device once after the candidate's backward: at the compare's read (issue 10).

On a GPU the backward's host work ends well before the device's; whatever the host does after it (finishing the
gradients, assembling, comparing) is free while the device still works, and costs its whole time once anything
waits for the device. So a check's passes leave their loss and whole gradients on the device
(`forward_backward(sync=False)`, `reduce_gradients(host=False)`), and the forward's host copies (whole token
tensors, routes) are waited for before the backward instead of after it. The numbers are the synced run's.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
from golden_repo import committed_golden

import veosnap.candidates.layouts.engine as engine
import veosnap.runs.check as check_module
from veosnap.candidates import backends
from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.reference import models
from veosnap.reference.capture import forward_backward, reduce_gradients
from veosnap.reference.inputs import Batch
from veosnap.reference.zoo import Project, load_config
from veosnap.runs.check import check
from veosnap.runs.record import record

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU nothing waits for a device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])  # qwen3_moe: routes, kept on the host in the forward
def test_a_pass_that_does_not_wait_gives_the_waiting_pass_numbers(model, device):
    batch = Batch.from_golden(store.read(committed_golden(model)))
    toy = load_config(Project.resolve().configs, model)
    runs = []
    for sync in (True, False):
        net = models.build(toy, torch.float32, device)
        net.train()
        part = forward_backward(net, batch, sync=sync)
        whole, _ = reduce_gradients(net, host=sync)
        runs.append((part, whole))
    (waited, waited_grads), (free, free_grads) = runs
    assert waited.loss.device.type == "cpu" and free.loss.device.type == device
    assert torch.equal(waited.loss, free.loss.cpu())
    assert torch.equal(waited.logits, free.logits)  # whole token tensors: host copies, complete before the backward
    assert waited.layers.keys() == free.layers.keys()
    assert all(torch.equal(waited.layers[k], free.layers[k]) for k in waited.layers)
    assert {k: torch.equal(r.experts, free.routes[k].experts) for k, r in waited.routes.items()} == \
           {k: True for k in waited.routes}
    assert waited_grads.keys() == free_grads.keys()
    assert all(torch.equal(g, free_grads[name].cpu()) for name, g in waited_grads.items())
    assert all(g.device.type == device for g in free_grads.values())


@contextmanager
def no_sync_allowed(monkeypatch):  # noqa: ANN001, ANN201
    """Inside: the steps a check takes after its backward raise on any synchronizing CUDA call."""

    def strict(fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        return run

    for owner, name in ((engine, "reduce_gradients"), (engine, "assemble")):
        monkeypatch.setattr(owner, name, strict(getattr(owner, name)))
    yield


@CUDA
def test_nothing_after_a_dense_models_backward_waits_for_the_gpu_but_the_compares_one_read(tmp_path, monkeypatch):
    # Every tensor sketched, as at scale: the gradients' finishing and the assembly queue behind the backward,
    # and the compare reads its whole tensors' and its sketches' figures in one transfer.
    project = Project.resolve(goldens=tmp_path / "goldens")
    record(project, "llama", "bfloat16", sketch="always")
    key = GoldenKey(project.hardware_class, "llama", "step", "bfloat16")
    waits: list[int] = []
    compare_tensors = check_module.compare_tensors

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return compare_tensors(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                waits.append(sum("synchronizing" in str(w.message) for w in caught))

    monkeypatch.setattr(check_module, "compare_tensors", counted)
    with no_sync_allowed(monkeypatch):
        report = check(project, key, backends.resolve("sdpa"))
    assert report.passed, report.error
    assert any(result.sketched for result in report.tensors) and any(not r.sketched for r in report.tensors)
    assert waits == [1]


def test_a_check_runs_with_the_garbage_collector_paused_and_gives_it_back(monkeypatch):
    # A check's objects are freed by their reference counts; the collector's scans of them cost a 1B check 2-3 ms
    # on the H200 (`check.collector_paused`). It is given back as it was, also when the check fails.
    import gc

    from veosnap.errors import VeosnapError

    project = Project.resolve()
    key = GoldenKey(project.hardware_class, "llama", "step", "float32")
    seen: list[bool] = []
    run = engine.run

    def watched(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(gc.isenabled())
        return run(*args, **kwargs)

    monkeypatch.setattr(engine, "run", watched)
    assert gc.isenabled()
    assert check(project, key, backends.resolve("sdpa")).passed
    assert seen == [False] and gc.isenabled()

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise VeosnapError("planted")

    monkeypatch.setattr(engine, "run", failing)
    with pytest.raises(VeosnapError, match="planted"):
        check(project, key, backends.resolve("sdpa"))
    assert gc.isenabled()
    gc.disable()
    try:
        monkeypatch.setattr(engine, "run", watched)
        assert check(project, key, backends.resolve("sdpa")).passed
        assert not gc.isenabled()  # a caller's own setting stays
    finally:
        gc.enable()


def test_a_checks_golden_is_freed_by_the_next_check_beside_its_draw_not_at_its_own_end(monkeypatch):
    # Freeing a decoded golden took 1.7-3.6 ms of an H100 host after the verdict was known (`runs.letgo`): a check
    # holds its golden, and the next one frees it once its own model is constructed, its weights being drawn.
    # One is held, never more; a failed check's too.
    import weakref

    from veosnap.errors import VeosnapError
    from veosnap.reference.prebuild import Prebuild
    from veosnap.runs import letgo

    project = Project.resolve()
    key = GoldenKey(project.hardware_class, "llama", "step", "float32")
    goldens: list[weakref.ref] = []
    events: list[str] = []
    load, begun, let_go, run = check_module.load_checked, Prebuild.begun, letgo.let_go, engine.run

    def loaded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        golden, toy = load(*args, **kwargs)
        goldens.append(weakref.ref(golden))
        return golden, toy

    def freeing() -> None:
        alive = [ref() is not None for ref in goldens]
        let_go()
        events.append(f"let go {alive} -> {[ref() is not None for ref in goldens]}")

    letgo.let_go()  # whatever an earlier test's check left
    monkeypatch.setattr(check_module, "load_checked", loaded)
    monkeypatch.setattr(Prebuild, "begun", lambda self: events.append("begun") or begun(self))
    monkeypatch.setattr(letgo, "let_go", freeing)
    monkeypatch.setattr(engine, "run", lambda *a, **k: events.append("run") or run(*a, **k))
    assert check(project, key, backends.resolve("sdpa")).passed
    assert goldens[0]() is not None and letgo.held() == 1
    assert check(project, key, backends.resolve("sdpa")).passed
    assert events == ["begun", "let go [] -> []", "run", "begun", "let go [True] -> [False]", "run"]
    assert goldens[1]() is not None and letgo.held() == 1

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise VeosnapError("planted")

    monkeypatch.setattr(engine, "run", failing)
    with pytest.raises(VeosnapError, match="planted"):
        check(project, key, backends.resolve("sdpa"))
    assert goldens[1]() is None and goldens[2]() is not None and letgo.held() == 1


def test_the_step_runs_in_training_mode_and_a_fresh_model_is_not_set_again(monkeypatch):
    # `model.train()` walks every module through nn.Module.__setattr__ (1.2 ms of the check's path at 12 layers):
    # a freshly built model already trains, so it is skipped; a module a backend left in eval mode still gets the
    # whole model set, and the step runs with every module training.
    project = Project.resolve()
    key = GoldenKey(project.hardware_class, "llama", "step", "float32")
    calls: list[bool] = []
    modes: list[bool] = []
    train = torch.nn.Module.train

    def recorded(self, mode=True):  # noqa: ANN001, ANN202
        calls.append(mode)
        return train(self, mode)

    def evaluating(model):  # noqa: ANN001, ANN202 - a backend that leaves its attention in eval mode
        model.model.layers[0].self_attn.eval()
        calls.clear()
        model.register_forward_pre_hook(lambda module, args: modes.append(all(m.training for m in module.modules())))
        return model

    monkeypatch.setattr(torch.nn.Module, "train", recorded)
    assert check(project, key, backends.resolve("sdpa")).passed
    assert calls == []
    assert check(project, key, backends.Backend("evaluating", (evaluating,))).passed
    assert calls and modes and all(modes)
