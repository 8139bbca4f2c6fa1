"""One rank of a multi-process layout check; started by `layouts.check_layouts` through torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node N -m veosnap.distributed_worker \
        --goldens DIR --configs DIR --testdata DIR --hardware-class cpu --model M --dtype D \
        --backend SPEC --layouts ddp,fsdp2 --out DIR --timeout S

Contract: every rank reads the golden itself and takes its share of the golden's batch (data-parallel
ranks: consecutive rows; tensor-parallel ranks: all of it). For each layout, in order, rank 0 writes
`OUT/<layout>.safetensors` (the gathered capture: loss, logits, layer outputs, full gradients, routes,
and under `replayed.` the run forced onto the golden's experts when routes differed) or
`OUT/<layout>.skip` (the reason). A rank that fails writes `OUT/error-rank<R>.txt` (one line) and
exits non-zero, so torchrun ends the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import backends, layouts
from .reference import models, train
from .backends import Backend, Unsupported
from .check import load_checked
from .reference.probes import decoder_layers
from .golden.codec import Golden
from .golden.key import GoldenKey
from .reference.inputs import Batch
from .reference.zoo import Project, ToyConfig


class Rank:
    """This process's place in the group and where its model lives."""

    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = torch.device("cuda", self.local) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


def _build(golden: Golden, toy: ToyConfig, device: torch.device) -> nn.Module:
    return models.build(toy, models.dtype_from_name(golden.key.dtype), device, golden.manifest.reference.seed)


def _from_pretrained(golden: Golden, toy: ToyConfig, me: Rank, out: Path, config: object) -> nn.Module:
    """The toy model saved by rank 0, loaded through transformers' own distributed loading."""
    import transformers

    saved = out / "model"
    if me.rank == 0 and not saved.is_dir():
        _build(golden, toy, torch.device("cpu")).save_pretrained(saved)
    dist.barrier()
    with warnings.catch_warnings(), models._quiet_transformers():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            saved, dtype=models.dtype_from_name(golden.key.dtype), attn_implementation=models.REFERENCE_ATTN,
            experts_implementation=models.REFERENCE_EXPERTS, distributed_config=config)


