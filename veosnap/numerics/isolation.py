"""Judging isolated parts (`reference.isolation`): a systematic error told apart from rounding.

For one part of one layer there are three row sets on the same inputs: the candidate's `c`, the
reference's own `r` (same dtype) and the reference's exact function `p` (float64). Two statistics:

- **rows**: the row error of `c` against `r` (distance over the typical row norm, worst row), bounded
  as every tensor is: `ALPHA x noise + FLOOR`, the noise being `r`'s own row error against `p`.
- **scale**: the projection of `c - r` onto `r`, `<c - r, r> / <r, r>`, over a group of rows and columns:
  the whole part, each block of positions, each attention head, the tokens each expert received.
  A kernel that scales, shifts or drops a share of a part's output moves it by that share; rounding
  moves it by about its relative size over the square root of the rows it averages (it has no
  direction), or by the bias the reference's own rounding has, if larger. The bound is `ALPHA_SCALE x
  max(|projection of r - p onto p|, relative noise of r / sqrt(rows)) + SCALE_FLOOR`.

Each group is named by the smallest place it is ("layer 1 attention, head 2", "layer 0 mlp, expert 3",
"layer 1 attention, positions 24..31"), so a failure says where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

# Chosen from tools/measure/bf16_sensitivity.py (figures in docs/how-it-works.md): every legitimate candidate
# stays well under 1.0x and a 1% systematic error in any one part well over it.
ALPHA = 4.0  # the rows statistic: as every tensor's bound
ALPHA_SCALE = 3.0
ROWS_FLOOR = 2e-3
SCALE_FLOOR = 5e-4
POSITION_BLOCKS = 4  # a part's positions are also judged in this many contiguous blocks
MIN_GROUP_ROWS = 4  # a group with fewer rows says too little to be judged on its own


@dataclass(frozen=True)
class IsolatedResult:
    """One statistic of one isolated part, or of one group of its rows and columns."""

    place: str  # "layer 1 attention", "layer 1 attention, head 2", "layer 0 mlp, expert 3", ...
    statistic: str  # "rows" or "scale"
    error: float
    bound: float
    rows: int
    layer: int = 0  # the decoder layer the part is in
    part: str = ""  # the part's kind ("layer": the whole layer's output, which every narrower part is inside)

    @property
    def ratio(self) -> float:
        return self.error / self.bound if self.bound > 0 else (0.0 if self.error == 0 else float("inf"))

    @property
    def passed(self) -> bool:
        return self.error <= self.bound


@dataclass(frozen=True)
class Group:
    """Rows (indices into the part's rows) and columns (a slice) judged together, and their place."""

    where: str
    rows: torch.Tensor | None = None  # None: every row
    columns: slice = field(default_factory=lambda: slice(None))


def judge_part(place: str, c: torch.Tensor, r: torch.Tensor, p: torch.Tensor, groups: list[Group],
               layer: int = 0, part: str = "") -> list[IsolatedResult]:
    """Every statistic of one part (in decoder layer `layer`): its rows, its whole scale and each group's scale."""
    c, r, p = (t.to(torch.float64) for t in (c, r, p))
    results = [_rows(place, c, r, p)]
    for group in [Group(""), *groups]:
        rows = torch.arange(c.shape[0]) if group.rows is None else group.rows
        if rows.numel() < MIN_GROUP_ROWS:
            continue
        where = f"{place}, {group.where}" if group.where else place
        results.append(_scale(where, c[rows][:, group.columns], r[rows][:, group.columns], p[rows][:, group.columns]))
    return [replace(result, layer=layer, part=part) for result in results]


def _rows(place: str, c: torch.Tensor, r: torch.Tensor, p: torch.Tensor) -> IsolatedResult:
    typical = r.norm(dim=1).pow(2).mean().sqrt().item() or 1.0
    error = ((c - r).norm(dim=1) / typical).nan_to_num(nan=math.inf).max().item() if c.numel() else 0.0
    noise = ((r - p).norm(dim=1) / typical).max().item() if r.numel() else 0.0
    return IsolatedResult(place, "rows", error, ALPHA * noise + ROWS_FLOOR, c.shape[0])


def _scale(place: str, c: torch.Tensor, r: torch.Tensor, p: torch.Tensor) -> IsolatedResult:
    energy = r.pow(2).sum().item()
    exact = p.pow(2).sum().item()
    if energy == 0 or exact == 0:  # nothing to scale: the rows statistic judges it
        return IsolatedResult(place, "scale", 0.0, SCALE_FLOOR, c.shape[0])
    shift = abs(((c - r) * r).sum().item() / energy)
    bias = abs(((r - p) * p).sum().item() / exact)
    relative = math.sqrt((r - p).pow(2).sum().item() / exact)
    bound = ALPHA_SCALE * max(bias, relative / math.sqrt(c.shape[0])) + SCALE_FLOOR
    return IsolatedResult(place, "scale", shift if math.isfinite(shift) else math.inf, bound, c.shape[0])


def position_groups(positions: torch.Tensor, blocks: int = POSITION_BLOCKS) -> list[Group]:
    """Contiguous blocks of positions (by position id, so left padding does not shift them)."""
    if positions.numel() == 0:
        return []
    top = int(positions.max()) + 1
    size = max(1, math.ceil(top / blocks))
    groups = []
    for first in range(0, top, size):
        last = min(top, first + size) - 1
        groups.append(Group(f"positions {first}..{last}", torch.nonzero((positions >= first) & (positions <= last))
                            .flatten()))
    return groups


def head_groups(width: int, heads: int) -> list[Group]:
    """Each head's columns of an attention output laid out [heads x head_dim]."""
    if heads <= 1 or width % heads:
        return []
    size = width // heads
    return [Group(f"head {h}", None, slice(h * size, (h + 1) * size)) for h in range(heads)]


def expert_groups(experts: torch.Tensor, count: int) -> list[Group]:
    """The tokens each expert received (`experts`: [tokens, top_k] expert ids). Experts that received exactly the
    same tokens (a batch of repeated tokens routes them together) are one group: the block's output on those tokens
    cannot tell them apart, so the place names them all ("experts 3, 50, 117 (the same tokens)")."""
    together: dict[tuple[int, ...], list[int]] = {}
    for e in range(count):
        rows = torch.nonzero((experts == e).any(dim=-1)).flatten()
        if rows.numel() == 0:
            continue  # an expert without tokens has nothing to judge
        together.setdefault(tuple(rows.tolist()), []).append(e)
    groups = []
    for rows, members in together.items():
        where = f"expert {members[0]}" if len(members) == 1 else \
            f"experts {', '.join(map(str, members))} (the same tokens)"
        groups.append(Group(where, torch.tensor(rows, dtype=torch.long)))
    return sorted(groups, key=lambda g: int(g.where.split()[1].rstrip(",")))


def judge_parts(candidate: dict[tuple[int, str], torch.Tensor], own: dict[tuple[int, str], torch.Tensor],
                exact: dict[tuple[int, str], torch.Tensor], token_mask: torch.Tensor, positions: torch.Tensor,
                routes: dict[int, torch.Tensor], heads: int, experts: dict[int, int],
                filled: dict[tuple[int, str], torch.Tensor] | None = None) -> list[IsolatedResult]:
    """Every isolated part (keyed (layer, kind), rows over the batch's token slots) judged on the real tokens:
    by blocks of positions, by head for the heads part, by expert for an MoE block (`routes`: [tokens, top_k]).
    A part the candidate did not produce, or produced in another shape, fails its rows statistic; so does one its
    passes produced for only some of the real tokens (`filled`: the token slots each part's rows were filled at;
    the rest are zeros, which would otherwise fail as a scale error without saying why)."""
    real = torch.nonzero(token_mask.reshape(-1)).flatten()
    at = positions.reshape(-1)[real]
    results = []
    for key in sorted(own):
        layer, kind = key
        place = {"layer": f"layer {layer} output", "rotary": "rotary table"}.get(kind, f"layer {layer} {kind}")
        r, p, c = own[key], exact.get(key), candidate.get(key)
        if p is None or r.shape[0] % token_mask.numel():
            continue  # the reference's own part is not rows per token slot: nothing to judge it by
        streams = r.shape[0] // token_mask.numel()
        if streams > 1:  # several rows per token (DeepSeek-V4's hyper-connection streams): one row per token
            r, p = (t.reshape(token_mask.numel(), -1) for t in (r, p))
            c = c.reshape(token_mask.numel(), -1) if c is not None and c.numel() == r.numel() else c
        if c is None or c.shape != r.shape:
            what = "did not run" if c is None else f"gave {tuple(c.shape)}, the reference {tuple(r.shape)}"
            results.append(IsolatedResult(f"{place} ({what})", "rows", math.inf, 0.0, 0, layer, kind))
            continue
        ran = (filled or {}).get(key)
        if ran is not None and ran.numel() == token_mask.numel() and not bool(ran.reshape(-1)[real].all()):
            done = int(ran.reshape(-1)[real].sum())
            results.append(IsolatedResult(f"{place} (ran for {done} of {real.numel()} real tokens)", "rows", math.inf,
                                          0.0, 0, layer, kind))
            continue
        groups = position_groups(at)
        if kind == "heads":
            groups += head_groups(r.shape[1], heads)
        if kind == "mlp" and layer in routes and layer in experts:
            groups += expert_groups(routes[layer].reshape(token_mask.numel(), -1)[real], experts[layer])
        results += judge_part(place, c[real], r[real], p[real], groups, layer, kind)
    return results
