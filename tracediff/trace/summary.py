"""What ``tracediff show`` says about a trace, as plain data (rendering lives in report/)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

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
                        token_requests=len(table.requests()), contract=trace.contract)


def tensor_stats(rows: TensorRows, head: int = 8) -> TensorStats:
    """Stats over every value, in float64; NaN/Inf counted and left out of the moments."""
    values = rows.numpy()
    first = values[0].reshape(-1)[:head] if len(values) else values.reshape(-1)[:0]
    return value_stats(rows.name, rows.dtype, values, len(rows), first)


def value_stats(name: str, dtype: str, values: np.ndarray, rows: int, first: np.ndarray) -> TensorStats:
    """Stats of decoded ``values`` (any shape), ``first`` the values to show; shared by one
    tensor's rows, a static tensor and one row of a side-by-side view, so that all say the same."""
    # Any bits are data: a signalling NaN warns when cast, float64 extremes overflow the moments (inf).
    with np.errstate(invalid="ignore", over="ignore"):
        flat = values.reshape(-1).astype(np.float64)
        finite = flat[np.isfinite(flat)]
        nan = int(np.isnan(flat).sum())
        stats = (finite.min(), finite.max(), finite.mean(), finite.std()) if len(finite) else (np.nan,) * 4
    return TensorStats(
        name=name, dtype=dtype, rows=rows, shape=list(values.shape),
        min=float(stats[0]), max=float(stats[1]), mean=float(stats[2]), std=float(stats[3]),
        nan=nan, inf=int(len(flat) - len(finite) - nan), head=first.tolist(),
    )


def static_stats(trace: Trace, name: str, step: int | None = None) -> TensorStats | None:
    """Stats of the last static record of ``name`` (at ``step`` if given); None when it has none."""
    record = trace.last_static(name, step)
    if record is None:
        return None
    values = record.numpy()
    return value_stats(name, record.dtype, values, 0, values.reshape(-1)[:8])


