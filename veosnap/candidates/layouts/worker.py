"""One torchrun rank of a multi-process layout check (started by `torchrun.run`; see there for the
command line and the files it writes).

Every rank reads the golden itself, resolves the backend and each layout SPEC in its own process, and
runs each layout with `engine.run`: the same code an in-process layout runs, with this rank's place in
the group. Rank 0 writes each layout's result or the reason it was skipped; a rank that fails writes one
line and exits at once, so torchrun ends the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import Unsupported, describe
from ...golden.key import GoldenKey
from ...reference import scenarios
from ...reference.probes import decoder_layers, find_encoders
from ...reference.zoo import Project, load_checked
from .. import backends
from . import engine, registry, torchrun
from .protocol import LayoutContext


def _die_with_parent() -> None:
    """Linux: end this rank when torchrun dies, even by SIGKILL (ranks run in sessions of their own)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


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
    _die_with_parent()
    p = argparse.ArgumentParser(prog=f"python -m {torchrun.WORKER}")
    for flag in ("--goldens", "--configs", "--testdata", "--hardware-class", "--model", "--dtype", "--backend", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--layout", action="append", required=True)
    p.add_argument("--scenario", default="step")
    p.add_argument("--timeout", type=float, default=torchrun.DEFAULT_TIMEOUT_S)
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
                                     workdir=out)
        ctx.build = _reporting_progress(ctx.build, out / f"{torchrun.PROGRESS}{rank}.txt")
        for index, spec in enumerate(args.layout):
            try:
                result = engine.run(registry.resolve(spec), backend, ctx)
            except Unsupported as exc:  # raised alike on every rank (the backend or layout decides from the model)
                if rank == 0:
                    (out / f"{index}.skip").write_text(str(exc), encoding="utf-8")
                continue
            if result is not None:
                torchrun.write_result(out / f"{index}.safetensors", result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - one line for the parent, then end this rank at once
        (out / f"error-rank{rank}.txt").write_text(f"rank {rank}: {describe(exc)}\n", encoding="utf-8")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
