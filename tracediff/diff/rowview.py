"""One row of one tensor on both sides of a compare, side by side: the next step after a divergence.

``compare`` names the first diverging row (request on each side, position, depth); ``row_view``
reads that row from each trace and says how the two differ: each side's stats, the row metrics
compare used, and the elements that differ most, with their indices and both values. Request ids
differ between producers (training's ``sample0`` is serving's ``req0``), so each side has its own.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tracediff.diff.finite import measure_finite_parts
from tracediff.diff.metrics import NUMPY, metrics_for
from tracediff.diff.pair import Pair
from tracediff.diff.shapes import dtype_note, mismatch
from tracediff.eagle3.names import DRAFT_INPUT_IDS
from tracediff.errors import InputError, did_you_mean
from tracediff.trace.dtypes import FLOAT_TAGS, decode
from tracediff.trace.reader import RowKeys, Trace, open_trace
from tracediff.trace.summary import TensorStats, value_stats

TraceLike = str | Path | Trace
SIDES = Pair("a", "b")
HEAD = 8  # first values shown per side
FED = DRAFT_INPUT_IDS  # as compare's alignment reads fed tokens
LISTED = 6  # values of a key column named when a selection finds nothing
RUNS = 8  # runs of consecutive positions named when a side lacks the position asked for
FINITE_NOTE = ("the rows hold NaN/Inf at the same elements with the same values on both sides: measured on "
               "their finite elements, as compare does")


@dataclass
class RowSide:
    """Where the row shown lies in one trace, and its stats."""

    path: str
    request: str | None  # None for a static tensor
    position: int  # -1 for a static tensor
    depth: int
    step: int
    token_id: int | None  # the row's token (None for a static tensor)
    fed: int | None  # at depth > 0: the token fed to the draft there (draft.input_ids), where recorded
    matched: int  # rows that fit the selection on this side; shown: the first at the lowest step
    stats: TensorStats


@dataclass
class Difference:
    """One element of the row: its index within the row, both values and |a - b|."""

    index: list[int]
    a: float | int
    b: float | int
    abs_diff: float


@dataclass
class RowView:
    name: str
    static: bool
    a: RowSide
    b: RowSide
    metrics: dict[str, float] = field(default_factory=dict)  # compare's row metrics; empty if shapes differ
    elements: int = 0  # elements compared (0 when the shapes differ)
    differing: int = 0  # elements whose values differ (NaN on both sides counts as equal)
    top: list[Difference] = field(default_factory=list)  # the largest differences, largest first
    notes: list[str] = field(default_factory=list)  # shapes or dtypes that differ, other text, ...


@dataclass
class _Found:
    """One side's row: decoded values and where it lies."""

    values: np.ndarray
    dtype: str
    side: RowSide


def row_view(a: TraceLike, b: TraceLike, name: str, *, request: str | None = None,
             request_b: str | None = None, position: int | None = None, depth: int = 0,
             step: int | None = None, step_b: int | None = None, top: int = 10,
             name_b: str | None = None, verify: bool = True) -> RowView:
    """The row of ``name`` at (``request``, ``position``, ``depth``) in ``a`` and at (``request_b``,
    the same position and depth) in ``b``, and how they differ.

    ``name_b`` (b's name for the tensor, as ``compare --map`` renames it), ``request_b`` and
    ``step_b`` default to ``name``, ``request`` and ``step``. Without ``position``, the first row
    of ``a`` (trace order) whose position ``b`` holds too. Several rows fitting the selection on a
    side (no request given, a request seen in several epochs or retried, a position drafted in
    several steps): the first in trace order at the lowest step (negative steps last), so that
    compare's ``next:`` command needs no ``--step`` for a row at step 0; ``matched`` says how many
    fit. Metrics are compare's, a row whose NaN/Inf agree on both sides measured on its finite
    elements. A static tensor (``log_static``) is compared whole (its last record). Raises
    ``InputError`` naming the side's file when it lacks the tensor or the row."""
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    with ExitStack() as stack:
        traces = Pair(*(t if isinstance(t, Trace) else stack.enter_context(open_trace(t, verify=verify))
                        for t in (a, b)))
        labels = Pair(*(str(t.paths[0]) if isinstance(t, Trace) else str(t) for t in (a, b)))
        names = Pair(name, name if name_b is None else name_b)
        kinds = traces.zip(names, labels, SIDES).starmap(_kind)
        if kinds.a != kinds.b:
            raise InputError(labels.b, f"{name!r} is a {kinds.b} tensor in b but a {kinds.a} tensor in a: "
                                       "they cannot be shown side by side")
        steps = Pair(step, step if step_b is None else step_b)
        if kinds.a == "static":
            if request is not None or request_b is not None or position is not None:
                raise InputError(labels.a, f"{name!r} is a static tensor (log_static): it has no request "
                                           "or position to select")
            found = traces.zip(names, steps, labels, SIDES).starmap(_static)
        else:
            requests = Pair(request, request if request_b is None else request_b)
            found = _rows(traces, labels, names, requests, position, depth, steps)
        return _view(name, kinds.a == "static", found, top, traces)


