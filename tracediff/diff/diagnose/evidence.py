"""What the diagnoses read: one ``Context`` per compare (the comparison, the traces, and the facts
of the first divergence that several rules read, computed once), and small samples of rows, fetched
by row number, never whole tensors."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tracediff.diff.differ import Comparison
from tracediff.diff.pair import Pair
from tracediff.diff.plan import TensorPlan
from tracediff.diff.results import TensorResult
from tracediff.trace.dtypes import FLOAT_TAGS, decode
from tracediff.trace.reader import RowKeys, Trace

SAMPLE_ROWS = 32  # failing rows a diagnosis reads


@dataclass(frozen=True)
class Context:
    """What every diagnosis rule reads: one per compare, shared by all of them."""

    comparison: Comparison
    traces: Pair[Trace]

    @property
    def first(self) -> TensorResult | None:
        return self.comparison.first_divergence

    @cached_property
    def labels(self) -> Pair[str]:
        return side_labels(self.traces)

    def tensor(self, name: str) -> TensorPlan:
        """The plan of row tensor ``name``."""
        return next(t for t in self.comparison.plan.tensors if t.name == name)

    def sample(self, name: str, rows: int = SAMPLE_ROWS) -> Pair[np.ndarray]:
        """Row numbers of the first ``rows`` failing rows of ``name`` on both sides."""
        return failing_sample(self.comparison, name).map(lambda r: r[:rows])

    @cached_property
    def first_rows(self) -> Pair[np.ndarray] | None:
        """The first diverging tensor's sampled failing rows, decoded, when it is a float tensor
        (what the scale and the shift rules both judge)."""
        first = self.first
        if first is None or not all(d in FLOAT_TAGS for d in first.dtypes or ()):
            return None
        keys, rows = self.tensor(first.name).keys, self.sample(first.name)
        return Pair(values(self.traces.a, keys.a, rows.a), values(self.traces.b, keys.b, rows.b))


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
