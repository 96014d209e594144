"""Planning a comparison from key columns only: which rows of each tensor correspond, and in
which order to read them. The plan is plain data; ``differ`` executes it chunk by chunk, so
memory stays bounded by the chunk size, not by the traces' size.

Chunks run in the baseline's execution order: the baseline's steps are grouped into windows of
about ``chunk_bytes`` (over all names); within a window by dataflow order (the order the baseline
first logged each name), then by row. Once a window holds a failing row, the first divergence is
settled (the failing row with the earliest step, then the earliest name), and a compare told to
stop there reads no further window.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import dataclass

import numpy as np

from tracediff.diff.align import (
    FED,
    Declared,
    Matched,
    Prefixes,
    Sides,
    fed_tokens,
    fed_values,
    match,
    match_by_step,
)
from tracediff.diff.pair import Pair
from tracediff.diff.rename import renamed
from tracediff.diff.results import Coverage, Status
from tracediff.diff.shapes import dtype_note, mismatch
from tracediff.diff.statics import StaticPair
from tracediff.errors import TraceError
from tracediff.trace.reader import MixedRecords, RowKeys, Trace

CHUNK_BYTES = 16 << 20  # raw bytes per side per chunk
ALIGNMENTS = ("prefix", "step")


@dataclass
class Mixed:
    """A name whose records on one side differ in dtype or row shape (a dtype that changed between
    steps): its rows, and what differs."""

    rows: int
    note: str

    @classmethod
    def of(cls, trace: Trace, error: MixedRecords) -> Mixed:
        hits = trace.select(name=error.name)
        differs = [f"dtypes {', '.join(error.dtypes)}" if len(error.dtypes) > 1 else "",
                   f"row shapes {', '.join(map(str, error.row_shapes))}" if len(error.row_shapes) > 1 else ""]
        return cls(int(trace.index.n_rows[hits].sum()), " and ".join(filter(None, differs)))


@dataclass
class MixedTensor:
    """A name on both sides that cannot be compared because a side's records are mixed."""

    name: str
    rows: Pair[int]
    note: str

    @property
    def coverage(self) -> Coverage:
        """None of its rows compared, on either side."""
        return Coverage.of((self.rows.a, self.rows.b), 0, (0, 0), {"mixed_records": self.rows.a},
                           {"mixed_records": self.rows.b})


@dataclass
class SideKeys:
    """What alignment reads of one trace, before any tensor byte: the key columns of every per-row
    tensor name, the names whose records cannot form one tensor, and the request token table."""

    tensors: dict[str, RowKeys]
    mixed: dict[str, Mixed]  # names whose records cannot form one tensor
    statics: dict[str, int]  # names logged with log_static only -> the index position of the last
    declared: Declared
    every: int  # the recorder kept every N-th step


@dataclass
class TensorPlan:
    """One tensor name present on both sides: its rows, the ones that correspond, and why it cannot
    be compared at all (``problem``) if so; ``note`` says what else differs (dtypes)."""

    name: str  # as the baseline (a) calls it
    keys: Pair[RowKeys]
    matched: Matched
    problem: Status | None = None
    note: str = ""


@dataclass
class Chunk:
    tensor: TensorPlan
    order: int  # the tensor's place in dataflow order
    rows: Pair[np.ndarray]  # corresponding row numbers into tensor.keys, a's order
    window: int  # the window of baseline steps these rows belong to

    @property
    def nbytes(self) -> Pair[int]:
        """Raw bytes of the chunk's rows on each side."""
        return self.tensor.keys.map(lambda keys: len(self.rows.a) * keys.row_nbytes)


