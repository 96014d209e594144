"""Sizes as people write them (``1MB``, ``500k``), and sizes of what a bundle really wrote: the budget is
checked against the files on disk, never against an estimate. The rule: the directory's files
together are at most the budget, and with ``--zip`` the zip on its own is too (each is what you
attach: the files, or the zip)."""

from __future__ import annotations

import re
import zipfile
from fractions import Fraction
from pathlib import Path

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
        raise ValueError(f"a budget must be more than 0 bytes, got {text!r}")
    return size


def file_sizes(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> bytes on disk as ``stat`` says)."""
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file()}


def write_zip(directory: Path, dest: Path) -> int:
    """``directory`` as a zip (entries under the zip's own stem: ``DIR.zip`` unpacks to ``DIR/``,
    whatever path named the directory), returns its size."""
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in file_sizes(directory):
            zf.write(directory / name, f"{dest.stem}/{name}")
    return dest.stat().st_size


def kilo(size: int) -> int:
    """The smallest whole number of kB holding ``size`` bytes, in bytes (``245001`` -> ``246000``): a
    ``--budget`` to suggest."""
    return -(-size // 1000) * 1000


def human(size: int) -> str:
    """``1.2 MB``, ``830 kB``, ``512 B`` (powers of 1000, like the budget)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"
