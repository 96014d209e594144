"""``slice_trace``: a smaller trace holding the records and rows a selection keeps, still a valid trace
(metadata, contract, static records and the selected requests' whole token sequences copied), so that
``show``, ``compare`` and ``replay`` work on it as on the original. Bundles for bug reports are built
on it."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracediff.errors import InputError
from tracediff.trace.reader import Trace, open_trace
from tracediff.trace.schema import FORMAT_VERSION, Record, tokens_record
from tracediff.trace.writer import TraceWriter, format_for, open_writer

BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Span:
    """Integers ``start <= v < stop`` (half-open); a missing end is unbounded."""

    start: int | None = None
    stop: int | None = None

    @classmethod
    def parse(cls, text: str) -> Span:
        """``A:B``, ``A:``, ``:B`` or ``A`` (just A); ValueError with a one-line reason."""
        text = text.strip()
        head, sep, tail = text.partition(":")
        try:
            start = int(head) if head.strip() else None
            stop = int(tail) if tail.strip() else None
        except ValueError:
            raise ValueError(f"expected A:B (integers, half-open), got {text!r}") from None
        if not sep:
            if start is None:
                raise ValueError("expected A:B (integers, half-open), got an empty value")
            return cls(start, start + 1)
        if start is not None and stop is not None and stop <= start:
            raise ValueError(f"{text!r} is empty: B must be greater than A")
        return cls(start, stop)

    def mask(self, values: np.ndarray) -> np.ndarray:
        keep = np.ones(len(values), dtype=bool)
        if self.start is not None:
            keep &= values >= self.start
        if self.stop is not None:
            keep &= values < self.stop
        return keep

    def __str__(self) -> str:
        return f"{'' if self.start is None else self.start}:{'' if self.stop is None else self.stop}"


def parse_spans(values: list[str]) -> tuple[Span, ...] | None:
    """Spans from command-line values, each a comma-separated list of ``N`` / ``A:B``; None for none."""
    parts = [part for value in values for part in value.split(",") if part.strip()]
    return tuple(Span.parse(part) for part in parts) if parts else None


def parse_list(values: list[str]) -> tuple[str, ...] | None:
    """Command-line values, each a comma-separated list; None for none."""
    parts = [part.strip() for value in values for part in value.split(",") if part.strip()]
    return tuple(parts) if parts else None


def spans_mask(spans: tuple[Span, ...] | None, values: np.ndarray) -> np.ndarray:
    """Values inside any of the spans (every value when ``spans`` is None)."""
    if spans is None:
        return np.ones(len(values), dtype=bool)
    keep = np.zeros(len(values), dtype=bool)
    for span in spans:
        keep |= span.mask(values)
    return keep


@dataclass(frozen=True)
class Selection:
    """What a slice keeps; None keeps everything on that axis. ``names``, ``steps`` and ``depths``
    choose records, ``requests`` and ``positions`` choose rows inside them (a record left with no
    row is dropped). Static records (``draft.d2t``, weights) are kept when their name is selected,
    whatever the other axes say: they have no rows, and compare needs them whole."""

    names: tuple[str, ...] | None = None  # fnmatch globs
    requests: tuple[str, ...] | None = None
    positions: Span | None = None  # half-open; a draft row at depth d > 0 is keyed by its anchor's position
    steps: tuple[Span, ...] | None = None
    depths: tuple[Span, ...] | None = None

    def to_dict(self) -> dict:
        """As stored in the slice's run metadata (JSON)."""
        def spans(value: tuple[Span, ...] | None) -> list[str] | None:
            return None if value is None else [str(s) for s in value]

        return {"names": None if self.names is None else list(self.names),
                "requests": None if self.requests is None else list(self.requests),
                "positions": None if self.positions is None else str(self.positions),
                "steps": spans(self.steps), "depths": spans(self.depths)}

    def name_kept(self, name: str) -> bool:
        return self.names is None or any(fnmatch.fnmatchcase(name, glob) for glob in self.names)


@dataclass
class SliceResult:
    """What a slice wrote: one file per rank file of the source."""

    paths: list[Path]
    records: int  # tensor records written (static ones included)
    rows: int
    tokens: int  # token table entries written
    names: list[str]  # tensor names written, in the source's execution order
    bytes: int  # size of the written files on disk


def slice_trace(src: str | Path | Trace, dst: str | Path, selection: Selection) -> SliceResult:
    """Write what ``selection`` keeps of ``src`` into ``dst`` (format by its suffix). A trace split
    over rank files is sliced per rank: ``dst`` stem + ``.rankR`` for each (readable together as
    ``dst``, like the original). The source is only read; ``dst`` may not be one of its files.

    Raises InputError (TraceError for the source) with one line for the CLI."""
    dst = Path(dst)
    try:
        format_for(dst)
    except ValueError as exc:
        raise InputError(dst, str(exc).split(": ", 1)[-1]) from None
    if isinstance(src, Trace):
        return _slice(src, dst, selection)
    with open_trace(src) as trace:
        return _slice(trace, dst, selection)


