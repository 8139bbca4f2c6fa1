"""The parent's side of a multi-process layout check: one torchrun for every multi-process layout of a
check, a time limit, the reason it failed, and the ranks' results.

    python -m torch.distributed.run --standalone --nproc-per-node N -m veosnap.candidates.layouts.worker \\
        --goldens DIR --configs DIR --testdata DIR --hardware-class cpu --model M --dtype D --scenario S \\
        --backend SPEC --layout SPEC [--layout SPEC ...] --out DIR --timeout S

For the i-th layout, rank 0 writes `OUT/<i>.safetensors` (the assembled capture, and under `replayed.`
the run forced onto the golden's routes) or `OUT/<i>.skip` (why it does not apply). A rank that fails
writes `OUT/error-rank<R>.txt` (one line) and exits, so torchrun ends the others; the rank that failed
first is blamed, not one torchrun stopped afterwards. A rank that fails or hangs ends the run within the
time limit: the whole process group is killed.

Nothing outlives the parent: SIGTERM or SIGINT to it ends torchrun and its ranks and removes OUT (the
CLI turns SIGTERM into an exception, so the cleanup below runs); if the parent is killed outright,
torchrun gets SIGTERM by its parent-death signal (Linux) and ends its ranks, which have one of their
own, and the next run removes the OUT directory left behind (`remove_stale`: unlocked and old).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no stale-directory cleanup
    fcntl = None  # type: ignore[assignment]

import torch

from ...about import IMPORT_ROOT
from ...golden.key import GoldenKey
from ...numerics.sketch import CandidateSketch, SketchProblem
from ...reference import isolation
from ...reference.capture import Capture
from ...reference.zoo import Project
from .engine import LayoutResult

DEFAULT_TIMEOUT_S = 600.0
END_GRACE_S = 10.0  # how long torchrun gets to end its ranks after a timeout
WORKER = "veosnap.candidates.layouts.worker"
REPLAYED = "replayed."
PROGRESS = "progress-rank"  # OUT/progress-rank<R>.txt: the block rank R last entered (see `where_ranks_were`)
ISOLATED = "isolated."  # a layer part's rows: isolated.<own|exact|candidate>.<layer>.<kind>
SKETCH = "sketch."  # a sketched tensor's reduction: sketch.<name>.values / .counts / .off_support
PREFIX = "veosnap-layouts-"
LOCK = "owner.lock"  # held by the parent while the run lives
STALE_S = 60.0  # an unlocked OUT directory older than this was left by a parent that was killed
PARENT_PID_ENV = "VEOSNAP_TORCHRUN_PID"
# Run first, in the process that then becomes torchrun: its parent-death signal, and no start at all if
# the parent is already gone. The signal survives exec.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.environ["VEOSNAP_TORCHRUN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


@dataclass(frozen=True)
class Outcome:
    """What the ranks said about one layout: its result, why it was skipped, or why it failed."""

    result: LayoutResult | None = None
    skipped: str = ""
    error: str = ""


def run(project: Project, key: GoldenKey, backend: str, layouts: list[str], nproc: int,
        timeout_s: float = DEFAULT_TIMEOUT_S, isolate: bool = False) -> list[Outcome]:
    """Run `layouts` (SPECs) of the golden for `key` with `backend` (a SPEC) on `nproc` torchrun ranks
    (`isolate`: a real-shape golden's layers isolated too, as `check --isolate`)."""
    remove_stale()
    with tempfile.TemporaryDirectory(prefix=PREFIX) as tmp, _owned(Path(tmp)):
        out = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", WORKER, "--goldens", str(project.goldens), "--configs", str(project.configs),
               "--testdata", str(project.testdata), "--hardware-class", key.hardware_class, "--model", key.model,
               "--dtype", key.dtype, "--scenario", key.scenario, "--backend", backend,
               *(arg for spec in layouts for arg in ("--layout", spec)), "--out", str(out), "--timeout", str(timeout_s),
               *(["--isolate"] if isolate else [])]
        env = dict(os.environ)
        # The ranks import this very veosnap, and the backend's and layouts' modules wherever the parent found them.
        paths = [str(IMPORT_ROOT), *(p for p in sys.path if p and Path(p).is_dir())]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.setdefault("OMP_NUM_THREADS", "1")
        # torchrun's and the ranks' own temp files go inside OUT, so they go with it however the run ends;
        # inductor's compile cache stays where torch keeps it by default, shared between runs.
        (out / "tmp").mkdir()
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"))
        env["TMPDIR"] = str(out / "tmp")
        failure = _run_group(cmd, env, out, timeout_s)
        outcomes = []
        ended_in = ""  # the first layout without a result is where the run ended; later ones never ran
        for index, spec in enumerate(layouts):
            result, skip = out / f"{index}.safetensors", out / f"{index}.skip"
            if skip.is_file():
                outcomes.append(Outcome(skipped=skip.read_text(encoding="utf-8").strip()))
            elif result.is_file():
                outcomes.append(Outcome(result=read_result(result)))
            elif ended_in:
                outcomes.append(Outcome(error=f"not run: the ranks ended in layout {ended_in} before it"))
            else:
                ended_in = spec
                outcomes.append(Outcome(error=failure or "the worker wrote no result"))
        return outcomes


