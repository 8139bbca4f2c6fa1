"""Where a candidate runs: the `Context` a backend is told, and `veosnap.context()`.

A backend learns where it runs in one of two ways, both stable:

    def my_backend(model, ctx): ...          # a second parameter: veosnap passes the Context
    ctx = veosnap.context()                  # from anywhere while the candidate runs (its hooks too)

veosnap sets the context before the backend is applied and keeps it until the layout's run is over
(every pass, route replay, the gradients), in process and on every torchrun rank. Outside a run
`veosnap.context()` raises a one-line `VeosnapError`.

A framework sets up its own parallel state from it (data, expert, sequence parallel sizes, a device
mesh of its own over the same ranks): `dp_world` and `dp_rank` say how veosnap splits the golden's
rows, `mesh` is the device mesh the layout shards over (FSDP2: 1-D `("shard",)`, HSDP: 2-D
`("replicate", "shard")`, tp/ep: 1-D `("tp",)`/`("ep",)`, sequence and context parallel: 1-D `("sp",)`;
None in process and under ddp).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import VeosnapError
from ..golden.key import GoldenKey


@dataclass(frozen=True)
class Context:
    """Where a candidate runs: the layout, this process's place in it, and the device."""

    layout: str  # the layout's name: "single", "packed", "microbatch", "ddp", "fsdp2", "hsdp", "tp", "ep", ...
    rank: int = 0  # this process's rank in the default process group (0 in process)
    world: int = 1  # how many processes run the layout (1 in process)
    local_rank: int = 0  # the rank on this machine (picks the GPU)
    device: torch.device = torch.device("cpu")
    dp_world: int = 1  # how many distinct shares of the golden's rows the ranks hold (tp: 1)
    dp_rank: int = 0  # which share this rank holds
    mesh: object | None = None  # the torch DeviceMesh the layout shards over, built before the backend runs
    group: object | None = None  # the process group the layout reduces over (the default group); None in process
    golden: GoldenKey | None = None  # what is being checked (hardware class, model, scenario, dtype)

    @property
    def distributed(self) -> bool:
        """True on torchrun ranks (a multi-process layout), False in process."""
        return self.group is not None

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's dimensions by name, e.g. `{"replicate": 2, "shard": 1}`; `{}` without a mesh."""
        if self.mesh is None:
            return {}
        names = getattr(self.mesh, "mesh_dim_names", None) or tuple(f"dim{i}" for i in range(self.mesh.ndim))
        return dict(zip(names, (int(n) for n in self.mesh.shape)))


def in_process(model: torch.nn.Module, layout: str = "single") -> Context:
    """The context of a candidate built outside a layout run (a direct `Backend.prepare`): one process."""
    param = next(model.parameters(), None)
    return Context(layout, device=param.device if param is not None else torch.device("cpu"))


_CURRENT: Context | None = None  # one candidate runs at a time per process; hooks may run on autograd threads


def current() -> Context:
    """The context of the candidate running now (`veosnap.context()`)."""
    if _CURRENT is None:
        raise VeosnapError("veosnap.context() is available only while veosnap runs a candidate "
                           "(in a backend, its hooks, or its layout's run)")
    return _CURRENT


@contextmanager
def told(ctx: Context) -> Iterator[Context]:
    """Within the block, `current()` is `ctx`."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, ctx
    try:
        yield ctx
    finally:
        _CURRENT = previous
