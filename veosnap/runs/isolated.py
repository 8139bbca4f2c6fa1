"""Recording in a fresh interpreter: the reference from a process no candidate (and no test) has touched.

A process in which candidates ran, or a pytest session whose tests may patch anything, cannot prove that
transformers' classes and torch's functions are the originals. `FreshRecorder` records there instead, in
one long-lived child (`python -m veosnap.runs.isolated_child`) that imports only veosnap, torch and
transformers: it reads one JSON request per line on stdin, writes the golden's bytes to the file the
request names, and answers one JSON line on its own channel (`{"ok": true}` or `{"error": "<one line>"}`).
Asked to judge, the child also runs the recorder's fragility check there (`record.judge_variants`): the variants
must run against the same pristine reference the golden came from, not in the touched parent. Given a golden's
file instead of a key to record (`certify`), it plants the canaries against that golden there (`record.certified`)
and writes it back with its certified sensitivity.

`record_judged` keeps one such child per process and reuses it for the next recording while it can vouch for
itself: it says after each request whether it is still pristine (veosnap's shipped variants leave it so unless
they left patches behind), and it is reused only under the environment it was started with; each request works
in the caller's current directory, as a child started for it would. A fresh interpreter
costs seconds (importing torch and transformers): a refresh of many goldens after a check, or a test session that
records after candidates ran, paid that once per golden.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..about import IMPORT_ROOT
from ..errors import VeosnapError
from ..golden import codec
from ..golden.codec import Golden
from ..golden.key import GoldenKey
from ..reference.zoo import Project
from .verdict import Judgment

CHILD = "veosnap.runs.isolated_child"  # the child's module (it imports the recorder, which imports this one)


class FreshRecorder:
    """Golden bytes recorded in a fresh interpreter, one child per recorder (started on first use)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._log: Path | None = None
        self._env: dict[str, str] = {}  # the environment the child was started with
        self.pristine = True  # what the child said of itself after its last request

    def reusable(self) -> bool:
        """Whether the running child may record next: alive, pristine by its own account, and started under
        this process's current environment (a recording reads environment variables)."""
        return (self._proc is not None and self._proc.poll() is None and self.pristine
                and self._env == _environment())

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._dir = self._dir or tempfile.TemporaryDirectory(prefix="veosnap-record-")
            self._log = Path(self._dir.name) / "recorder.log"
            self._env, self.pristine = _environment(), True
            env = dict(os.environ)
            paths = [str(IMPORT_ROOT)]
            env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
            with open(self._log, "ab") as log:
                self._proc = subprocess.Popen([sys.executable, "-m", CHILD], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        return self._proc

    def record(self, project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False,
               sketch: str = "auto") -> bytes:
        """The golden for `key` as the reference records it in a fresh process (its file bytes)."""
        return self.record_judged(project, key, seed, allow_near_ties, judge=False, sketch=sketch)[0]

    def certify(self, project: Project, golden: Golden) -> dict[str, float] | None:
        """`golden`'s certified sensitivity, its canaries run in the fresh process (`record.certified`)."""
        assert self._start() is not None and self._dir is not None
        given = Path(self._dir.name) / "given.bin"
        given.write_bytes(codec.encode(golden))
        data, _ = self.record_judged(project, golden.manifest.key, judge=False, given=given)
        return codec.decode(data, f"the certified {golden.manifest.key}").manifest.reference.sensitivity

    def record_judged(self, project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False,
                      judge: bool = True, sketch: str = "auto", given: Path | None = None
                      ) -> tuple[bytes, list[Judgment]]:
        """The golden's bytes and, if `judge`, the judgments of the variants run in that same process.
        `given`: a golden's file to certify there instead of recording one."""
        proc = self._start()
        assert self._dir is not None and proc.stdin is not None and proc.stdout is not None
        out = Path(self._dir.name) / "golden.bin"
        request = {"goldens": str(project.goldens), "configs": str(project.configs), "testdata": str(project.testdata),
                   "hardware_class": project.hardware_class, "key": str(key), "seed": seed,
                   "allow_near_ties": allow_near_ties, "sketch": sketch, "out": str(out), "judge": judge,
                   "given": str(given) if given else None,
                   "cwd": os.getcwd()}  # a project's relative paths are the caller's, and so are its messages
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            answer = ""
        if not answer:
            raise VeosnapError(f"{key}: the fresh recording process ended without an answer ({self._last_log_line()})")
        reply = json.loads(answer)
        self.pristine = bool(reply.get("pristine", False))
        if "error" in reply:
            raise VeosnapError(reply["error"])
        return out.read_bytes(), [Judgment(**j) for j in reply.get("judgments", [])]

    def _last_log_line(self) -> str:
        try:
            lines = [line for line in self._log.read_text(errors="replace").splitlines() if line.strip()]
        except (OSError, AttributeError):
            lines = []
        return lines[-1][:300] if lines else "no output"

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout:
                self._proc.stdout.close()
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> FreshRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: FreshRecorder | None = None


def _environment() -> dict[str, str]:
    """The environment a recording may read: all of it but pytest's name of the running test, which changes
    with every test of a session and means nothing to a recording."""
    return {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}


def _shared() -> FreshRecorder:
    global _SHARED
    if _SHARED is None or not _SHARED.reusable():
        if _SHARED is not None:
            _SHARED.close()
        else:
            atexit.register(lambda: _SHARED is not None and _SHARED.close())
        _SHARED = FreshRecorder()
    return _SHARED


def record_judged(project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False,
                  sketch: str = "auto") -> tuple[bytes, list[Judgment]]:
    """One golden recorded in a fresh process, and the fragility check's judgments from that process (this
    process's one child, reused while it stays pristine: see the module's docstring)."""
    return _shared().record_judged(project, key, seed, allow_near_ties, sketch=sketch)


def certify_fresh(project: Project, golden: Golden) -> dict[str, float] | None:
    """`golden`'s certified sensitivity, its canaries run in this process's fresh one (`record.certified`)."""
    return _shared().certify(project, golden)
