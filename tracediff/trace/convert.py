"""Lossless conversion between the physical formats, record by record."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracediff.errors import InputError
from tracediff.trace.reader import Trace, open_trace
from tracediff.trace.schema import FORMAT_VERSION
from tracediff.trace.writer import TraceWriter, open_writer

BATCH_BYTES = 64 << 20


def convert(src: str | Path, dst: str | Path, format: str | None = None) -> list[Path]:
    """Write every record, the token table, the metadata and the end-of-run metadata of ``src``
    into ``dst``. A trace split over rank files becomes one output per rank (``dst`` stem + ``.rankN``).

    Raises TraceError for an unreadable ``src`` and InputError for a ``dst`` that cannot be written
    (the CLI prints either as one line).
    """
    dst = Path(dst)
    with open_trace(src) as trace:
        outputs = []
        for part, file in enumerate(trace.files):
            out = dst if len(trace.files) == 1 else dst.with_name(f"{dst.stem}.rank{part}{dst.suffix}")
            meta = {**file.meta, "format_version": FORMAT_VERSION}  # what the output is written in
            _copy_part(trace, part, _open_output(out, meta, format))
            outputs.append(out)
        return outputs


def _open_output(path: Path, meta: dict, format: str | None) -> TraceWriter:
    if not path.parent.is_dir():
        raise InputError(path, f"output directory {path.parent} does not exist")
    try:
        return open_writer(path, meta, format)
    except ValueError as exc:
        raise InputError(path, str(exc).split(": ", 1)[-1]) from None
    except OSError as exc:
        raise InputError(path, f"cannot write: {exc.strerror or exc}") from None


def _copy_part(trace: Trace, part: int, writer: TraceWriter) -> None:
    batch, size = [], 0
    for i in np.flatnonzero(trace.index.part == part):
        record = trace.read(int(i))
        batch.append(record)
        size += record.nbytes
        if size >= BATCH_BYTES:
            writer.write(batch)
            batch, size = [], 0
    tokens = trace.tokens_record(part)
    writer.write(batch if tokens is None else [*batch, tokens])
    final = trace.files[part].final
    writer.close(final if final is not None else {"closed": False, "converted_from_incomplete": True})
