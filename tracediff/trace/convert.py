"""Lossless conversion between the physical formats, record by record."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracediff.trace.reader import Trace, open_trace
from tracediff.trace.writer import TraceWriter, open_writer

BATCH_BYTES = 64 << 20


def convert(src: str | Path, dst: str | Path, format: str | None = None) -> list[Path]:
    """Write every record, the metadata and the end-of-run metadata of ``src`` into ``dst``.

    A trace split over rank files becomes one output per rank (``dst`` stem + ``.rankN``).
    """
    dst = Path(dst)
    with open_trace(src) as trace:
        outputs = []
        for part, file in enumerate(trace.files):
            out = dst if len(trace.files) == 1 else dst.with_name(f"{dst.stem}.rank{part}{dst.suffix}")
            _copy_part(trace, part, open_writer(out, file.meta, format))
            outputs.append(out)
        return outputs


def _copy_part(trace: Trace, part: int, writer: TraceWriter) -> None:
    batch, size = [], 0
    for i in np.flatnonzero(trace.index.part == part):
        record = trace.read(int(i))
        batch.append(record)
        size += record.nbytes
        if size >= BATCH_BYTES:
            writer.write(batch)
            batch, size = [], 0
    writer.write(batch)
    final = trace.files[part].final
    writer.close(final if final is not None else {"closed": False, "converted_from_incomplete": True})