def _user() -> str:
    """The user name as torch's default inductor cache directory spells it."""
    import getpass

    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        return "unknown"


class _owned:
    """Hold OUT's lock while the run lives, so `remove_stale` never takes a live run's directory."""

    def __init__(self, out: Path) -> None:
        self.out, self.fd = out, None

    def __enter__(self) -> None:
        if fcntl is not None:
            self.fd = os.open(self.out / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove OUT directories that killed parents left under `root` (default: the temp directory).

    Only those whose lock nobody holds and that are older than `STALE_S` (a new run may not have locked
    its own yet); returns what it removed.
    """
    if fcntl is None:
        return []
    root = Path(root or tempfile.gettempdir())
    removed = []
    now = time.time()
    for path in sorted(root.glob(f"{PREFIX}*")):
        try:
            if not path.is_dir() or path.is_symlink() or now - path.stat().st_mtime < STALE_S:
                continue
            fd = os.open(path / LOCK, os.O_RDWR) if (path / LOCK).exists() else None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its parent lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


# Set to 1: what the ranks printed (stdout and stderr, torchrun's own lines) is copied to this process's stderr
# when the group ends, as an in-process candidate's output would be.
RANK_STDERR = "VEOSNAP_RANK_STDERR"


def _launch(cmd: list[str]) -> list[str]:
    """`cmd`, started so that it ends when this process dies (Linux: a parent-death signal)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd[1:]]


