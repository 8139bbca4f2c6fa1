"""A candidate cannot end the process or outlive its timeout silently.

While a candidate (a backend, the hooks it installs, a layout) runs inside `running`:

- the ways Python code ends a process are guarded: `sys.exit`, `os._exit`, `os.abort`, the `os.exec*`
  family, and `os.kill`, `os.killpg`, `signal.raise_signal`, `signal.pthread_kill` aimed at this process
  with a terminating signal raise `CandidateExit` instead, in any thread (restored after). A `SystemExit`,
  and a `KeyboardInterrupt` the user did not cause (Ctrl-C still ends the run), are caught the same way;
- in the main thread, SIGALRM ends a candidate that runs past its timeout with `CandidateTimeout`, raised
  where it runs (Python code, or a system call Python retries, such as a sleep or a lock);
- a candidate stuck outside Python past its timeout plus a grace (a C loop, a signal it blocked) meets a
  watchdog thread, which prints the check's ERROR line and ends the process with status 1; and if even
  that thread cannot run (C code holding the GIL), faulthandler, which needs no GIL, ends the process
  with status 1 after printing every thread's traceback (where it was stuck).

Each becomes a `CandidateError`: an ordinary exception that the check reports as its ERROR, saying what
the candidate did and where. What is not caught: C code that calls exit() or abort() itself, and
signals sent from another process (see docs/trust.md).
"""

from __future__ import annotations

import faulthandler
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Callable, Iterator

from ..errors import VeosnapError

MAY_NOT = "a candidate may not end the process"
MAX_GRACE_S = 10.0
_HERE = os.path.normcase(os.path.abspath(__file__))
_DEADLY = {getattr(signal, name) for name in ("SIGKILL", "SIGTERM", "SIGINT", "SIGQUIT", "SIGABRT", "SIGHUP",
                                                 "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL") if hasattr(signal, name)}


class CandidateExit(BaseException):
    """Raised in place of an exit while a candidate runs (a BaseException: `except Exception` does not hide it)."""


class CandidateTimeout(BaseException):
    """Raised where a candidate runs when its timeout passes."""


class CandidateError(Exception):
    """A candidate tried to end the process or ran past its timeout: its check's ERROR, in one line."""


