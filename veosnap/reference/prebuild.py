"""Building a check's model on a thread while the check reads its golden (issue 10: veosnap's fixed cost).

A check's model depends on its config, dtype, device and the golden's weight seed only. At about 1B
parameters the build takes seconds, while the check's own work before it (reading the file, decoding and
validating its head, the limits and the coverage) takes tens of milliseconds, on the check's critical
path until now. `Prebuild` builds the model on a thread from the moment the check starts, from the seed
and batch size its header declares (`golden.background.peek`); the check does its reading and refusals
meanwhile, unchanged and in the same order, and its first build of that model takes the one built.

Nothing is trusted early. The peeked seed only chooses what to build: the model is taken only when the
validated golden asks for the same config, dtype, device and seed. The thread builds only what the limits
allow, and vets it itself: it constructs the model (its parameters allocated on the host, not drawn), runs
the limits on that very model (`limits.check_config`, `limits.check_memory` with the peeked batch), and
only then draws the weights and moves them to the device; on any doubt it stops there. A meta-device
skeleton for the limits first would construct the model twice on the check's path (33 ms of the 12-layer
1B's check on the H200). Nor does it build for a golden the check will refuse at once (another hardware
class, another config). Its own failures are never reported: the check builds as before and meets the
same error, in its turn. While it constructs, transformers' init functions are patched process-wide
(`no_init_weights`), so a check snapshots the modeling code only once the construction is over (`begun`),
while the weights are drawn; `take` and `cancel` (a check's end, whatever its outcome) wait for the thread:
no build outlives its check, and any model constructed meanwhile takes its turn (`models._CONSTRUCTING`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from . import models
from .zoo import ToyConfig


# What the thread builds: the golden's weight seed, and the vetting of the model as constructed (it raises to
# stop; what it returns, the facts it found, the check reads through `vetted`).
Plan = tuple[int, Callable[[nn.Module], object]]


class Prebuild:
    """One model for (`toy`, `dtype`, `device`), built on a thread from the seed `plan` returns, once its vetting
    passed (`plan` is called there; None, or any exception, there or in the vetting: build nothing)."""

    def __init__(self, toy: ToyConfig, dtype: str, device: torch.device, plan: Callable[[], Plan | None]) -> None:
        self.toy, self.dtype, self.device = toy, dtype, torch.device(device)
        self._plan = plan
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = threading.Event()  # the build has begun, or the thread has ended
        self._model: nn.Module | None = None
        self._seed: int | None = None
        self._vetted: object = None
        self._cancelled = False
        threading.Thread(target=self._run, name=f"veosnap-prebuild {toy.name}", daemon=True).start()

    def _run(self) -> None:
        try:
            planned = self._plan()
            if planned is None or self._cancelled:
                return
            seed, vet = planned

            def vetted(model: nn.Module) -> None:
                self._vetted = vet(model)
                self._started.set()

            model = models.build(self.toy, models.dtype_from_name(self.dtype), self.device, seed, vet=vetted)
            with self._lock:
                if not self._cancelled:
                    self._model, self._seed = model, seed
        except BaseException:  # noqa: BLE001, S110 - the check meets the same problem when it builds, and says it
            pass
        finally:
            self._started.set()
            self._done.set()

    def begun(self) -> None:
        """Until the model is constructed and vetted, its weights being drawn (or the thread has ended). The
        build is the check's critical path, and its construction is Python, which the check's own reading
        would slow down (the GIL); that reading has the rest of the build (the draw and the copy to the
        device, in torch) to finish in."""
        self._started.wait()

    def vetted(self) -> object:
        """What the vetting of the model as constructed returned (after `begun`); None when it did not pass, or
        never ran. The check takes the limits' and coverage's facts from it instead of building a meta-device
        skeleton beside the build: that construction is Python, and its GIL would stretch the build's draw."""
        self._started.wait()
        return self._vetted

    def wait(self) -> None:
        """Until the thread has ended: the model built (or not). Its construction, which patched transformers'
        init functions process-wide (`no_init_weights`), was over at `begun`: a check snapshots the modeling
        module (`candidates.pristine`) and sets up its guard after that, beside the draw, and waits here inside
        the guard before its candidate's time starts."""
        self._done.wait()

    def take(self, device: torch.device | str, seed: int) -> nn.Module | None:
        """The model built, once, when it is the one asked for (waits for the thread, whatever is asked: a
        build on the caller's thread must not run beside this one); else None."""
        self._done.wait()
        if torch.device(device) != self.device:
            return None
        with self._lock:
            model, self._model = self._model, None
        return model if model is not None and self._seed == seed else None

    def builder(self, build: Callable[[torch.device], nn.Module], seed: int) -> Callable[[torch.device], nn.Module]:
        """`build`, except that its first call for this device and `seed` takes the model built here."""

        def first_taken(device: torch.device) -> nn.Module:
            model = self.take(device, seed)
            return model if model is not None else build(device)

        return first_taken

    def cancel(self) -> None:
        """Drop the model if nobody took it, once the thread has ended: nothing of a check goes on building
        after it returns (a build patches transformers process-wide while it runs)."""
        with self._lock:
            self._cancelled = True
        self._done.wait()
        with self._lock:
            self._model = None
