"""``slice_trace``: a smaller trace holding the records and rows a selection keeps, still a valid trace
(metadata, contract, static records and the selected requests' whole token sequences copied), so that
``show``, ``compare`` and ``replay`` work on it as on the original. Bundles for bug reports are built
on it."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tracediff.errors import InputError
from tracediff.trace.copies import check_copy_outputs, check_rewritten, output_paths, read_copy
from tracediff.trace.output import staged_outputs
from tracediff.trace.reader import Trace, open_trace
from tracediff.trace.schema import FORMAT_VERSION, Record, tokens_record
from tracediff.trace.writer import TraceWriter, format_for, open_writer

BATCH_BYTES = 64 << 20
Keys = tuple[np.ndarray, np.ndarray, np.ndarray]  # (request, position, token_id) of token table entries


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
    """Command-line values of a repeated option, each one name or request exactly as given (never
    split: a request id or a tensor name may hold a comma); None for none."""
    return tuple(values) if values else None


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
    positions: tuple[Span, ...] | None = None  # half-open; a draft row at depth d > 0: its anchor's position
    steps: tuple[Span, ...] | None = None
    depths: tuple[Span, ...] | None = None

    def to_dict(self) -> dict:
        """As stored in the slice's run metadata (JSON)."""
        def spans(value: tuple[Span, ...] | None) -> list[str] | None:
            return None if value is None else [str(s) for s in value]

        return {"names": None if self.names is None else list(self.names),
                "requests": None if self.requests is None else list(self.requests),
                "positions": spans(self.positions), "steps": spans(self.steps), "depths": spans(self.depths)}

    def name_kept(self, name: str) -> bool:
        return self.names is None or any(fnmatch.fnmatchcase(name, glob) for glob in self.names)


