"""The one exception type users see: a one-line message, never a traceback."""

from __future__ import annotations


class VeosnapError(Exception):
    """A problem with the user's input (a file, a name, a flag) that ends a command with exit 2.

    The message is one line and names the file or thing at fault and the cause.
    """

    exit_code = 2


class GoldenError(VeosnapError):
    """A golden file that cannot be trusted: corrupt, truncated, mismatched or unsafe."""

    def __init__(self, path: object, cause: str) -> None:
        self.path = str(path)
        self.cause = cause
        super().__init__(f"{self.path}: {cause}")


class MissingGoldenError(VeosnapError):
    """No golden for the asked key; the message says how to record one."""
