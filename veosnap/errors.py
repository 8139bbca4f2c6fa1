"""The exceptions veosnap raises and recognizes, shared by every package.

`VeosnapError` and its kinds are the user's problem (a file, a name, a flag): one line, exit 2, never
a traceback. `Unsupported` is an extension's polite refusal (a backend or layout that does not apply
here): the check is reported as skipped with its reason. Anything else a candidate raises is the
candidate's failure, reported in one line by `describe`.
"""

from __future__ import annotations

import traceback


class VeosnapError(Exception):
    """A problem with the user's input (a file, a name, a flag) that ends a command with exit 2.

    The message is one line and names the file or thing at fault and the cause.
    """

    exit_code = 2


class GoldenError(VeosnapError):
    """A golden file that cannot be trusted: corrupt, truncated, mismatched or unsafe.

    `fix`, when given, is how to replace it (a clause naming a command); a caller that knows the project
    raises the error again with the project's flags in it, so the command runs as printed.
    """

    def __init__(self, path: object, cause: str, fix: str = "") -> None:
        self.path = str(path)
        self.problem, self.fix = cause, fix
        self.cause = f"{cause}; {fix}" if fix else cause
        super().__init__(f"{self.path}: {self.cause}")


class MissingGoldenError(VeosnapError):
    """No golden for the asked key; the message says how to record one."""


class Unsupported(Exception):
    """Raised by a backend or layout that does not apply to this model or machine; the check is skipped."""


class NothingToChange(Unsupported):
    """Raised by a backend that would change nothing on this model (an experts kernel on a dense model): alone
    its check is not applicable (`n/a`, never a pass that checked nothing); joined with `+` to backends that
    do change the model, the combination runs and its report says which part changed nothing."""


def describe(exc: BaseException) -> str:
    """An exception in one line, with where it was raised: `RuntimeError: boom (at file.py:12)`."""
    frames = traceback.extract_tb(exc.__traceback__)
    origin = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0] + origin