def check_timeout(value: float, flag: str = "--timeout") -> float:
    """A timeout in seconds, refused with one line unless it is a positive, finite number."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise VeosnapError(f"{flag} {value!r}: give a positive, finite number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise VeosnapError(f"{flag} {seconds:g}: give a positive, finite number of seconds")
    return seconds


def grace(timeout_s: float) -> float:
    """How long past its timeout a candidate stuck outside Python gets before the process ends."""
    return min(MAX_GRACE_S, max(1.0, timeout_s / 2))


@dataclass
class _Run:
    """One guarded candidate run."""

    pid: int
    thread: threading.Thread
    attempts: list[str] = field(default_factory=list)  # exits tried (from any thread), first first
    user_interrupt: bool = False
    finished: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # `time.monotonic()` when the candidate's timeout starts (after `ready`)
    last_resort_s: float = 0.0  # faulthandler's delay (0: none)
    armed_at: float = 0.0  # `time.monotonic()` it was last armed at (0: never)
    arming: threading.Lock = field(default_factory=threading.Lock)  # arming after the run's end would outlive it

    def arm_last_resort(self) -> None:
        """faulthandler (it needs no GIL) prints where every thread is and exits 1 `last_resort_s` from now,
        unless the run is over or no stream with a file descriptor can take its traceback."""
        with self.arming:
            stream = _stream_with_fd()
            if self.last_resort_s and not self.done.is_set() and stream is not None:
                faulthandler.dump_traceback_later(self.last_resort_s, exit=True, file=stream)
                self.armed_at = time.monotonic()

    def end(self) -> None:
        """The run is over: the watchdog lets it go and the last resort is cancelled."""
        self.finished = True
        with self.arming:
            self.done.set()
            if self.armed_at:
                faulthandler.cancel_dump_traceback_later()


_active: _Run | None = None
_lock = threading.Lock()
_report_fd = 1  # where the watchdog writes the check's ERROR block (`report_to`)


def _where(frame: FrameType | None) -> str:
    while frame is not None and os.path.normcase(os.path.abspath(frame.f_code.co_filename)) == _HERE:
        frame = frame.f_back
    return f"(at {frame.f_code.co_filename}:{frame.f_lineno})" if frame is not None else ""


def _where_raised(tb: TracebackType | None) -> str:
    frames = [f for f in traceback.extract_tb(tb) if os.path.normcase(os.path.abspath(f.filename)) != _HERE]
    return f"(at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _refuse(run: _Run, call: str, frame: FrameType | None) -> None:
    who = "the candidate" if threading.current_thread() is run.thread else "a thread of the candidate"
    message = f"{who} called {call} {_where(frame)}: {MAY_NOT}"
    run.attempts.append(message)
    raise CandidateExit(message)


def _call_text(name: str, args: tuple, kwargs: dict) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(shown)})"


def _guarded_exit(name: str, real: Callable) -> Callable:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        run = _active
        if run is None or os.getpid() != run.pid:  # a forked child may exit as it likes
            return real(*args, **kwargs)
        _refuse(run, _call_text(name, args, kwargs), sys._getframe(1))

    guarded.__wrapped__ = real  # type: ignore[attr-defined]
    return guarded


def _aimed_at_self(name: str, args: tuple) -> bool:
    me = os.getpid()
    if name == "os.kill":
        return len(args) >= 2 and args[0] in (0, me) and args[1] in _DEADLY
    if name == "os.killpg":
        return len(args) >= 2 and args[0] in (0, os.getpgid(0)) and args[1] in _DEADLY
    if name == "signal.raise_signal":
        return bool(args) and args[0] in _DEADLY
    if name == "signal.pthread_kill":
        return len(args) >= 2 and args[1] in _DEADLY
    return False


def _guarded_signal(name: str, real: Callable) -> Callable:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        run = _active
        if run is None or os.getpid() != run.pid or not _aimed_at_self(name, args):
            return real(*args, **kwargs)
        _refuse(run, _call_text(name, args, kwargs), sys._getframe(1))

    guarded.__wrapped__ = real  # type: ignore[attr-defined]
    return guarded


_EXITS = [(sys, "exit"), (os, "_exit"), (os, "abort"),
          *((os, n) for n in ("execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe")
            if hasattr(os, n))]
_SIGNALS = [(os, "kill"), (os, "killpg"), (signal, "raise_signal"), (signal, "pthread_kill")]


def _patch() -> list[tuple[object, str, Callable]]:
    saved = []
    for owner, attr in _EXITS + _SIGNALS:
        real = getattr(owner, attr, None)
        if real is None:
            continue
        name = f"{owner.__name__.replace('posix', 'os')}.{attr}"
        wrap = _guarded_exit if (owner, attr) in _EXITS else _guarded_signal
        saved.append((owner, attr, real))
        setattr(owner, attr, wrap(name, real))
    return saved


def real_exit(code: int) -> None:
    """`os._exit`, even while a candidate runs (for veosnap's own ending of a process)."""
    exit_ = getattr(os._exit, "__wrapped__", os._exit)
    exit_(code)


@contextmanager
def report_to(fd: int) -> Iterator[None]:
    """Within the block the watchdog writes its ERROR block to `fd`: the CLI points file descriptor 1 at
    stderr while candidates run (what they print must not mix with the report) and gives the real stdout."""
    global _report_fd
    previous, _report_fd = _report_fd, fd
    try:
        yield
    finally:
        _report_fd = previous


# One watchdog thread per process, started once and handed each guarded run (one at a time: runs do not nest):
# starting a thread per run cost a check 1-4 ms on its critical path (the new thread's start waits for the GIL).
_watched: queue.SimpleQueue = queue.SimpleQueue()
_watcher: threading.Thread | None = None


def _watch(run: _Run, timeout_s: float, extra_s: float, line: str) -> None:
    """Have the watchdog thread end the process if `run` is not done `timeout_s + extra_s` from now."""
    global _watcher
    if _watcher is None or not _watcher.is_alive():  # the first run, or a forked child (threads do not survive)
        _watcher = threading.Thread(target=_watch_runs, daemon=True, name="veosnap-watchdog")
        _watcher.start()
    _watched.put((run, timeout_s, extra_s, line))


def watchdog() -> threading.Thread | None:
    """The watchdog thread, once started (veosnap's own: not a thread of the candidate it watches)."""
    return _watcher


def _watch_runs() -> None:
    while True:
        _watchdog(*_watched.get())


def _watchdog(run: _Run, timeout_s: float, extra_s: float, line: str) -> None:
    # Handed the run before the candidate starts (beside `ready`), the watchdog wakes first at the earliest its
    # deadline could be, then waits for the deadline counted from `run.started`: the start is never signalled,
    # which would wake this thread on the check's path, where the run is no longer handed to it. While the run still
    # waits for what it needs (not the candidate's time), each wake pushes the last resort back, which would
    # otherwise end a wait longer than the timeout and twice its grace (a large model's draw).
    limit = wait = timeout_s + extra_s
    while not run.done.wait(wait):
        if run.started is None:
            run.arm_last_resort()
            continue
        wait = run.started + limit - time.monotonic()
        if wait <= 0:
            break
    else:
        return
    message = (f"{line}\n  error: timed out after {timeout_s:g} s and stuck outside Python for {extra_s:g} s more; "
               "veosnap ends the process\n")
    error = f"veosnap: error: {message.splitlines()[1].strip()}\n"
    for fd, text in ((_report_fd, message), (2, error)) if line else ((2, error),):
        try:
            os.write(fd, text.encode())
        except OSError:
            pass
    real_exit(1)


def _stream_with_fd() -> Any:
    for stream in (sys.__stderr__, sys.stderr):
        try:
            if stream is not None:
                stream.fileno()
                return stream
        except (AttributeError, OSError, ValueError):
            continue
    return None


@contextmanager
def running(line: str = "", timeout_s: float | None = None, ready: Callable[[], object] | None = None
            ) -> Iterator[None]:
    """Run a candidate inside: exits and, in the main thread, overruns of `timeout_s` become `CandidateError`.

    `line` is the check's ERROR header (`ERROR  cpu/llama/step-float32  backend=...  layout=...`), which
    the watchdog prints if the candidate is stuck outside Python past the timeout and its grace. `ready` is
    waited for once the guard is set up and before `timeout_s` starts: what the run needs that is not the
    candidate's (a check's model, its weights still being drawn), so the guard's own setup is made beside it.
    """
    global _active
    with _lock:
        if _active is not None:  # nested: the outer guard already covers this run
            nested = True
        else:
            nested = False
            run = _Run(os.getpid(), threading.current_thread())
            _active = run
    if nested:
        yield
        return
    saved = _patch()
    main = threading.current_thread() is threading.main_thread()
    alarm = bool(timeout_s) and main and hasattr(signal, "setitimer")
    old_alarm = old_timer = old_int = None
    armed = False  # the alarm set (`ready` may raise before)
    started = 0.0

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        if not run.finished:
            raise CandidateTimeout()

    def on_interrupt(_signum: int, _frame: FrameType | None) -> None:
        run.user_interrupt = True
        raise KeyboardInterrupt

    try:
        if main:
            old_int = signal.signal(signal.SIGINT, on_interrupt)
        # The watchdog and the last resort are set up before `ready` is waited for, while the main thread has
        # nothing to do: arming faulthandler (it starts a thread) took 0.2-3 ms of a check on the H100 when made
        # after it, at the candidate's start, and handing the watchdog its run wakes a thread. Their deadlines
        # still count from that start (below).
        if timeout_s:
            extra = grace(timeout_s)
            run.last_resort_s = timeout_s + 2 * extra
            _watch(run, timeout_s, extra, line)
            run.arm_last_resort()
        if ready is not None:
            ready()
        started = run.started = time.monotonic()  # someone else's alarm is given back what is left of it from here
        if alarm:
            old_alarm = signal.signal(signal.SIGALRM, on_alarm)
            old_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)
            armed = True
        if run.armed_at and started - run.armed_at > extra / 2:
            # A long wait: armed again, so the last resort comes at least half a grace after the watchdog's end
            run.arm_last_resort()
        try:
            yield
        except CandidateExit as exc:
            raise CandidateError(str(exc) or (run.attempts[:1] or ["the candidate tried to end the process"])[0]) \
                from None
        except CandidateTimeout as exc:
            where = _where_raised(exc.__traceback__).removeprefix("(").removesuffix(")")
            raise CandidateError(f"timed out after {timeout_s:g} s (ended by veosnap{', ' + where if where else ''})") \
                from None
        except SystemExit as exc:
            shown = f"SystemExit({exc.code!r})" if exc.code is not None else "SystemExit"
            where = _where_raised(exc.__traceback__)
            raise CandidateError(f"the candidate raised {shown} {where}: {MAY_NOT}") from None
        except KeyboardInterrupt as exc:
            if run.user_interrupt:
                raise
            raise CandidateError(f"the candidate raised KeyboardInterrupt {_where_raised(exc.__traceback__)}: "
                                 f"{MAY_NOT}") from None
        if run.attempts:  # an exit the candidate swallowed, or one tried in another thread
            raise CandidateError(run.attempts[0])
    finally:
        run.end()
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
            if old_timer and old_timer[0] > 0:  # someone else's alarm (pytest-timeout): give it back
                left = old_timer[0] - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), old_timer[1])
        if main and old_int is not None:
            signal.signal(signal.SIGINT, old_int)
        for owner, attr, real in reversed(saved):
            setattr(owner, attr, real)
        with _lock:
            _active = None