def _output_paths(trace: Trace, dst: Path) -> list[Path]:
    """One output per rank file of ``trace``."""
    if len(trace.files) == 1:
        return [dst]
    return [dst.with_name(f"{dst.stem}.rank{part}{dst.suffix}") for part in range(len(trace.files))]


def _slice(trace: Trace, dst: Path, selection: Selection) -> SliceResult:
    outputs = _output_paths(trace, dst)
    for out in outputs:
        _check_output(out, trace.paths)
    records = rows = tokens = 0
    written: set[str] = set()
    for part, (file, out) in enumerate(zip(trace.files, outputs)):
        meta = {**file.meta, "format_version": FORMAT_VERSION,
                "sliced_from": {"path": str(file.path), "selection": selection.to_dict()}}
        writer = _open_output(out, meta)
        try:
            counts = _copy_part(trace, part, selection, writer, written)
        except BaseException:
            writer.abort()
            raise
        records, rows, tokens = records + counts[0], rows + counts[1], tokens + counts[2]
    return SliceResult(paths=outputs, records=records, rows=rows, tokens=tokens,
                       names=[n for n in trace.names() if n in written],
                       bytes=sum(p.stat().st_size for p in outputs))


def _check_output(out: Path, sources: list[Path]) -> None:
    if not out.parent.is_dir():
        raise InputError(out, f"output directory {out.parent} does not exist")
    if out.exists() and any(out.resolve() == s.resolve() or _same_file(out, s) for s in sources):
        raise InputError(out, "output would overwrite the input")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _open_output(path: Path, meta: dict) -> TraceWriter:
    try:
        return open_writer(path, meta)
    except ValueError as exc:
        raise InputError(path, str(exc).split(": ", 1)[-1]) from None
    except OSError as exc:
        raise InputError(path, f"cannot write: {exc.strerror or exc}") from None


def _plan(trace: Trace, hits: np.ndarray, selection: Selection) -> list[tuple[int, np.ndarray | None]]:
    """(index position, rows kept or None for all) of each record the selection keeps, in ``hits``
    order; key columns only (one bulk read), no tensor data."""
    idx = trace.index
    names = {n: selection.name_kept(n) for n in set(idx.name[hits].tolist())}
    named = hits[np.fromiter((names[n] for n in idx.name[hits]), dtype=bool, count=len(hits))]
    static = idx.static[named]
    rowed = named[~static]
    rowed = rowed[spans_mask(selection.steps, idx.step[rowed])
                  & spans_mask(selection.depths, idx.depth[rowed])]
    plan: dict[int, np.ndarray | None] = {int(i): None for i in named[static]}
    if selection.requests is None and selection.positions is None:
        plan.update({int(i): None for i in rowed})
    elif len(rowed):
        request, position, _ = trace.key_columns(rowed)
        keep = np.ones(len(position), dtype=bool)
        if selection.requests is not None:
            keep &= np.isin(request.astype(str), np.asarray(selection.requests, dtype=str))
        if selection.positions is not None:
            keep &= selection.positions.mask(position)
        bounds = np.cumsum(idx.n_rows[rowed])
        for i, rows in zip(rowed.tolist(), np.split(keep, bounds[:-1])):
            if rows.all():
                plan[i] = None
            elif rows.any():
                plan[i] = np.flatnonzero(rows)
    return [(int(i), plan[int(i)]) for i in hits if int(i) in plan]


def _subset(record: Record, rows: np.ndarray | None) -> Record:
    if rows is None:
        return record
    record.data = record.data[rows]
    record.request, record.position, record.token_id = (record.request[rows], record.position[rows],
                                                        record.token_id[rows])
    return record


def _copy_part(trace: Trace, part: int, selection: Selection, writer: TraceWriter,
               written: set[str]) -> tuple[int, int, int]:
    """Write one rank file's kept records, then its token table entries of the kept requests; close
    with the source's final metadata, its counts made the slice's. Returns (records, rows, tokens)
    and adds the names written to ``written``."""
    plan = _plan(trace, np.flatnonzero(trace.index.part == part), selection)
    batch: list[Record] = []
    size = records = rows = data_bytes = 0
    for i, keep in plan:
        record = _subset(trace.read(i), keep)
        batch.append(record)
        written.add(record.name)
        size += record.nbytes
        records, rows, data_bytes = records + 1, rows + record.n_rows, data_bytes + record.nbytes
        if size >= BATCH_BYTES:
            writer.write(batch)
            batch, size = [], 0
    request, position, token_id = trace.token_keys(part)
    if selection.requests is not None and len(position):
        keep = np.isin(request.astype(str), np.asarray(selection.requests, dtype=str))
        request, position, token_id = request[keep], position[keep], token_id[keep]
    if len(position):
        batch.append(tokens_record(request, position, token_id,
                                   rank=int(trace.files[part].meta.get("rank", 0))))
    writer.write(batch)
    source_final = trace.files[part].final
    final = dict(source_final) if source_final is not None else {"closed": False,
                                                                 "sliced_from_incomplete": True}
    final.update(records=records, bytes=data_bytes, tokens=int(len(position)))
    writer.close(final)
    return records, rows, int(len(position))
