"""Position shift: one side's rows equal the other side's rows k positions away (same request
tokens, same depth), e.g. ids not shifted left, or hidden states sliced one row off; or a tensor
of positions (RoPE positions) is off by a constant k."""

from __future__ import annotations

import numpy as np

from tracediff.diff.align import RowIndex, fed_next, key_of, prefix_ids
from tracediff.diff.diagnose.evidence import failing_sample, side_labels, values
from tracediff.diff.differ import Comparison
from tracediff.diff.findings import Diagnosis, RowShiftEvidence, ValueOffsetEvidence
from tracediff.diff.metrics import metrics_for
from tracediff.diff.pair import Pair
from tracediff.diff.tolerance import failing_rows
from tracediff.trace.reader import Trace

SHIFTS = (1, -1, 2, -2, 3, -3)
SAMPLE_ROWS = 32


def position_shift(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    first = comparison.first_divergence
    if first is None or first.dtypes is None:  # a divergence has rows, so dtypes
        return []
    dtypes = first.dtypes
    plan = comparison.plan
    tensor = next(t for t in plan.tensors if t.name == first.name)
    keys = tensor.keys
    sample = failing_sample(comparison, first.name).map(lambda rows: rows[:SAMPLE_ROWS])
    rows_a = sample.a
    index_b = RowIndex.of(keys.b, plan.prefixes.b, first.name)
    values_a = values(traces.a, keys.a, rows_a)
    labels = side_labels(traces)
    if "position" in first.name and len(rows_a):
        values_b = values(traces.b, keys.b, sample.b)
        offset = _constant_offset(values_a, values_b)
        if offset:
            return [Diagnosis("position_shift", f"{first.name}: {labels.b} = {labels.a} {offset:+d} on every "
                              f"checked row ({len(rows_a)}): positions are off by {abs(offset)}",
                              ValueOffsetEvidence(first.name, offset, len(rows_a)))]
        step = _offset_per_depth(values_a, values_b, keys.a.depth[rows_a])
        if step:
            message = (f"{first.name}: {labels.b} = {labels.a} {step:+d} x depth on every checked row "
                       f"({len(rows_a)}): one side's draft positions do not advance with depth as the "
                       f"other's do (row t at depth d runs at t + d in SpecForge and SGLang)")
            return [Diagnosis("position_shift", message,
                              ValueOffsetEvidence(first.name, step, len(rows_a), per_depth=True))]
    bounds = comparison.tolerances.bounds(first.name, dtypes, first.worst)
    for k in SHIFTS:
        shifted = keys.a.position[rows_a] + k
        ids, known = prefix_ids(plan.prefixes.a, keys.a.request_code[rows_a], shifted,
                                fed_next(keys.a)[rows_a])
        theirs = np.where(known, index_b.find(key_of(ids, shifted, keys.a.depth[rows_a])), -1)
        mine = np.flatnonzero(theirs >= 0)
        theirs = theirs[mine]
        if len(mine) < max(2, len(rows_a) // 2):
            continue
        metrics = metrics_for(first.name, dtypes, values_a[mine], values(traces.b, keys.b, theirs))
        if failing_rows(metrics, bounds).any():
            continue
        message = (f"{first.name}: {labels.b} at position p{k:+d} equals {labels.a} at position p "
                   f"({len(mine)} of {len(rows_a)} failing rows checked): positions are off by {abs(k)}")
        return [Diagnosis("position_shift", message,
                          RowShiftEvidence(first.name, shift=k, rows_checked=len(mine),
                                           rows_sampled=len(rows_a)))]
    return []


def _constant_offset(a: np.ndarray, b: np.ndarray) -> int:
    """k when b = a + k on every row for one small k != 0, else 0."""
    offsets = np.unique(b - a)
    if len(offsets) != 1 or offsets[0] == 0 or abs(offsets[0]) > max(abs(k) for k in SHIFTS):
        return 0
    return int(offsets[0])


def _offset_per_depth(a: np.ndarray, b: np.ndarray, depth: np.ndarray) -> int:
    """k when b = a + k * depth on every row, for one small k != 0, with a row at depth > 0; else 0."""
    deep = depth > 0
    if not deep.any():
        return 0
    diff = (b.astype(np.int64) - a.astype(np.int64)).reshape(len(depth), -1)
    steps = np.unique(diff[deep] // depth[deep, None])
    if len(steps) != 1 or steps[0] == 0 or abs(steps[0]) > max(abs(k) for k in SHIFTS):
        return 0
    return int(steps[0]) if (diff == steps[0] * depth[:, None]).all() else 0