def _run_group(cmd: list[str], env: dict, out: Path, timeout_s: float) -> str:
    """Run torchrun in its own process group; '' when it succeeded, else why it did not (one line)."""
    log = out / "torchrun.log"
    started = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(_launch(cmd), stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end(proc)
    text = log.read_text(encoding="utf-8", errors="replace")
    if os.environ.get(RANK_STDERR) == "1":  # the ranks' own output on this process's stderr (a CI's console)
        sys.stderr.write(text)
        sys.stderr.flush()
    errors = {int(p.stem.removeprefix("error-rank")): p.read_text(encoding="utf-8").strip().splitlines()[0]
              for p in sorted(out.glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime_ns)}
    if code is None:
        first = next(iter(errors.values()), "")
        return (f"timed out after {timeout_s:g} s (process group killed)" + (f"; {first}" if first else "")
                + where_ranks_were(out))
    if code == 0:
        return ""
    return explain_failure(text, errors, code, time.monotonic() - started) + where_ranks_were(out)


def where_ranks_were(out: Path) -> str:
    """'; ranks stopped in different blocks: rank 0 in forward of ..., rank 1 in ...' when the ranks' last
    blocks differ (a collective some rank never joined), else ''."""
    places = {}
    for path in out.glob(f"{PROGRESS}*.txt"):
        try:
            places[int(path.stem.removeprefix(PROGRESS))] = path.read_text(encoding="utf-8").strip()
        except (OSError, ValueError):
            continue
    if len(set(places.values())) < 2:
        return ""
    listed = ", ".join(f"rank {rank} in {where}" for rank, where in sorted(places.items()))
    return (f"; the ranks stopped in different blocks ({listed}): a collective one rank never joined, as when "
            "an encoder runs on some ranks only")


# torchrun's failure summary: a "rank : N (local_rank: M)" line followed by its "exitcode : S" line.
_RANK_EXIT_RE = re.compile(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
# How torchrun stops the ranks still running once one has failed: these are consequences, never causes.
_STOPPED = {-int(signal.SIGTERM), -int(signal.SIGKILL)}


def explain_failure(log: str, errors: dict[int, str], code: int, seconds: float) -> str:
    """One line saying why a torchrun failed, from its log and the ranks' own error lines (in the order
    they were written): the rank that failed first is blamed, not a rank torchrun stopped afterwards."""
    exits = {int(m.group(1)): int(m.group(2)) for m in _RANK_EXIT_RE.finditer(log)}
    root = _RANK_EXIT_RE.search(log, max(log.find("Root Cause"), 0))
    root_rank = int(root.group(1)) if root else None
    # A rank that died by itself without writing why (killed, crashed, exited) is the cause; the others'
    # errors (a collective whose peer vanished) are its consequences, whatever order torchrun saw them in.
    silent = sorted((rank for rank, status in exits.items() if rank not in errors and status not in _STOPPED),
                    key=lambda r: (r != root_rank, r))
    if silent:
        rank = silent[0]
        return f"rank {rank} exited with status {exits[rank]} after {seconds:.0f} s"
    if errors:  # every rank that failed by itself said why: the first to write failed first
        return next(iter(errors.values()))
    if root:
        return f"rank {root_rank} exited with status {root.group(2)} after {seconds:.0f} s"
    tail = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
    return f"torchrun exited with status {code}: {tail[0][:300]}"


def _end(proc: subprocess.Popen) -> None:
    """Nothing of a torchrun outlives the check, ranks stuck in a collective included.

    torchrun puts each rank in its own session, so killing its group is not enough: SIGTERM lets it end
    its ranks; SIGKILL follows, and ranks whose torchrun is gone die by their parent-death signal.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=END_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def write_result(path: Path, result: LayoutResult) -> None:
    """A rank 0 result file: the capture's tensors and routes, the replayed run's under `replayed.`, and
    each sketched tensor's reduction (small: groups x width) under `sketch.`."""
    from safetensors.torch import save_file

    tensors, sketches = {}, {}
    for prefix, capture in (("", result.capture), (REPLAYED, result.replayed)):
        if capture is None:
            continue
        tensors.update({prefix + n: t.contiguous().clone() for n, t in capture.all_tensors().items()})
        for name, kept in capture.sketches.items():
            sketches[prefix + name] = _sketch_meta(kept)
            if isinstance(kept, CandidateSketch):
                parts = {"values": kept.values, "counts": kept.counts, "off_support": kept.off_support,
                         "nonfinite": kept.nonfinite}
                tensors.update({f"{SKETCH}{prefix}{name}.{part}": t.detach().cpu().contiguous().clone()
                                for part, t in parts.items() if t is not None})
    meta = {"notes": result.notes, "forward_only": result.forward_only, "backward": result.capture.backward,
            "sketches": sketches, "absent": result.capture.absent,
            "replayed_absent": result.replayed.absent if result.replayed else {},
            "not_isolated": result.not_isolated, "isolated": None}
    if result.isolated is not None:
        reference, candidate = result.isolated
        for which, units in (("own", reference.own), ("exact", reference.exact), ("candidate", candidate)):
            tensors.update({f"{ISOLATED}{which}.{layer}.{kind}": rows.contiguous().clone()
                            for (layer, kind), rows in units.outputs.items()})
        meta["isolated"] = {"heads": reference.heads, "experts": {str(k): v for k, v in reference.experts.items()},
                            "missing": reference.own.missing}
    save_file(tensors, str(path), metadata={"veosnap": json.dumps(meta)})


def _sketch_meta(kept: object) -> dict:
    if isinstance(kept, SketchProblem):
        return {"problem": kept.problem}
    return {}


def _read_sketches(meta: dict, tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, info in meta.items():
        if not key.startswith(prefix) or (not prefix and key.startswith(REPLAYED)):
            continue
        name = key[len(prefix):]
        if "problem" in info:
            out[name] = SketchProblem(info["problem"])
            continue
        part = lambda p: tensors.get(f"{SKETCH}{key}.{p}")  # noqa: E731
        out[name] = CandidateSketch(values=part("values"), counts=part("counts"), off_support=part("off_support"),
                                    nonfinite=part("nonfinite"))
    return out


def read_result(path: Path) -> LayoutResult:
    """What `write_result` wrote."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads((fh.metadata() or {})["veosnap"])
    tensors: dict[str, torch.Tensor] = load_file(str(path))
    main = {n: t for n, t in tensors.items() if not n.startswith((REPLAYED, SKETCH, ISOLATED))}
    replayed = {n[len(REPLAYED):]: t for n, t in tensors.items() if n.startswith(REPLAYED)}
    backward = meta["backward"]
    capture = Capture.from_tensors(main, backward, meta.get("absent"))
    capture.sketches = _read_sketches(meta["sketches"], tensors, "")
    again = None
    if replayed:
        again = Capture.from_tensors(replayed, backward, meta.get("replayed_absent"))
        again.sketches = _read_sketches(meta["sketches"], tensors, REPLAYED)
    return LayoutResult(capture, again, notes=meta["notes"], forward_only=meta["forward_only"],
                        isolated=_read_isolated(meta.get("isolated"), tensors),
                        not_isolated=meta.get("not_isolated", ""))


def _read_isolated(meta: dict | None, tensors: dict[str, torch.Tensor]
                   ) -> tuple[isolation.Reference, isolation.Units] | None:
    if meta is None:
        return None
    units = {which: isolation.Units() for which in ("own", "exact", "candidate")}
    for name, rows in tensors.items():
        if name.startswith(ISOLATED):
            which, layer, kind = name[len(ISOLATED):].split(".", 2)
            units[which].outputs[(int(layer), kind)] = rows
    units["own"].missing = list(meta["missing"])
    reference = isolation.Reference(units["own"], units["exact"], meta["heads"],
                                    {int(k): v for k, v in meta["experts"].items()})
    return reference, units["candidate"]
