"""What a golden must hold to stand for a model, asked of the model itself, never of the golden.

A golden's hashes are unkeyed: they catch accidents, not an edit whose author recomputed them. So a
check never trusts the golden's own tensor set. Before any number is compared, the model the config
describes is built on the meta device (no memory) and the golden must hold, besides its inputs:

    step    the loss, the logits, every decoder layer's output, every trainable parameter's gradient
    train   each step's loss and gradient norm, every trainable parameter's update
    both    for every router the model has: its expert ids, weights and margins (train: the first step's)

unless its manifest says why a tensor is absent (`Absence`: frozen parameters, a forward-only golden,
routers veosnap cannot read). An excuse for something the model does not have, and a tensor the model
does not produce, are refused too.

Routers: veosnap reads a router found beside an `experts` module whose output holds `[tokens, experts]`
logits, the choice read at the experts' inputs (`probes`). Any other router, and an MoE block where it
finds none, must be excused by the manifest (`probes.found_unread` finds them from the modules alone);
the recorder also excuses a router found by shape that returned another form, which only running it
can tell.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..errors import GoldenError
from ..golden import names
from ..golden.codec import Golden
from ..golden.manifest import Absence, Manifest
from . import limits, models
from .probes import READ_FORM, decoder_layers, find_moe_layers, found_unread
from .zoo import ToyConfig

SHOWN = 3  # names listed per gap; the rest are counted


@dataclass(frozen=True)
class Produces:
    """What a model produces that a golden must hold."""

    trainable: tuple[str, ...]  # parameter names (each has a gradient, and an update in train)
    frozen: tuple[str, ...]  # parameters that do not train
    layers: int  # decoder layers (each has an output)
    routers: dict[str, int]  # routers found by shape (module path: MoE layer); each has routes, or an excuse
    unread: tuple[str, ...]  # routers (or MoE blocks) veosnap cannot read, by module path (`found_unread`)


def produces(model: nn.Module) -> Produces:
    """What `model` (any device, meta included) produces in a step."""
    params = list(model.named_parameters())
    return Produces(trainable=tuple(n for n, p in params if p.requires_grad),
                    frozen=tuple(n for n, p in params if not p.requires_grad),
                    layers=len(decoder_layers(model)),
                    # A block without a router (its routes read only at its experts' inputs) has no margins to
                    # record: `found_unread` names it.
                    routers={moe.router_name: moe.layer for moe in find_moe_layers(model) if moe.router is not None},
                    unread=tuple(found_unread(model)))


def absences(made: Produces, unread: Mapping[str, str]) -> list[Absence]:
    """What a golden recorded from a model leaves out, and why (the recorder writes these): its frozen
    parameters, and the routers it could not read (`probes.unread_routers`: module path to what each
    returned), one absence per distinct answer."""
    found = []
    if made.frozen:
        found.append(Absence("frozen", made.frozen, "requires_grad is False in the reference model"))
    by_reason: dict[str, list[str]] = {}
    for name, reason in sorted(unread.items()):
        by_reason.setdefault(reason, []).append(name)
    found += [Absence("router_unread", tuple(names), reason) for reason, names in by_reason.items()]
    return found


def routes_not_captured(manifest: Manifest) -> str:
    """What a record, a report and `show` say of the routers a golden holds no routes for ('' when none)."""
    return "; ".join(f"routes not captured for {', '.join(a.names)} ({a.reason}; veosnap reads routers that return "
                     f"{READ_FORM})" for a in manifest.absent if a.kind == "router_unread")


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def _numbers(what: str, values: list[int]) -> str:
    return f"{what}{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}"


def gaps(golden: Golden, made: Produces) -> list[str]:
    """Each way `golden` falls short of what the model produces (empty: it covers the model)."""
    manifest, have = golden.manifest, golden.held_names()
    step = golden.key.scenario != "train"
    found: list[str] = []
    excused, unread, forward_only = set(), set(), False
    every = set(made.trainable) | set(made.frozen)
    for absence in manifest.absent:
        if absence.kind == "frozen":
            for name in absence.names:
                if name not in every:
                    found.append(f"its manifest excuses {name}, which the model does not have")
            excused |= set(absence.names)
        elif absence.kind == "router_unread":
            for name in absence.names:
                if name not in made.unread and name not in made.routers:
                    found.append(f"its manifest excuses the router of {name}, which the model lacks")
            unread |= set(absence.names)
        elif absence.kind == "forward_only":
            if not step:
                found.append("its manifest says forward only, but a train golden needs every update")
            forward_only = True
    kind = names.Grad if step else names.Update
    what = "gradient" if step else "update"
    expected = [p for p in made.trainable if p not in excused]
    if not (step and forward_only):
        missing = sorted(str(kind(p)) for p in expected if str(kind(p)) not in have)
        if missing:
            found.append(f"no {what} for {len(missing)} of {len(expected)} trainable parameters ({_listed(missing)})")
    if step:
        layers = [i for i in range(made.layers) if str(names.LayerOutput(i)) not in have]
        if layers:
            found.append(f"no output of {_numbers('decoder layer', layers)}")
    routes = sorted({layer for router, layer in made.routers.items() if router not in unread
                     and any(str(names.Route(layer, part)) not in have for part in names.ROUTE_PARTS)})
    if routes:
        found.append(f"no routes for {_numbers('MoE layer', routes)} (expert ids, weights, margins)")
    silent = [block for block in made.unread if block not in unread]
    if silent:
        found.append(f"veosnap cannot read the router of {_listed(silent)} and its manifest does not say so")
    extra = sorted(name for name in have if not _produced(name, made, step))
    if extra:
        found.append(f"it holds tensors the model does not produce ({_listed(extra)})")
    return found


def _produced(name: str, made: Produces, step: bool) -> bool:
    parsed = names.try_parse(name)
    if isinstance(parsed, (names.Grad, names.Update)):
        return parsed.param in made.trainable and isinstance(parsed, names.Grad if step else names.Update)
    if isinstance(parsed, names.LayerOutput):
        return step and parsed.layer < made.layers
    if isinstance(parsed, names.Route):
        return parsed.layer in made.routers.values()
    return True  # inputs, loss, logits, train losses: the codec checks those


def require(golden: Golden, toy: ToyConfig, made: Produces | None = None) -> None:
    """Refuse `golden` unless it covers what the model of `toy` produces (see the module docstring). `made`:
    what that model produces, found on the model a check's prebuild constructed and vetted (the limits passed
    there); else the config's limits run first and the meta-device skeleton says."""
    if made is None:
        limits.check_config(toy)
        made = produces(models.skeleton(toy))
    found = gaps(golden, made)
    if found:
        raise GoldenError(golden.path, f"does not cover what the model produces ({'; '.join(found)}); re-record it, "
                                       "or say in its manifest why a tensor is absent")


def manifest_config(golden: Golden) -> ToyConfig:
    """The config a golden was recorded from, as a toy config named after the golden (for `verify`)."""
    return ToyConfig(name=golden.key.model, config=golden.manifest.config, path=golden.path)