def setup(name: str, golden: Golden, toy: ToyConfig, backend: Backend, me: Rank, out: Path
          ) -> tuple[nn.Module, nn.Module, int, int, list[str]]:
    """(model to call, the HF model inside it, data-parallel size, data-parallel rank, notes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig

    if name in ("tp", "ep"):
        config = DistributedConfig(tp_size=me.world) if name == "tp" else DistributedConfig(ep_size=me.world, fsdp_size=me.world)
        inner = layouts.candidate_model(backend, _from_pretrained(golden, toy, me, out, config))
        notes = [f"transformers DistributedConfig({'tp_size' if name == 'tp' else 'ep_size'}={me.world}"
                 f"{'' if name == 'tp' else f', fsdp_size={me.world}'})"]
        return inner, inner, (1 if name == "tp" else me.world), (0 if name == "tp" else me.rank), notes
    inner = layouts.candidate_model(backend, _build(golden, toy, me.device))
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [me.local] if me.device.type == "cuda" else None
        return DistributedDataParallel(inner, device_ids=ids), inner, me.world, me.rank, []
    if name == "fsdp2":
        mesh, notes = init_device_mesh(me.device.type, (me.world,)), [f"fully_shard over {me.world} ranks"]
    elif name == "hsdp":
        replicate, shard = layouts.hsdp_mesh(me.world)
        mesh = init_device_mesh(me.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
        notes = [f"fully_shard on a (replicate={replicate}, shard={shard}) mesh"]
    else:
        raise ValueError(f"layout {name!r} does not run under torchrun")
    for layer in decoder_layers(inner):
        fully_shard(layer, mesh=mesh)
    fully_shard(inner, mesh=mesh)
    return inner, inner, me.world, me.rank, notes


def run_layout(name: str, golden: Golden, toy: ToyConfig, backend: Backend, me: Rank, out: Path) -> None:
    fault = layouts.fault_for(name)
    if fault == "die" and me.last:
        os._exit(17)
    if fault == "hang" and me.last:
        time.sleep(10**6)
    try:
        model, inner, dp_world, dp_rank, notes = setup(name, golden, toy, backend, me, out)
    except Unsupported as exc:  # raised alike on every rank (the backend decides from the model)
        if me.rank == 0:
            (out / f"{name}.skip").write_text(str(exc), encoding="utf-8")
        return
    inner.train()
    if golden.key.scenario == train.SCENARIO:
        return run_train_layout(name, fault, golden, model, inner, dp_world, dp_rank, notes, me, out)
    batch = Batch.from_golden(golden)
    total = layouts.predictions(batch)
    my_rows = layouts.shard_rows(batch.input_ids.shape[0], dp_world, dp_rank)
    if fault == "swap_shard" and me.last:
        my_rows = layouts.shard_rows(batch.input_ids.shape[0], dp_world, 0)
    mine = layouts.rows(batch, my_rows)
    tokens = layouts.token_index(golden, my_rows)
    # Reducers average over the data-parallel ranks; scaling by their count makes that a sum of token shares.
    grad_scale = float(dp_world) * (dp_world if fault == "sum_grads" else 1)

    def step(forced: dict[int, torch.Tensor] | None) -> tuple[layouts.Part, dict[str, torch.Tensor]]:
        inner.zero_grad(set_to_none=True)
        part = layouts.run_part(model, inner, mine, total, grad_scale, forced)
        return part, layouts.gradients(inner)  # every rank joins the gathers of sharded gradients

    part, grads = step(None)
    differ = torch.tensor([float(layouts._is_moe(golden) and layouts.routes_differ(golden, part.routes, tokens))],
                          device=me.device)  # NCCL reduces only GPU tensors
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    replayed = None
    if differ.item():
        forced = {layer: experts[tokens] for layer, experts in layouts.golden_routes(golden).items()}
        replayed = _gathered(*step(forced), dp_world, me)
    capture = _gathered(part, grads, dp_world, me)
    if me.rank == 0:
        layouts.write_capture(out / f"{name}.safetensors", capture, replayed, notes)


def run_train_layout(name: str, fault: str, golden: Golden, model: nn.Module, inner: nn.Module, dp_world: int,
                     dp_rank: int, notes: list[str], me: Rank, out: Path) -> None:
    """The golden's optimizer steps on this rank's share: the reducer (DDP, FSDP2) combines the gradients,
    clip_grad_norm_ takes the global norm (over DTensor shards: a collective), AdamW steps on what this
    rank holds; rank 0 writes the per-step losses (summed over ranks), norms and full updates."""
    hyper = golden.manifest.reference.train
    batch = Batch.from_golden(golden)
    total = layouts.predictions(batch)
    my_rows = layouts.shard_rows(batch.input_ids.shape[0], dp_world, dp_rank)
    mine = layouts.rows(batch, my_rows)
    first: list[layouts.Part] = []

    def forward_backward() -> tuple[torch.Tensor, dict]:
        inner.zero_grad(set_to_none=True)
        part = layouts.run_part(model, inner, mine, total, float(dp_world))
        first.append(part)
        loss = part.loss.to(me.device)
        if dp_world > 1:
            dist.all_reduce(loss)  # each share's loss is its token-weighted part of the batch mean
        return loss.cpu(), part.routes

    clip = _clip_local if fault == "clip_local" else train.clip_global
    capture = train.train(inner, hyper, forward_backward, clip).capture
    step0 = _gathered(first[0], {}, dp_world, me)  # the first step's routes, rows in the golden's order
    if me.rank == 0:
        capture.routes = step0.routes
        layouts.write_capture(out / f"{name}.safetensors", capture, None, notes)


def _clip_local(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Planted fault: each rank clips by the norm of the gradient shard it holds, not the global norm."""
    with torch.no_grad():
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
    return norm


def _gathered(part: layouts.Part, grads: dict[str, torch.Tensor], dp_world: int, me: Rank):  # noqa: ANN202
    """Rank 0: the data-parallel ranks' parts joined in rank order (rows in the golden's order)."""
    if dp_world == 1:
        return layouts.join([part], grads)
    parts = [None] * me.world if me.rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    return layouts.join(parts, grads) if me.rank == 0 else None


def _die_with_parent() -> None:
    """Linux: end this rank when torchrun dies, even by SIGKILL (ranks run in sessions of their own)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    p = argparse.ArgumentParser(prog="veosnap.distributed_worker")
    for flag in ("--goldens", "--configs", "--testdata", "--hardware-class", "--model", "--dtype", "--backend",
                 "--layouts", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--scenario", default="step")
    p.add_argument("--timeout", type=float, default=layouts.DEFAULT_TIMEOUT_S)
    args = p.parse_args(argv)
    me = Rank()
    out = Path(args.out)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(1)
        if me.device.type == "cuda":
            torch.cuda.set_device(me.device)
        dist.init_process_group("nccl" if me.device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
        project = Project.resolve(goldens=args.goldens, configs=args.configs, testdata=args.testdata,
                                  hardware_class=args.hardware_class)
        # The parent already refused a cross-class check it was not asked for.
        golden, toy = load_checked(project, GoldenKey(args.hardware_class, args.model, args.scenario, args.dtype),
                                   cross_class=True)
        backend = backends.resolve(args.backend)
        for name in args.layouts.split(","):
            run_layout(name, golden, toy, backend, me, out)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - one line for the parent, then end this rank at once
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        line = f"rank {me.rank}: {type(exc).__name__}: {exc}".splitlines()[0] + where
        (out / f"error-rank{me.rank}.txt").write_text(line + "\n", encoding="utf-8")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
