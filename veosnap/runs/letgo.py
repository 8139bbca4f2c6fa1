"""Letting go of a check's decoded golden off the check's path (issue 39: veosnap's fixed cost).

A decoded golden is a few hundred objects and tensors (sketches, norms, the manifest's entries). Freeing one
took 1.7-3.6 ms on an H100's host (55 threads in the process; plain tensors of the same sizes: 0.07 ms) and
0.3 ms on a 2-core CPU, at the end of every check, after its verdict was known: most of the H100's 1-5 ms
"+layouts" tail (docs/scale.md, round 10; `tools/bench/tail_probe.py`). A check now hands its golden here when
it is done (`hold`), and the next check lets it go (`let_go`) while its own model's weights are drawn on the
prebuild's thread (seconds at scale, in torch ops that run without the GIL). One golden is held between checks,
never more; the last one goes with the process.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_HELD: list[object] = []


def hold(thing: object) -> None:
    """Keep `thing` (a check's golden) until the next `let_go`; one held before goes now."""
    with _LOCK:
        before = list(_HELD)
        _HELD[:] = [thing]
    del before  # freed here, outside the lock: only when no check let it go in between


def let_go() -> None:
    """Free what `hold` kept: call it where the check has time to spare (its model's weights being drawn)."""
    with _LOCK:
        freed = list(_HELD)
        _HELD.clear()
    del freed  # here, outside the lock


def held() -> int:
    """How many things are held (0 or 1)."""
    with _LOCK:
        return len(_HELD)