def _kind(trace: Trace, name: str, label: str, side: str) -> str:
    """'row' or 'static': how this side holds ``name``; InputError when it lacks it."""
    hits = trace.select(name=name)
    if not len(hits):
        hint = did_you_mean(name, trace.names())
        raise InputError(label, f"{side} has no tensor {name!r}" + (f"; {hint}" if hint else "")
                         + f" (list them: tracediff show {label})")
    return "static" if trace.index.static[hits].all() else "row"


def _static(trace: Trace, name: str, step: int | None, label: str, side: str) -> _Found:
    record = trace.last_static(name, step)
    if record is None:
        steps = sorted(set(trace.index.step[trace.select(name=name)].tolist()))
        raise InputError(label, f"{side} has no record of {name!r} at step {step} "
                                f"(its steps: {_listed(steps)})")
    values = record.numpy()
    stats = value_stats(name, record.dtype, values, 0, values.reshape(-1)[:HEAD])
    where = RowSide(label, None, -1, record.depth, record.step, None, None, 1, stats)
    return _Found(values, record.dtype, where)


def _rows(traces: Pair[Trace], labels: Pair[str], names: Pair[str], requests: Pair[str | None],
          position: int | None, depth: int, steps: Pair[int | None]) -> Pair[_Found]:
    """Each side's rows fitting the selection; the position, if not given, is the first row of a's
    that b holds too."""
    name = names.a
    keys = traces.zip(names, labels, SIDES, requests, steps).starmap(
        lambda t, n, label, side, req, s: _select(t, n, label, side, req, depth, s))
    if position is None:
        shared = np.isin(keys.a.position, keys.b.position) & (keys.a.position >= 0)
        if not shared.any():
            raise InputError(labels.b, f"b holds no row of {name!r} at a position a holds "
                                       f"({_selection(requests.a, depth, steps.a)} on a: positions "
                                       f"{_positions(keys.a.position)}; on b: {_positions(keys.b.position)})")
        position = int(keys.a.position[np.argmax(shared)])
    chosen = position
    return traces.zip(keys, labels, SIDES).starmap(lambda t, k, label, side: _read(t, k, label, side, chosen))


def _select(trace: Trace, name: str, label: str, side: str, request: str | None, depth: int,
            step: int | None) -> RowKeys:
    """The keys of the rows of ``name`` at ``step``, ``depth`` and ``request``; InputError saying
    which values this side does hold where a filter leaves nothing."""
    try:
        keys = trace.keys(name, step=step)
    except KeyError:
        steps = sorted(set(trace.index.step[trace.select(name=name)].tolist()))
        raise InputError(label, f"{side} has no rows of {name!r} at step {step} "
                                f"(its steps: {_listed(steps)})") from None
    for column, value, option in (("depth", depth, "--depth"), ("request", request, "--request")):
        if value is None:
            continue
        have = getattr(keys, column)
        if not (have == value).any():
            option += "-b" if side == "b" and column == "request" else ""
            held = list(dict.fromkeys(have.tolist()))
            raise InputError(label, f"{side} has no rows of {name!r} at {column} "
                                    f"{value!r} (its {column}s: {_listed(held)}; pass {option})")
        keys = keys.take(np.flatnonzero(have == value))
    return keys


def _read(trace: Trace, keys: RowKeys, label: str, side: str, position: int) -> _Found:
    at = np.flatnonzero(keys.position == position)
    if not len(at):
        raise InputError(label, f"{side} has no row of {keys.name!r} at position {position} "
                                f"(positions of the rows selected: {_positions(keys.position)})")
    steps = keys.step[at]
    i = int(at[np.lexsort((steps, steps < 0))[0]])  # lowest step, negative ones last; stable: trace order
    values = decode(trace.gather(keys, np.array([i])), keys.dtype)[0]
    stats = value_stats(keys.name, keys.dtype, values, 1, values.reshape(-1)[:HEAD])
    request, row_depth, step = str(keys.request[i]), int(keys.depth[i]), int(keys.step[i])
    where = RowSide(label, request, position, row_depth, step, int(keys.token_id[i]),
                    _fed(trace, request, position, row_depth, step), len(at), stats)
    return _Found(values, keys.dtype, where)


