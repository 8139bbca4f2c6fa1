"""The one Layout protocol: how a candidate is split across rows, micro-batches, positions and processes.

A layout is an instance of a `Layout` subclass. It answers, each with a method that has a default:

    accept(golden, nproc)     does it apply? Raise `Unsupported(reason)` to decline: the check is skipped
    load(ctx)                 the reference model on this rank, before the backend is applied
                              (default: built on ctx.device; tp/ep load it through transformers)
    data(ctx)                 which data-parallel share of the golden's rows this rank holds -> `DataGroup`
                              (default: one share per rank for a multi-process layout, the whole batch
                              in process); the backend is told it before it runs
    mesh(ctx)                 the device mesh the layout shards over, built before the backend runs so
                              the backend is told it (default: none); `wrap` finds it in `ctx.mesh`
    wrap(model, ctx)          the candidate set up on this rank -> `Setup`: wrapped (DDP), sharded in place
                              (fully_shard), or as it is; notes. Not called for a backend that
                              parallelizes the model itself (`backends.parallelizes`)
    shard(ctx, setup)         the passes this rank runs for one step -> [`Shard`]: each a batch and, per
                              token, the flat position of the golden's batch it stands for
                              (default: the golden's rows, split over the data-parallel ranks)
    accumulate(...)           a context around each pass (gradient accumulation: `no_sync`, say)
    clip(params, max_norm, ctx)   the train scenario's gradient clipping (default: the global norm)

The engine (`engine.run`) does the rest alike for every layout, in process and on each torchrun rank:
applies the backend, runs the passes (each weighted by its share of the golden's predictions), replays
the golden's routes when any real token went elsewhere, puts every rank's token outputs back at their
positions in the golden's batch, gathers full gradients, and for `train` runs the optimizer steps. A
layout that shards along positions (sequence parallel) returns shards whose positions say so, and may
install its own attention function in `wrap`; one that re-arranges tokens (packing) likewise.

`ctx` (`LayoutContext`) tells a layout where it runs: the golden and its batch, the device, this rank and
the world size, a directory every rank shares, the train hyper-parameters, and the collectives it needs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ...golden.codec import Golden
from ...golden.manifest import TrainHyper
from ...reference import models
from ...reference.inputs import Batch
from ...reference.prebuild import Prebuild
from ...reference.scenarios import Scenario
from ...reference.train import clip_global
from ...reference.zoo import ToyConfig


@dataclass
class LayoutContext:
    """Where a layout runs: the golden and its batch, how to build the reference model, and this rank's
    place (rank 0 of 1 in process; under torchrun, its rank in the default process group)."""

    golden: Golden
    batch: Batch  # the golden's batch
    device: torch.device
    build: Callable[[torch.device], nn.Module]  # the reference model (deterministic weights) on a device
    rank: int = 0
    world: int = 1
    workdir: Path | None = None  # a directory every rank shares (torchrun); None in process
    hyper: TrainHyper | None = None  # the train scenario's steps; None for `step`
    local_rank: int = 0
    mesh: object | None = None  # the DeviceMesh `Layout.mesh` built for this run (set by the engine)
    # Isolate a real-shape golden's layers too (opt-in: a reference forward and a float64 copy's run beside the
    # candidate, several times the step's cost at 1B; toy goldens are isolated always).
    isolate_real: bool = False

    @classmethod
    def checking(cls, golden: Golden, toy: ToyConfig, device: torch.device, scenario: Scenario | None = None,
                 prebuilt: Prebuild | None = None, isolate_real: bool = False, **place: object) -> LayoutContext:
        """The context of a check against `golden`, the model built from `toy` (with the encoders `scenario`
        freezes frozen; the first build taking `prebuilt`'s model when it is that one); `place`: rank, world,
        local_rank, workdir."""
        seed = golden.manifest.reference.seed
        build = models.builder(toy, golden.key.dtype, seed)
        if prebuilt is not None:
            build = prebuilt.builder(build, seed)
        if scenario is not None and scenario.frozen:
            build = _frozen(build, scenario)
        return cls(golden, Batch.from_golden(golden), device, build, hyper=golden.manifest.reference.train,
                   isolate_real=isolate_real, **place)

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (a collective under torchrun)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        value = torch.tensor([float(flag)], device=self.device)  # NCCL reduces only GPU tensors
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def gather(self, obj: object) -> list | None:
        """Every rank's `obj` in rank order on rank 0, None elsewhere (a collective under torchrun)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _frozen(build: Callable[[torch.device], nn.Module], scenario: Scenario) -> Callable[[torch.device], nn.Module]:
    return lambda device: scenario.freeze(build(device))


@dataclass(frozen=True)
class DataGroup:
    """The data-parallel share a rank holds: `rank` of `size` distinct shares of the golden's batch.

    Ranks with the same `rank` hold the same data (tensor parallel peers); a reducer averages gradients
    over `size` ranks, so each pass's loss is scaled by `size` to make that a sum of token shares.
    """

    size: int = 1
    rank: int = 0


@dataclass
class Setup:
    """The candidate as set up on one rank."""

    model: nn.Module  # what the forward calls (a DDP wrapper, or the model itself)
    inner: nn.Module | None = None  # the HF model inside it: hooks, parameters, gradients (default: model)
    data: DataGroup | None = None  # the data-parallel share (default: what `Layout.data` said)
    notes: list[str] = field(default_factory=list)  # said in the report (how it was set up)

    def __post_init__(self) -> None:
        if self.inner is None:
            self.inner = self.model


@dataclass(frozen=True)
class Shard:
    """One pass a rank runs: a batch, and for each of its token slots (row-major) the flat position
    `row * width + position` of the golden's batch it stands for (`NO_POSITION`, -1: a slot the layout
    added, padding that stands for none; its outputs are dropped).

    `weight` is what the engine multiplies the pass's loss by (before the data group's scale): None
    for a model that averages over its own batch (the engine then weights it by the pass's share of the
    golden's predictions); a layout whose model already divides by the whole batch's count (sequence
    parallel: `num_items_in_batch`) gives 1.0, so a wrong count there is the layout's bug to catch.
    """

    batch: Batch
    positions: torch.Tensor  # [batch.rows * batch.width] int64
    weight: float | None = None

    @classmethod
    def whole(cls, batch: Batch) -> Shard:
        """The golden's batch as it is."""
        return cls(batch, torch.arange(batch.rows * batch.width))

    @classmethod
    def rows(cls, batch: Batch, index: torch.Tensor) -> Shard:
        """The golden batch's rows `index`, at its full width."""
        positions = (index[:, None] * batch.width + torch.arange(batch.width)).reshape(-1)
        return cls(batch.select_rows(index), positions)


NO_POSITION = -1


def shard_rows(num_rows: int, world: int, rank: int) -> torch.Tensor:
    """The row indices rank `rank` of `world` data-parallel ranks trains on (contiguous, as even as can be)."""
    return torch.tensor_split(torch.arange(num_rows), world)[rank]


class Layout:
    """How the golden's batch and the candidate model are split. Subclass, set `name` and `description`,
    override what differs from the defaults below, and register an instance (`veosnap.register_layout`)
    or name it by SPEC (`path/file.py:obj`, `module:obj`, a `veosnap.layouts` entry point)."""

    name: str = ""
    description: str = ""
    distributed: bool = False  # runs as `nproc` ranks under torchrun (one shared run for all such layouts)
    checks_forward_only: bool = False  # a forward-only backend is checked (gradients unchecked), not skipped
    # Why the candidate's layer parts cannot be isolated under this layout ('' when they can: the isolated run
    # replays this layout's passes, each part fed the reference's input at the pass's token slots).
    isolation: str = ""

    def accept(self, golden: Golden, nproc: int) -> None:
        """Raise `Unsupported(reason)` when this layout does not apply to `golden` on `nproc` ranks."""

    def load(self, ctx: LayoutContext) -> nn.Module:
        """The reference model on this rank, before the backend is applied."""
        return ctx.build(ctx.device)

    def data(self, ctx: LayoutContext) -> DataGroup:
        """The data-parallel share of the golden's rows this rank holds (told to the backend before it runs)."""
        return DataGroup(ctx.world, ctx.rank) if self.distributed else DataGroup()

    def mesh(self, ctx: LayoutContext) -> object | None:
        """The device mesh this layout shards over, built before the backend runs (every rank calls it)."""
        return None

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        """The candidate model (the backend applied) set up on this rank."""
        return Setup(model)

    def shard(self, ctx: LayoutContext, setup: Setup) -> list[Shard]:
        """The passes this rank runs for one step, in order: the golden's rows split over the data group."""
        if setup.data.size == 1:
            return [Shard.whole(ctx.batch)]
        return [Shard.rows(ctx.batch, shard_rows(ctx.batch.rows, setup.data.size, setup.data.rank))]

    def accumulate(self, ctx: LayoutContext, setup: Setup, index: int, count: int) -> AbstractContextManager:
        """A context around pass `index` of `count` (each pass's gradients accumulate into the step's)."""
        return nullcontext()

    def clip(self, params: list[nn.Parameter], max_norm: float, ctx: LayoutContext) -> torch.Tensor:
        """Clip the gradients to `max_norm` (train scenario); returns the pre-clip total norm."""
        return clip_global(params, max_norm)

    def __repr__(self) -> str:
        return f"<layout {self.name}>"
