"""A candidate's threads do not outlive its run, nor keep the process alive.

A backend or layout may start threads. One still running Python after the candidate returned could change
the reference under the next check (a thread that re-applies a patch every few milliseconds would undo
`pristine`'s restore), and a non-daemon one would keep the process alive after its report. So:

- `started` notes the threads a candidate starts while it runs; `stop` then raises `ThreadStopped` in each
  one still alive and waits a moment (`STOP_WAIT_S`, shared): a thread running Python ends there, and the
  check's report says so, naming the candidate. A thread waiting in C (an idle pool's worker, a long
  sleep) is left as it is, its pending stop withdrawn, so a pool the candidate keeps for its next call
  still works.
- At the command's end, `settle` waits (bounded) for veosnap's own background threads, then ends the
  process without waiting for what candidates left behind (`os._exit`, after the exit handlers and a
  flush): interpreter shutdown neither joins a candidate's non-daemon thread forever nor tears down
  beside a thread that is still running, which can abort the process.

A thread that catches `ThreadStopped` and runs on is remembered (`defiant`): while it lives, every later
run in the process is checked for patches it made (`pristine.kept`), and a run it touched is an error that
names it and its candidate. Not contained: a thread that waits in C and patches later; recording stays
pristine regardless, in a fresh process (`runs/isolated.py`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass

STOP_WAIT_S = 1.0  # how long the threads a candidate left running get, together, to end at its stop
OWN_WAIT_S = 30.0  # how long the command's end waits for veosnap's own background work (a golden's decode)
OWN_PREFIX = "veosnap-"  # veosnap names its background threads so


class ThreadStopped(BaseException):
    """Raised by veosnap in a thread a candidate left running after it returned."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        _delivered.add(threading.get_ident())  # made where it is raised: the thread ran Python and met it


_delivered: set[int] = set()


@dataclass(frozen=True)
class Stopped:
    """Threads a candidate left running after it returned, which veosnap stopped."""

    candidate: str
    names: tuple[str, ...]  # stopped
    defiant: tuple[str, ...] = ()  # met the stop and ran on (they caught it)

    def note(self) -> str:
        shown = ", ".join(repr(n) for n in self.names + self.defiant)
        count = len(self.names) + len(self.defiant)
        what = "stopped by veosnap" if not self.defiant else \
            f"{', '.join(repr(n) for n in self.defiant)} caught veosnap's stop and runs on"
        return f"candidate {self.candidate} left {count} thread{'s' if count > 1 else ''} running after it returned " \
               f"({shown}): {what}"


_hook_installed = False
_defiant: list[tuple[threading.Thread, str]] = []  # threads that caught the stop, with their candidate


def alive() -> set[threading.Thread]:
    """The threads alive now (to compare with after a candidate runs)."""
    return set(threading.enumerate())


# Threads whose code is a library's machinery, not the candidate's: torch.compile's and Triton's compile pools,
# executor workers, tqdm's monitor. An exception raised into them breaks the library for the rest of the
# process (on the H200, compile's workers raised ThreadStopped and "cannot join a dummy thread"), and what
# they run is no patch of the candidate's.
LIBRARY_THREADS = ("torch", "triton", "concurrent", "multiprocessing", "queue", "asyncio", "threading", "tqdm",
                   "transformers", "accelerate", "_pytest", "execnet")


def _library(thread: threading.Thread) -> bool:
    if isinstance(thread, threading._DummyThread):  # a thread started in C (a CUDA or compiler callback)
        return True
    target = getattr(thread, "_target", None) or type(thread).run
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in LIBRARY_THREADS and type(thread).__module__.split(".")[0] in (
        "threading", *LIBRARY_THREADS)


def started(before: set[threading.Thread], exclude: tuple[threading.Thread | None, ...] = ()) -> list[threading.Thread]:
    """The threads alive now that were not in `before`, but for `exclude` (veosnap's own: the watchdog) and
    library machinery (`LIBRARY_THREADS`)."""
    return sorted((t for t in threading.enumerate() if t not in before and t not in exclude and t.ident is not None
                   and not _library(t)), key=lambda t: t.name)


def _async_raise(thread: threading.Thread, exc: type[BaseException] | None) -> None:
    # The one way to end another Python thread: an exception raised where it next runs Python. None withdraws it.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(exc) if exc is not None else None)  # None: NULL


def _quiet_hook() -> None:
    """Threads ended by `ThreadStopped` end quietly (no `Exception in thread` traceback)."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not ThreadStopped:
            previous(args)

    threading.excepthook = hook


def stop(candidate: str, threads: list[threading.Thread]) -> Stopped | None:
    """Stop the threads `candidate` left running that run Python (see the module's docstring); the rest stay.
    None when none was stopped or caught the stop."""
    running = [t for t in threads if t.is_alive()]
    if not running:
        return None
    _quiet_hook()
    for thread in running:
        _async_raise(thread, ThreadStopped)
    deadline = time.monotonic() + STOP_WAIT_S
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    ended = tuple(t.name for t in running if not t.is_alive() and t.ident in _delivered)  # not those that finished
    defiant = []
    for thread in running:
        if thread.is_alive():
            _async_raise(thread, None)  # waiting in C: leave it be, and its pending stop with it
            if thread.ident in _delivered:
                defiant.append(thread)
                _defiant.append((thread, candidate))
    _delivered.clear()
    return Stopped(candidate, ended, tuple(t.name for t in defiant)) if ended or defiant else None


def defiant() -> list[tuple[threading.Thread, str]]:
    """Threads that caught veosnap's stop and still run, with the candidate that started each."""
    _defiant[:] = [(t, c) for t, c in _defiant if t.is_alive()]
    return list(_defiant)


def _others() -> tuple[list[threading.Thread], list[threading.Thread]]:
    """The threads alive besides this one and the watchdog (idle, it never ends): veosnap's own background
    work, and the rest (a candidate's, a library's)."""
    others = [t for t in threading.enumerate()
              if t is not threading.current_thread() and t.name != f"{OWN_PREFIX}watchdog"]
    own = [t for t in others if t.name.startswith(OWN_PREFIX) and t.daemon]
    return own, [t for t in others if t not in own]


def settle(code: int) -> int:
    """The end of a `veosnap` process: wait (bounded) for veosnap's own background threads; if any other thread
    is still alive (a candidate's, a library's, or veosnap's own past the wait), end the process now with
    `code`, after the exit handlers and a flush; else return `code` for an ordinary exit."""
    deadline = time.monotonic() + OWN_WAIT_S
    for thread in _others()[0]:
        thread.join(max(0.0, deadline - time.monotonic()))
    own, rest = _others()
    if not own and not rest:
        return code
    atexit._run_exitfuncs()  # what an ordinary exit runs, before skipping the shutdown's joins of threads
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)
