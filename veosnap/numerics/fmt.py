"""How numbers read in reports: the one place an error, a bound, a ratio or a value is formatted.

Three significant digits for errors, bounds and ratios (`1.21e+05x`), four for a tensor's values, two
in a support matrix's cells; infinity reads `inf`; JSON gets `null` for what is not a finite number.
"""

from __future__ import annotations

import math


def num(x: float) -> str:
    """An error or a bound: `0.00528`, `1.15e-06`, `inf`."""
    return "inf" if math.isinf(x) else f"{x:.3g}"


def times(ratio: float) -> str:
    """A ratio to a bound, in a sentence: `4.58e+03x`, `inf x`."""
    return "inf x" if math.isinf(ratio) else f"{ratio:.3g}x"


def cell(ratio: float) -> str:
    """A ratio to a bound in a support matrix's cell: `0.13x`."""
    return f"{ratio:.2g}x"


def value(x: float, digits: int = 4) -> str:
    """A tensor element (the golden's or the candidate's)."""
    return f"{x:.{digits}g}"


def json_number(x: float) -> float | None:
    """`x` for a JSON document: None where it is not finite."""
    return None if math.isinf(x) or math.isnan(x) else x
