"""Sizes as people write them (``1MB``, ``500k``, ``2MiB``) and as tracediff prints them.

A bundle's ``--budget`` and the recorder's ``--queue-bytes`` take the same notation; powers of 1000
print as ``kB``/``MB``/``GB``.
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (k, M, G are powers of 1000; KiB, MiB, GiB
    of 1024). ValueError with a one-line reason."""
    m = SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS:
        raise ValueError(f"expected a size such as 1MB, 500k or 2MiB, got {text!r}")
    size = int(Fraction(m.group(1)) * UNITS[unit])  # exact: no float rounding of a long number
    if size <= 0:
        raise ValueError(f"a size must be more than 0 bytes, got {text!r}")
    return size


def human(size: int) -> str:
    """``1.2 MB``, ``830 kB``, ``512 B`` (powers of 1000, like the budget)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"
