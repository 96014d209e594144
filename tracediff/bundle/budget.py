"""Sizes of what a bundle really wrote: the budget (``tracediff/sizes.py`` reads it) is checked
against the files on disk, never against an estimate. The rule: the directory's files
together are at most the budget, and with ``--zip`` the zip on its own is too (each is what you
attach: the files, or the zip)."""

from __future__ import annotations

import zipfile
from pathlib import Path


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
