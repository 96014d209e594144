"""Picks the physical writer for a path through the format registry (trace/storage.py)."""

from __future__ import annotations

from pathlib import Path

from tracediff.trace.storage import TraceWriter, by_name, by_suffix

__all__ = ["TraceWriter", "format_for", "open_writer"]


def format_for(path: str | Path, format: str | None = None) -> str:
    """The format's name: ``format`` if given and known, else the one the path's suffix names.
    ValueError when neither says."""
    return by_name(format).name if format is not None else by_suffix(path).name


def open_writer(path: str | Path, meta: dict, format: str | None = None,
                compression: str | None = None) -> TraceWriter:
    """A writer for ``path``; compression is off by default (hidden states barely compress:
    ~1.1-1.2x for more write time), 'gzip'/'lzf' for HDF5, 'lz4'/'zstd' for Arrow."""
    return by_name(format_for(path, format)).writer(Path(path), meta, compression)
