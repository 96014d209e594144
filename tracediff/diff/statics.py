"""Static tensors (weights, the vocab map, config tensors: ``log_static``) have no rows to align:
the last record of a name on one side is compared with the last on the other, as one row. A vocab
map or a norm weight that differs is as much a divergence as a hidden state that does."""

from __future__ import annotations

from dataclasses import dataclass

from tracediff.diff.metrics import metrics_for
from tracediff.diff.pair import Pair
from tracediff.diff.results import Coverage, RowRef, TensorResult
from tracediff.diff.shapes import agreement, dtype_note, kinds_differ, mismatch
from tracediff.diff.tolerance import Tolerances, failing_rows
from tracediff.trace.reader import Trace


@dataclass
class StaticPair:
    """A static name on both sides: the index position of its last record on each."""

    name: str  # as the baseline (a) calls it
    records: Pair[int]


def compare_static(traces: Pair[Trace], pair: StaticPair, tolerances: Tolerances) -> TensorResult:
    """One static tensor on both sides, as a single row: ``diverged`` when out of tolerance (the
    differ turns it into ``downstream`` when a row tensor diverged first); across kinds of dtype
    (integer vs float) compared by value but a ``dtype_mismatch``, as row tensors are."""
    records = traces.zip(pair.records).starmap(lambda trace, i: trace.read(i))
    dtypes, shapes = records.map(lambda r: r.dtype), records.map(lambda r: tuple(r.data.shape))
    result = TensorResult(pair.name, "match", dtypes=(dtypes.a, dtypes.b),
                          shapes=(list(shapes.a), list(shapes.b)), rows=1,
                          coverage=Coverage.of((1, 1), 1, (1, 1), {}, {}),
                          note=dtype_note((dtypes.a, dtypes.b)), static=True)
    problem = mismatch(pair.name, shapes)
    if problem is not None:
        status = problem[0]
        result.status, result.rows = status, 0
        result.note = problem[1]
        result.coverage = Coverage.of((1, 1), 0, (0, 0), {status: 1}, {status: 1})
        return result
    values = records.map(lambda r: r.numpy().reshape(1, -1))
    metrics = metrics_for(pair.name, (dtypes.a, dtypes.b), values.a, values.b)
    result.worst = {k: float(v[0]) for k, v in metrics.items()}
    result.add_note(tolerances.unused_rule(pair.name, metrics))
    bounds = tolerances.bounds(pair.name, (dtypes.a, dtypes.b), metrics)
    if failing_rows(metrics, bounds).any():
        steps = records.map(lambda r: r.step)
        result.status, result.failed = "diverged", 1
        result.first_bad = RowRef(request_a="", request_b="", position=-1, depth=0, step_a=steps.a,
                                  step_b=steps.b, metrics=result.worst)
    if kinds_differ((dtypes.a, dtypes.b)):
        result.status = "dtype_mismatch"
        result.add_note(agreement(result.rows, result.failed))
    return result