def count(n: int, noun: str) -> str:
    """``1 record``, ``2 records``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class SlicePart:
    """What one output file (one rank file of the source) holds."""

    path: Path
    records: int  # tensor records written (static ones included)
    rows: int
    tokens: int  # token table entries written
    names: list[str]  # tensor names written, in the source's execution order
    part: int = 0  # the source's rank file it slices (its place in the source's files)

    def describe(self) -> str:
        """``2 tensors, 1 row, 12 request tokens``."""
        return f"{count(len(self.names), 'tensor')}, {count(self.rows, 'row')}, " \
               f"{count(self.tokens, 'request token')}"


@dataclass
class SliceResult:
    """What a slice wrote: one file per rank file of the source, and what the selection asked for
    that the source does not hold (the CLI names it: a typo is not an empty slice)."""

    paths: list[Path]
    records: int  # tensor records written (static ones included)
    rows: int
    tokens: int  # token table entries written
    names: list[str]  # tensor names written, in the source's execution order
    bytes: int  # size of the written files on disk
    parts: list[SlicePart] = field(default_factory=list)  # per output file, in ``paths`` order
    empty: list[Path] = field(default_factory=list)  # rank outputs not written: they would hold nothing
    unmatched_names: list[str] = field(default_factory=list)  # globs that match no tensor of the source
    unmatched_requests: list[str] = field(default_factory=list)  # requests no kept record or token holds

    def describe(self) -> str:
        """``1 record, 4 rows, 4 request tokens (21167 bytes)``."""
        return f"{count(self.records, 'record')}, {count(self.rows, 'row')}, " \
               f"{count(self.tokens, 'request token')} ({count(self.bytes, 'byte')})"


def _previous(meta: dict) -> dict:
    """A slice of a slice keeps its source's ``sliced_from`` as ``previous``: what each selection
    left out (docs/FORMAT.md), so that none of it counts as missing."""
    return {"previous": meta["sliced_from"]} if isinstance(meta.get("sliced_from"), dict) else {}


def slice_trace(src: str | Path | Trace, dst: str | Path, selection: Selection,
                force: bool = False, verify: bool = True) -> SliceResult:
    """Write what ``selection`` keeps of ``src`` into ``dst`` (format by its suffix). A trace split
    over rank files is sliced per rank: ``dst`` stem + ``.rankR`` for each (readable together as
    ``dst``, like the original); a rank file the selection keeps nothing of (no record, no token) is
    not written (``empty`` names it), unless no rank file keeps anything. The source is only read;
    ``dst`` may not be one of its files, nor join an existing trace's rank files; an existing output
    is refused unless ``force`` (then only a regular file is replaced). The outputs are written beside
    their targets and published whole (``trace/output.py``): a failure leaves none of them.

    Raises InputError (TraceError for the source) with one line for the CLI."""
    dst = Path(dst)
    try:
        format_for(dst)
    except ValueError as exc:
        raise InputError(dst, str(exc).split(": ", 1)[-1]) from None
    if isinstance(src, Trace):
        return _slice(src, dst, selection, force)
    with open_trace(src, verify=verify) as trace:
        return _slice(trace, dst, selection, force)


def _slice(trace: Trace, dst: Path, selection: Selection, force: bool) -> SliceResult:
    outputs = output_paths(trace, dst)
    check_copy_outputs(dst, outputs, trace.paths, force, "slice")
    plans = [_plan(trace, np.flatnonzero(trace.index.part == k), selection) for k in range(len(outputs))]
    tokens = [_tokens(trace, part, selection) for part in range(len(outputs))]
    held = [bool(plan[0]) or bool(len(kept[1])) for plan, kept in zip(plans, tokens)]
    written = [k for k in range(len(outputs)) if held[k]] or [0]  # an empty slice is still one valid trace
    parts: list[SlicePart] = []
    with staged_outputs([outputs[k] for k in written], trace.paths, force) as staging:
        for part in written:
            file, out = trace.files[part], outputs[part]
            meta = {**file.meta, "format_version": FORMAT_VERSION,
                    "sliced_from": {"path": str(file.path), "selection": selection.to_dict(),
                                    **_previous(file.meta)}}
            writer = _open_output(staging / out.name, out, meta)
            try:
                parts.append(_copy_part(trace, part, plans[part][0], tokens[part], writer, out))
            except BaseException:  # a corrupt record, a full disk, Ctrl-C: no partial slice left
                try:
                    writer.abort()
                except Exception:
                    pass
                raise
        size = sum((staging / outputs[k].name).stat().st_size for k in written)
    seen: set[str] = set()
    if selection.requests is not None:  # the requests named that a kept row or token entry holds
        for plan, kept in zip(plans, tokens):
            seen |= plan[1] | set(np.unique(kept[0].astype(str)).tolist())
    names = {n for p in parts for n in p.names}
    every = trace.names()
    paths = [outputs[k] for k in written]
    return SliceResult(paths=paths, records=sum(p.records for p in parts), rows=sum(p.rows for p in parts),
                       tokens=sum(p.tokens for p in parts), names=[n for n in every if n in names],
                       bytes=size, parts=parts,
                       empty=[out for k, out in enumerate(outputs) if k not in written],
                       unmatched_names=[g for g in selection.names or ()
                                        if not any(fnmatch.fnmatchcase(n, g) for n in every)],
                       unmatched_requests=[r for r in selection.requests or () if r not in seen])


def _open_output(path: Path, target: Path, meta: dict) -> TraceWriter:
    try:
        return open_writer(path, meta)
    except ValueError as exc:
        raise InputError(target, str(exc).split(": ", 1)[-1]) from None


def planned_bytes(trace: Trace, selection: Selection) -> int:
    """Tensor bytes a slice of ``trace`` would hold: a lower bound of its size on disk (slices are
    written uncompressed), known from the key columns alone, before any tensor byte is read."""
    idx, total = trace.index, 0
    for part in range(len(trace.files)):
        for i, rows in _plan(trace, np.flatnonzero(idx.part == part), selection)[0]:
            whole = int(idx.nbytes[i])
            total += whole if rows is None else whole // max(1, int(idx.n_rows[i])) * len(rows)
    return total


def _plan(trace: Trace, hits: np.ndarray,
          selection: Selection) -> tuple[list[tuple[int, np.ndarray | None]], set[str]]:
    """(index position, rows kept or None for all) of each record the selection keeps, in ``hits``
    order, and the selection's requests that rows of the kept names hold; key columns only (one
    bulk read), no tensor data."""
    idx = trace.index
    names = {n: selection.name_kept(n) for n in set(idx.name[hits].tolist())}
    named = hits[np.fromiter((names[n] for n in idx.name[hits]), dtype=bool, count=len(hits))]
    static = idx.static[named]
    rowed = named[~static]
    rowed = rowed[spans_mask(selection.steps, idx.step[rowed])
                  & spans_mask(selection.depths, idx.depth[rowed])]
    plan: dict[int, np.ndarray | None] = {int(i): None for i in named[static]}
    found: set[str] = set()
    if selection.requests is None and selection.positions is None:
        plan.update({int(i): None for i in rowed})
    elif len(rowed):
        request, position, _ = trace.key_columns(rowed)
        keep = np.ones(len(position), dtype=bool)
        if selection.requests is not None:
            keep &= _in(request, selection.requests)
            found = set(np.unique(request[keep].astype(str)).tolist())
        if selection.positions is not None:
            keep &= spans_mask(selection.positions, position)
        bounds = np.cumsum(idx.n_rows[rowed])
        for i, rows in zip(rowed.tolist(), np.split(keep, bounds[:-1])):
            if rows.all():
                plan[i] = None
            elif rows.any():
                plan[i] = np.flatnonzero(rows)
    return [(int(i), plan[int(i)]) for i in hits if int(i) in plan], found


def _in(request: np.ndarray, requests: tuple[str, ...]) -> np.ndarray:
    return np.isin(request.astype(str), np.asarray(requests, dtype=str))


def _tokens(trace: Trace, part: int, selection: Selection) -> Keys:
    """(request, position, token_id) of one rank file's token table entries that the selection keeps:
    those of the kept requests (all of them when no request is named)."""
    check_rewritten(trace, part)
    request, position, token_id = trace.token_keys(part)
    if selection.requests is not None and len(position):
        keep = _in(request, selection.requests)
        request, position, token_id = request[keep], position[keep], token_id[keep]
    return request, position, token_id


def _copy_part(trace: Trace, part: int, plan: list[tuple[int, np.ndarray | None]],
               tokens: Keys, writer: TraceWriter, out: Path) -> SlicePart:
    """Write one rank file's kept records (``plan``), then its kept token table entries; close with the
    source's final metadata, its counts made the slice's."""
    batch: list[Record] = []
    written: set[str] = set()
    size = records = rows = data_bytes = 0
    for i, keep in plan:
        record = read_copy(trace, i, keep)
        batch.append(record)
        written.add(record.name)
        size += record.nbytes
        records, rows, data_bytes = records + 1, rows + record.n_rows, data_bytes + record.nbytes
        if size >= BATCH_BYTES:
            writer.write(batch)
            batch, size = [], 0
    request, position, token_id = tokens
    if len(position):
        batch.append(tokens_record(request, position, token_id,
                                   rank=int(trace.files[part].meta.get("rank", 0))))
    writer.write(batch)
    source_final = trace.files[part].final
    final = dict(source_final) if source_final is not None else {"closed": False,
                                                                 "sliced_from_incomplete": True}
    final.update(records=records, bytes=data_bytes, tokens=int(len(position)))
    writer.close(final)
    return SlicePart(out, records, rows, int(len(position)), [n for n in trace.names() if n in written], part)