def _view(name: str, static: bool, found: Pair[_Found], top: int, traces: Pair[Trace]) -> RowView:
    view = RowView(name, static, found.a.side, found.b.side)
    dtypes = (found.a.dtype, found.b.dtype)
    if note := dtype_note(dtypes):
        view.notes.append(note)
    if not static:
        view.notes += _text_notes(traces, found.a.side, found.b.side)
    problem = mismatch(name, found.map(lambda f: tuple(f.values.shape)))
    if problem is not None:
        view.notes.append(("shape" if static else "row shape") + problem[1].removeprefix("row shape"))
        return view
    x, y = found.a.values, found.b.values
    measured = metrics_for(name, dtypes, x[None], y[None])
    if any(d in FLOAT_TAGS for d in dtypes) and not np.isfinite(measured["max_abs"][0]):
        flat = Pair(x.reshape(1, -1), y.reshape(1, -1))
        if measure_finite_parts(flat, np.array([0]), measured, name, NUMPY).any():
            view.notes.append(FINITE_NOTE)
    view.metrics = {k: float(v[0]) for k, v in measured.items()}
    view.elements = int(x.size)
    differs, order = _largest(x, y)
    view.differing = int(differs.sum())
    for flat in order[:top].tolist():
        index = [int(i) for i in np.unravel_index(flat, x.shape)]
        va, vb = _number(x.reshape(-1)[flat].item()), _number(y.reshape(-1)[flat].item())
        exact = isinstance(va, int) and isinstance(vb, int)  # integers differ exactly, whatever their size
        gap = float(abs(va - vb)) if exact else abs(float(va) - float(vb))
        view.top.append(Difference(index, va, vb, gap))
    return view


def _largest(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(which elements differ, their flat indices largest |a - b| first). An element NaN or
    infinite on one side only differs most of all; NaN on both sides, or the same infinity, is equal.
    Ties keep index order."""
    a, b = x.reshape(-1), y.reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        differs = (a != b) & ~(_isnan(a) & _isnan(b))
        gap = np.abs(a.astype(np.float64) - b.astype(np.float64))
    gap = np.where(np.isfinite(gap), gap, np.inf)
    where = np.flatnonzero(differs)
    return differs, where[np.argsort(-gap[where], kind="stable")]


def _isnan(v: np.ndarray) -> np.ndarray:
    return np.isnan(v) if v.dtype.kind == "f" else np.zeros(v.shape, dtype=bool)


def _number(v: object) -> float | int:
    return int(v) if isinstance(v, (bool, int)) else float(v)  # type: ignore[arg-type]


def _text_notes(traces: Pair[Trace], a: RowSide, b: RowSide) -> list[str]:
    """Notes when the two rows are not what compare would pair: other tokens at the row or before it
    (token table and the rows' own), or at depth > 0 other tokens fed to the draft."""
    notes = []
    if a.token_id is not None and b.token_id is not None and a.token_id != b.token_id:
        notes.append(f"the rows hold other tokens (a {a.token_id}, b {b.token_id}): not the same text")
    else:
        (pa, ta), (pb, tb) = (t.request_tokens().sequence(str(side.request))
                              for t, side in ((traces.a, a), (traces.b, b)))
        upto = pa <= a.position
        pa, ta = pa[upto], ta[upto]
        _, ia, ib = np.intersect1d(pa, pb, return_indices=True)
        differs = np.flatnonzero(ta[ia] != tb[ib])
        if len(differs):
            k = int(differs[0])
            notes.append(f"the requests hold other tokens at position {int(pa[ia[k]])} (a {int(ta[ia[k]])}, "
                         f"b {int(tb[ib[k]])}): these rows follow other text")
    if a.fed is not None and b.fed is not None and a.fed != b.fed:
        notes.append(f"the draft was fed other tokens at depth {a.depth} (a {a.fed}, b {b.fed}): compare "
                     "pairs depth > 0 rows only when fed the same tokens")
    return notes


def _fed(trace: Trace, request: str, position: int, depth: int, step: int) -> int | None:
    """The token fed to the draft for this row (``draft.input_ids`` at its request, position, depth
    and step), at depth > 0; None at depth 0 or where the trace does not say."""
    if depth == 0 or not len(trace.select(name=FED)):
        return None
    try:
        keys = trace.keys(FED, step=step, depth=depth)
    except (KeyError, InputError):
        return None
    at = np.flatnonzero((keys.request == request) & (keys.position == position))
    return int(trace.gather(keys, at[:1]).reshape(-1)[0]) if len(at) else None


def _selection(request: str | None, depth: int, step: int | None) -> str:
    parts = [f"request {request!r}" if request is not None else "", f"depth {depth}",
             f"step {step}" if step is not None else ""]
    return ", ".join(p for p in parts if p)


def _positions(positions: np.ndarray) -> str:
    """The positions held, as runs of consecutive ones ('3..4, 9, 14, 19'): gaps stay visible. At
    most ``RUNS`` runs, then how many positions there are in all."""
    real = np.unique(positions[positions >= 0])
    if not len(real):
        return "none"
    starts = np.flatnonzero(np.diff(real, prepend=real[0] - 2) != 1)
    ends = np.append(starts[1:], len(real)) - 1
    runs = [str(real[s]) if s == e else f"{real[s]}..{real[e]}" for s, e in zip(starts[:RUNS], ends[:RUNS])]
    return ", ".join(runs) + (f", ... ({len(real)} positions in all)" if len(starts) > RUNS else "")


def _listed(values: list) -> str:
    shown = ", ".join(repr(v) for v in values[:LISTED])  # repr: trace text never escapes
    return shown + (f", ... ({len(values)} in all)" if len(values) > LISTED else "")
