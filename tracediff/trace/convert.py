"""Lossless conversion between the physical formats, record by record: every record, the token
table and both metadata, one output per rank file. Outputs follow ``trace/output.py``: never over
a file unless forced (never over the input), written beside the target and published whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tracediff.errors import InputError
from tracediff.trace.copies import check_copy_outputs, check_rewritten, output_paths, read_copy
from tracediff.trace.output import staged_outputs
from tracediff.trace.reader import Trace, open_trace
from tracediff.trace.schema import FORMAT_VERSION
from tracediff.trace.writer import TraceWriter, open_writer

BATCH_BYTES = 64 << 20


def convert(src: str | Path, dst: str | Path, format: str | None = None, force: bool = False,
            verify: bool = True) -> list[Path]:
    """Write every record, the token table, the metadata and the end-of-run metadata of ``src``
    into ``dst``. A trace split over rank files becomes one output per rank (``dst`` stem + ``.rankN``).
    An existing output is refused unless ``force`` (and then only a regular file that is none of the
    inputs is replaced); the outputs appear whole or not at all.

    Raises TraceError for an unreadable ``src`` and InputError for a ``dst`` that cannot be written
    (the CLI prints either as one line).
    """
    dst = Path(dst)
    with open_trace(src, verify=verify) as trace:
        outputs = output_paths(trace, dst)
        check_copy_outputs(dst, outputs, trace.paths, force, "conversion")
        with staged_outputs(outputs, trace.paths, force) as staging:
            for part, (file, out) in enumerate(zip(trace.files, outputs)):
                meta = {**file.meta, "format_version": FORMAT_VERSION}  # what the output is written in
                writer = _open_output(staging / out.name, out, meta, format)
                try:
                    _copy_part(trace, part, writer)
                except BaseException:  # a corrupt record, a full disk, Ctrl-C: the staged file goes
                    _abort(writer)
                    raise
        return outputs


def _open_output(path: Path, target: Path, meta: dict, format: str | None) -> TraceWriter:
    try:
        return open_writer(path, meta, format)
    except ValueError as exc:
        raise InputError(target, str(exc).split(": ", 1)[-1]) from None


def _abort(writer: TraceWriter) -> None:
    try:
        writer.abort()
    except Exception:
        pass


def _copy_part(trace: Trace, part: int, writer: TraceWriter) -> None:
    batch, size = [], 0
    for i in np.flatnonzero(trace.index.part == part):
        record = read_copy(trace, int(i))
        batch.append(record)
        size += record.nbytes
        if size >= BATCH_BYTES:
            writer.write(batch)
            batch, size = [], 0
    check_rewritten(trace, part)
    tokens = trace.tokens_record(part)
    writer.write(batch if tokens is None else [*batch, tokens])
    final = trace.files[part].final
    writer.close(final if final is not None else {"closed": False, "converted_from_incomplete": True})
