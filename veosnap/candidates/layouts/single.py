"""`single`: the golden's own layout, its padded batch in one process (the reference layout)."""

from __future__ import annotations

from .protocol import Layout


class Single(Layout):
    name = "single"
    description = "the golden's padded batch in one process (the reference layout)"
    checks_forward_only = True  # a forward-only backend is checked on the forward tensors here


LAYOUT = Single()
