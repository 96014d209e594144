"""Picks the physical writer for a path; both share one small interface."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

from tracediff.trace.arrow import ArrowWriter
from tracediff.trace.h5 import H5Writer
from tracediff.trace.schema import Record

SUFFIXES = {".h5": "h5", ".hdf5": "h5", ".arrow": "arrow", ".ipc": "arrow", ".feather": "arrow"}


class TraceWriter(Protocol):
    def write(self, records: Sequence[Record]) -> None:
        """Append records; they reach the OS (and survive a killed process) before this returns."""

    def sync(self) -> None:
        """fsync what was written."""

    def abort(self) -> None:
        """Release the file after a failed write, leaving it as last flushed."""

    def close(self, final: dict) -> None:
        """Write the end-of-run metadata and close; the file is then complete."""


def format_for(path: str | Path, format: str | None = None) -> str:
    if format is not None:
        if format not in ("h5", "arrow"):
            raise ValueError(f"unknown trace format {format!r}; use 'h5' or 'arrow'")
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: cannot tell the trace format from {suffix!r}; use .h5 or .arrow")
    return SUFFIXES[suffix]


def open_writer(path: str | Path, meta: dict, format: str | None = None,
                compression: str | None = None) -> TraceWriter:
    """A writer for ``path``; compression is off by default (hidden states barely compress:
    ~1.1-1.2x for more write time), 'gzip'/'lzf' for HDF5, 'lz4'/'zstd' for Arrow."""
    kind = format_for(path, format)
    writer = H5Writer if kind == "h5" else ArrowWriter
    return writer(path, meta, compression)