@dataclass
class Plan:
    tensors: list[TensorPlan]  # in a's dataflow order
    missing_in_a: list[str]
    missing_in_b: list[str]
    mixed: list[MixedTensor]  # names on both sides whose records on a side cannot form one tensor
    statics: list[StaticPair]  # names logged with log_static on both sides
    chunks: list[Chunk]
    prefixes: Pair[Prefixes]
    keys: Pair[dict[str, RowKeys]]  # every non-static name of each side, for the diagnoses
    # per prefix entry of each side, whether its request left the other side's text by then
    # (``align.departures``; None under --align step, which never computed it)
    departed: Pair[np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        """Raw bytes the chunks read, both sides."""
        return sum(c.nbytes.a + c.nbytes.b for c in self.chunks)


def tensor_keys(trace: Trace) -> SideKeys:
    """Key columns of every name that has per-row records (static weights, d2t are left out), the
    names whose records are mixed, the request token table and the recorder's step filter. A
    complete trace without tensor rows is refused (TraceError); one whose recording stopped or
    dropped them is compared, and its verdict says what it lacks."""
    out, mixed, statics = {}, {}, {}
    for name in trace.names():
        hits = trace.select(name=name)
        static = trace.index.static[hits]
        if static.all():
            statics[name] = int(hits[-1])
        elif static.any():  # a name logged both ways on one side: neither half stands for it
            mixed[name] = Mixed(int(trace.index.n_rows[hits].sum()), "static and per-token records")
        else:
            try:
                out[name] = trace.keys(name)
            except MixedRecords as exc:  # records of mixed dtype or row shape: reported, not compared
                mixed[name] = Mixed.of(trace, exc)
    if not out and not mixed and trace.completeness.complete:  # a partial one is judged incomplete
        raise TraceError(trace.paths[0], "the trace holds no tensor rows")
    table = trace.request_tokens()
    codes = trace.request_codes(table.request)
    names = dict(zip(codes.tolist(), table.request.tolist()))
    declared = Declared(codes, table.position, table.token_id, names)
    return SideKeys(out, mixed, statics, declared, _every(trace.meta))


def _every(meta: dict) -> int:
    """The recorder's ``every`` filter from the run metadata; 1 when absent or not a positive int."""
    filters = meta.get("filters")
    every = filters.get("every") if isinstance(filters, dict) else None
    return every if isinstance(every, int) and not isinstance(every, bool) and every > 0 else 1


def make_plan(traces: Pair[Trace], rename: dict[str, str] | None = None, align: str = "prefix",
              chunk_bytes: int = CHUNK_BYTES, keys: Pair[SideKeys] | None = None) -> Plan:
    """``rename`` maps names in b to names in a (``--map NAME_IN_B=NAME_IN_A``); ``align`` is
    ``prefix`` (rows by token content) or ``step`` (rows by step and order, same producer);
    ``keys``: each side's ``tensor_keys`` if already read."""
    if align not in ALIGNMENTS:
        raise ValueError(f"--align takes 'prefix' or 'step', not {align!r}")
    side = keys or traces.map(tensor_keys)
    every_name = side.map(lambda s: [*s.tensors, *s.mixed, *s.statics])
    as_a = renamed(every_name.b, rename or {}, every_name.a)
    tensors_by_name = Pair(side.a.tensors, {as_a[n]: k for n, k in side.b.tensors.items()})
    mixed_by_name = Pair(dict(side.a.mixed), {as_a[n]: m for n, m in side.b.mixed.items()})
    statics_by_name = Pair(dict(side.a.statics), {as_a[n]: i for n, i in side.b.statics.items()})
    per_token = Pair({*tensors_by_name.a, *mixed_by_name.a}, {*tensors_by_name.b, *mixed_by_name.b})
    for statics_here, theirs, mixed_here in ((statics_by_name.a, per_token.b, mixed_by_name.a),
                                             (statics_by_name.b, per_token.a, mixed_by_name.b)):
        for name in [n for n in statics_here if n in theirs]:  # static here, per-token there
            del statics_here[name]
            mixed_here[name] = Mixed(1, "static")
    fed_keys = tensors_by_name.map(lambda t: t.get(FED))
    fed_ids = traces.zip(fed_keys).starmap(fed_values)
    prefixes = side.zip(tensors_by_name, fed_keys.zip(fed_ids).starmap(Declared.fed)).starmap(
        lambda s, t, fed: Prefixes.of(list(t.values()), s.declared, fed))
    fed = fed_keys.zip(fed_ids, prefixes).starmap(fed_tokens)
    sides = Sides.of(prefixes, fed) if align == "prefix" else None
    every = side.map(lambda s: s.every)
    tensors = []
    for name, keys_a in tensors_by_name.a.items():
        if name not in tensors_by_name.b:
            continue
        both = Pair(keys_a, tensors_by_name.b[name])
        problem = mismatch(name, both.map(lambda k: k.row_shape))
        if problem is not None:
            skipped = both.map(_counted_as(problem[0]))
            matched = Matched(both.map(lambda k: np.zeros(0, np.int64)), skipped)
            tensors.append(TensorPlan(name, both, matched, problem[0], problem[1]))
            continue
        matched = match(both, sides, name) if sides is not None else match_by_step(both, prefixes, every)
        tensors.append(TensorPlan(name, both, matched, note=dtype_note((keys_a.dtype, both.b.dtype))))
    names = Pair([*tensors_by_name.a, *mixed_by_name.a], [*tensors_by_name.b, *mixed_by_name.b])
    either = dict.fromkeys([*mixed_by_name.a, *mixed_by_name.b])
    mixed = [_mixed(n, tensors_by_name, mixed_by_name) for n in either if n in names.a and n in names.b]
    comparable = [t for t in tensors if t.problem is None]
    statics = [StaticPair(n, Pair(i, statics_by_name.b[n])) for n, i in statics_by_name.a.items()
               if n in statics_by_name.b]
    static_only = statics_by_name.map(lambda s: list(s))
    return Plan(tensors=tensors, missing_in_a=[n for n in names.b if n not in names.a]
                + [n for n in static_only.b if n not in statics_by_name.a],
                missing_in_b=[n for n in names.a if n not in names.b]
                + [n for n in static_only.a if n not in statics_by_name.b], mixed=mixed,
                statics=statics,
                chunks=chunks_of(comparable, chunk_bytes), prefixes=prefixes, keys=tensors_by_name,
                departed=None if sides is None else sides.departed)


def _mixed(name: str, tensors: Pair[dict[str, RowKeys]], mixed: Pair[dict[str, Mixed]]) -> MixedTensor:
    sides = Pair(*((m[name].rows, f"{side}: {m[name].note}") if name in m else (len(t[name]), "")
                   for side, t, m in (("a", tensors.a, mixed.a), ("b", tensors.b, mixed.b))))
    return MixedTensor(name, sides.map(lambda s: s[0]), "; ".join(filter(None, (sides.a[1], sides.b[1]))))


def chunks_of(tensors: list[TensorPlan], chunk_bytes: int) -> list[Chunk]:
    """Group the baseline's steps into windows of about ``chunk_bytes`` over all tensors, split each
    tensor's rows of a window further where they alone exceed it, and order the chunks by (window,
    dataflow order, row)."""
    steps = [t.keys.a.step[t.matched.rows.a] for t in tensors]
    row_bytes = [max(t.keys.a.row_nbytes, t.keys.b.row_nbytes, 1) for t in tensors]
    present = [s for s in steps if len(s)]
    if not present:
        return []
    unique = np.unique(np.concatenate(present))
    step_bytes = np.zeros(len(unique))
    for s, size in zip(steps, row_bytes):
        step_bytes += np.bincount(np.searchsorted(unique, s), minlength=len(unique)) * size
    first_window = (np.cumsum(step_bytes) - step_bytes) // max(chunk_bytes, 1)
    _, window_of_step = np.unique(first_window, return_inverse=True)  # 0, 1, 2, ... without gaps
    ordered = []
    for order, (tensor, s, size) in enumerate(zip(tensors, steps, row_bytes)):
        if not len(s):
            continue
        windows = window_of_step[np.searchsorted(unique, s)]
        per_chunk = max(1, chunk_bytes // size)
        bounds = [0]
        for start, stop in zip(*_runs(windows)):
            bounds += list(range(start + per_chunk, stop, per_chunk)) + [stop]
        a_rows, b_rows = tensor.matched.rows.a, tensor.matched.rows.b
        for start, stop in zip(bounds, bounds[1:]):
            chunk = Chunk(tensor, order, Pair(a_rows[start:stop], b_rows[start:stop]), int(windows[start]))
            ordered.append(((chunk.window, order, start), chunk))
    ordered.sort(key=lambda item: item[0])
    return [chunk for _, chunk in ordered]


def _counted_as(status: str) -> Callable[[Sized], dict[str, int]]:
    """Every row of a side counted under one status."""
    return lambda rows: {status: len(rows)}


def _runs(values: np.ndarray) -> tuple[list[int], list[int]]:
    """Starts and stops of the runs of equal neighbouring values."""
    cuts = (np.flatnonzero(np.diff(values)) + 1).tolist()
    return [0, *cuts], [*cuts, len(values)]
