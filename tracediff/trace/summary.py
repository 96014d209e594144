"""What ``tracediff show`` says about a trace, as plain data (rendering lives in report/)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from tracediff.trace.dtypes import decode
from tracediff.trace.reader import TensorRows, Trace


@dataclass
class NameSummary:
    name: str
    dtype: str
    row_shape: list[int]
    static: bool
    rows: int
    records: int
    steps: int
    requests: int
    bytes: int


@dataclass
class TraceSummary:
    paths: list[str]
    complete: bool
    meta: dict
    finals: list[dict | None]
    tensors: list[NameSummary]  # reserved ``__`` records are not tensors: never listed
    tokens: int = 0  # entries of the token table (declared or learned)
    token_requests: int = 0  # requests with known tokens
    contract: dict = field(default_factory=dict)  # Trace.contract: as opened, updated by each file's writer
    unverified: str | None = None  # Trace.unverified: why reads were not checked (None: they were)
    lacking: list[str] = field(default_factory=list)  # Trace.completeness: what it lacks, one line each

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TensorStats:
    name: str
    dtype: str
    rows: int
    shape: list[int]
    min: float
    max: float
    mean: float
    std: float
    nan: int
    inf: int
    head: list  # the first few values of the first row

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(trace: Trace) -> TraceSummary:
    idx = trace.index
    tensors = []
    for name in trace.names():
        hits = trace.select(name=name)
        static = bool(idx.static[hits[0]])
        requests: np.ndarray | list[str] = (
            np.unique(trace.key_columns(hits[~idx.static[hits]])[0].astype(str)) if not static else []
        )
        shape = idx.shape[hits[0]]
        tensors.append(NameSummary(
            name=name,
            dtype=idx.dtype[hits[0]],
            row_shape=list(shape if static else shape[1:]),
            static=static,
            rows=int(idx.n_rows[hits].sum()),
            records=len(hits),
            steps=len(np.unique(idx.step[hits])),
            requests=len(requests),
            bytes=int(idx.nbytes[hits].sum()),
        ))
    table = trace.request_tokens()
    return TraceSummary(paths=[str(p) for p in trace.paths], complete=trace.complete, meta=trace.meta,
                        finals=trace.finals, tensors=tensors, tokens=len(table),
                        token_requests=len(table.requests()), contract=trace.contract,
                        unverified=trace.unverified,
                        lacking=[g.line("this trace") for g in trace.completeness.gaps
                                 if g.kind != "not_closed"])


STATS_WINDOW = 1 << 18  # values per step of the moments: 2 MiB of float64, whatever the tensor's size


def tensor_stats(rows: TensorRows, head: int = 8) -> TensorStats:
    """Stats over every value, in float64; NaN/Inf counted and left out of the moments. Read from the
    raw rows a window at a time (decoded there): memory beyond the rows stays at ``STATS_WINDOW``."""
    raw = rows.data
    first = decode(raw[0].reshape(-1)[:head], rows.dtype) if len(raw) else raw.reshape(-1)[:0]
    return _stats(rows.name, rows.dtype, raw, rows.dtype, len(rows), first)


def value_stats(name: str, dtype: str, values: np.ndarray, rows: int, first: np.ndarray) -> TensorStats:
    """Stats of decoded ``values`` (any shape), ``first`` the values to show; shared by one
    tensor's rows, a static tensor and one row of a side-by-side view, so that all say the same."""
    return _stats(name, dtype, values, None, rows, first)


def _windows(values: np.ndarray, tag: str | None):
    """``values`` flattened, as float64 windows of ``STATS_WINDOW`` (``tag``: raw bits of that tag)."""
    flat = values.reshape(-1)
    for start in range(0, len(flat), STATS_WINDOW):
        part = flat[start : start + STATS_WINDOW]
        yield (decode(part, tag) if tag is not None else part).astype(np.float64)


def _stats(name: str, dtype: str, values: np.ndarray, tag: str | None, rows: int,
           first: np.ndarray) -> TensorStats:
    """Two passes of windows: count, sum, extremes and NaNs, then the squared deviations from the mean."""
    count, nan, total, low, high = 0, 0, 0.0, np.inf, -np.inf
    # Any bits are data: a signalling NaN warns when cast, float64 extremes overflow the moments (inf).
    with np.errstate(invalid="ignore", over="ignore"):
        for window in _windows(values, tag):
            finite = window[np.isfinite(window)]
            nan += int(np.isnan(window).sum())
            if len(finite):
                count += len(finite)
                total += float(finite.sum())
                low, high = min(low, float(finite.min())), max(high, float(finite.max()))
        size = int(values.size)
        if count:
            mean = total / count
            squares = sum(float(np.square(w[np.isfinite(w)] - mean).sum()) for w in _windows(values, tag))
            stats = (low, high, mean, float(np.sqrt(squares / count)))
        else:
            stats = (np.nan,) * 4
    return TensorStats(
        name=name, dtype=dtype, rows=rows, shape=list(values.shape),
        min=float(stats[0]), max=float(stats[1]), mean=float(stats[2]), std=float(stats[3]),
        nan=nan, inf=size - count - nan, head=first.tolist(),
    )


def static_stats(trace: Trace, name: str, step: int | None = None) -> TensorStats | None:
    """Stats of the last static record of ``name`` (at ``step`` if given); None when it has none."""
    record = trace.last_static(name, step)
    if record is None:
        return None
    raw = record.data
    return _stats(name, record.dtype, raw, record.dtype, 0, decode(raw.reshape(-1)[:8], record.dtype))


