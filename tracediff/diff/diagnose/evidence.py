"""What the diagnoses read: small samples of rows, fetched by row number, never whole tensors."""

from __future__ import annotations

import numpy as np

from tracediff.diff.differ import Comparison
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import decode
from tracediff.trace.reader import RowKeys, Trace


def side_labels(traces: Pair[Trace]) -> Pair[str]:
    """What each side calls itself (the ``source`` metadata: training, serving), else a and b."""
    sources = traces.map(lambda t: str(t.meta.get("source") or ""))
    if sources.a and sources.b and sources.a != sources.b:
        return sources
    return Pair("a", "b")


def values(trace: Trace, keys: RowKeys, rows: np.ndarray) -> np.ndarray:
    """Decoded rows as float64 [n, -1]."""
    data = decode(trace.gather(keys, np.asarray(rows, dtype=np.int64)), keys.dtype)
    with np.errstate(invalid="ignore"):  # a signalling NaN is data: no warning when it is cast
        return data.reshape(len(data), -1).astype(np.float64)


def failing_sample(comparison: Comparison, name: str) -> Pair[np.ndarray]:
    """Row numbers (into the plan's keys) of the first failing rows of ``name`` on both sides."""
    bad = comparison.tallies[name].bad_rows
    return bad.map(lambda rows: np.asarray(rows, dtype=np.int64))


def row_where(keys: RowKeys, row: int) -> dict:
    return {"request": str(keys.request[row]), "position": int(keys.position[row]),
            "depth": int(keys.depth[row]), "step": int(keys.step[row])}
