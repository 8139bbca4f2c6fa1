"""One torchrun rank of a multi-process layout check (started by `torchrun.run`; see there for the
command line and the files it writes).

Every rank reads the golden itself, resolves the backend and each layout SPEC in its own process, and
runs each layout with `engine.run`: the same code an in-process layout runs, with this rank's place in
the group, guarded (`guard`: a candidate that exits is this rank's error) and restored after (`pristine`:
what a candidate patched does not leak into the next layout). Rank 0 writes each layout's result or the
reason it was skipped; a rank that fails writes one line and exits at once, so torchrun ends the others.
A rank ends with torchrun, even if torchrun is killed: its parent-death signal is set before anything
slow is imported.
"""

from __future__ import annotations

import os
import sys


def _die_with_parent() -> None:
    """Linux: end this rank when torchrun dies, even by SIGKILL (ranks run in sessions of their own)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        parent = os.environ.get("VEOSNAP_TORCHRUN_PID")
        if parent and os.getppid() != int(parent):  # torchrun died before the signal was set
            os._exit(1)


if __name__ == "__main__":
    _die_with_parent()  # before importing torch: seconds during which torchrun could die unnoticed

import argparse  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from ...errors import Unsupported, describe  # noqa: E402
from ...golden.key import GoldenKey  # noqa: E402
from ...reference import models, scenarios  # noqa: E402
from ...reference.probes import decoder_layers, find_encoders  # noqa: E402
from ...reference.zoo import Project, load_checked  # noqa: E402
from .. import backends, guard, pristine  # noqa: E402
from . import engine, registry, torchrun  # noqa: E402
from .protocol import LayoutContext  # noqa: E402


def _reporting_progress(build: Callable[[torch.device], nn.Module], path: Path) -> Callable[[torch.device], nn.Module]:
    """`build`, the model it makes writing to `path` which block this rank last entered, forward or backward:
    when a rank waits for ever in a collective its peers never joined (an encoder that ran on one rank
    only), the parent says where each rank was."""

    def built(device: torch.device) -> nn.Module:
        model = build(device)
        paths = {id(m): n for n, m in model.named_modules()}
        blocks = [*((paths[id(b)], b) for e in find_encoders(model) for b in e.blocks),
                  *((f"decoder layer {i}", layer) for i, layer in enumerate(decoder_layers(model)))]

        def install(_model: nn.Module, _args: tuple) -> None:
            # At the first forward, after the layout wrapped the model: prepended, these run before the
            # hooks a wrapper put on the blocks (FSDP2 gathers a block's parameters in one).
            handle.remove()
            for name, block in blocks:
                block.register_forward_pre_hook(lambda _m, _a, name=name: _say(path, f"forward of {name}"),
                                                prepend=True)
                block.register_forward_hook(lambda _m, _a, out, name=name: _on_backward(out, path, name))

        handle = model.register_forward_pre_hook(install)
        return model

    return built


def _say(path: Path, where: str) -> None:
    path.write_text(where, encoding="utf-8")


def _on_backward(output: object, path: Path, name: str) -> None:
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(lambda grad: _say(path, f"backward of {name}"))


def main(argv: list[str] | None = None) -> int:
    # A candidate may print what it likes: on a rank, as in the parent, stdout is stderr (the rank's log).
    sys.stdout.flush()
    os.dup2(2, 1)
    p = argparse.ArgumentParser(prog=f"python -m {torchrun.WORKER}")
    for flag in ("--goldens", "--configs", "--testdata", "--hardware-class", "--model", "--dtype", "--backend", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--layout", action="append", required=True)
    p.add_argument("--scenario", default="step")
    p.add_argument("--timeout", type=float, default=torchrun.DEFAULT_TIMEOUT_S)
    p.add_argument("--isolate", action="store_true")
    args = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    out = Path(args.out)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
        project = Project.resolve(goldens=args.goldens, configs=args.configs, testdata=args.testdata,
                                  hardware_class=args.hardware_class)
        # The parent already refused a cross-class check it was not asked for.
        golden, toy = load_checked(project, GoldenKey(args.hardware_class, args.model, args.scenario, args.dtype),
                                   cross_class=True)
        backend = backends.resolve(args.backend)
        ctx = LayoutContext.checking(golden, toy, device, scenarios.get(args.scenario), rank=rank, world=world,
                                     local_rank=local, workdir=out, isolate_real=args.isolate)
        ctx.build = _reporting_progress(ctx.build, out / f"{torchrun.PROGRESS}{rank}.txt")
        family = models.modeling_module(toy)
        models.skeleton(toy)  # pins the reference's torch fallbacks before the modules are snapshot
        for index, spec in enumerate(args.layout):
            with pristine.kept(family, candidate=args.backend) as left:
                try:
                    with guard.running():
                        result = engine.run(registry.resolve(spec), backend, ctx)
                except Unsupported as exc:  # raised alike on every rank (the backend or layout decides from the model)
                    if rank == 0:
                        (out / f"{index}.skip").write_text(str(exc), encoding="utf-8")
                    continue
            if left.tainted:  # another candidate's thread changed the reference around this run
                raise guard.CandidateError(left.tainted)
            if result is not None:
                result.notes.extend(left.notes())
                torchrun.write_result(out / f"{index}.safetensors", result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - one line for the parent, then end this rank at once
        why = str(exc) if isinstance(exc, guard.CandidateError) else describe(exc)
        (out / f"error-rank{rank}.txt").write_text(f"rank {rank}: {why}\n", encoding="utf-8")
        traceback.print_exc()
        sys.stderr.flush()
        guard.real_exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
