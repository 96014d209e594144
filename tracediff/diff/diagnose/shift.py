"""Position shift: one side's rows equal the other side's rows k positions away (same request
tokens, same depth), e.g. ids not shifted left, or hidden states sliced one row off; or a tensor
of positions (RoPE positions) is off by a constant k."""

from __future__ import annotations

import numpy as np

from tracediff.diff.align import RowIndex, fed_next, key_of, prefix_ids
from tracediff.diff.diagnose.evidence import Context, values
from tracediff.diff.diagnose.scale import lengths
from tracediff.diff.findings import Diagnosis, RowShiftEvidence, Side, ValueOffsetEvidence
from tracediff.diff.metrics import metrics_for
from tracediff.diff.pair import Pair
from tracediff.diff.tolerance import failing_rows

SHIFTS = (1, -1, 2, -2, 3, -3)
SIDES: tuple[Side, ...] = ("a", "b")


def position_shift(ctx: Context) -> list[Diagnosis]:
    first = ctx.first
    if first is None or first.dtypes is None:  # a divergence has rows, so dtypes
        return []
    keys, sample, traces = ctx.tensor(first.name).keys, ctx.sample(first.name), ctx.traces
    if "position" in first.name and len(sample.a):
        x = Pair(values(traces.a, keys.a, sample.a), values(traces.b, keys.b, sample.b))
        found = _value_offset(first.name, x, keys.a.depth[sample.a], ctx.labels)
        if found:
            return found
    scaled = lengths(ctx.first_rows) if ctx.first_rows is not None else None
    if scaled is not None and scaled.scaled:
        return []  # one constant factor explains every row at its own position: no shift is needed
    return _row_shift(ctx, sample)


def _value_offset(name: str, x: Pair[np.ndarray], depth: np.ndarray, labels: Pair[str]) -> list[Diagnosis]:
    """A tensor of positions off by a constant, or by a constant per draft depth."""
    offset = _constant_offset(x.a, x.b)
    if offset:
        return [Diagnosis("position_shift", f"{name}: {labels.b} = {labels.a} {offset:+d} on every "
                          f"checked row ({len(depth)}): positions are off by {abs(offset)}",
                          ValueOffsetEvidence(name, offset, len(depth)))]
    step = _offset_per_depth(x.a, x.b, depth)
    if step:
        message = (f"{name}: {labels.b} = {labels.a} {step:+d} x depth on every checked row "
                   f"({len(depth)}): one side's draft positions do not advance with depth as the "
                   f"other's do (row t at depth d runs at t + d in SpecForge and SGLang)")
        return [Diagnosis("position_shift", message,
                          ValueOffsetEvidence(name, step, len(depth), per_depth=True))]
    return []


def _row_shift(ctx: Context, sample: Pair[np.ndarray]) -> list[Diagnosis]:
    """The smallest k for which b's rows at p + k equal a's at p, tried from either side's failing
    rows: a shift confined to a few rows (a chunk boundary feeding one row another token) shows
    from the side whose rows moved, a shifted range from both."""
    first, labels = ctx.first, ctx.labels
    assert first is not None
    keys = ctx.tensor(first.name).keys
    index = keys.zip(ctx.comparison.plan.prefixes).starmap(lambda k, p: RowIndex.of(k, p, first.name))
    decoded = ctx.first_rows if ctx.first_rows is not None else \
        ctx.traces.zip(keys, sample).starmap(values)  # the failing rows, read once for every shift
    for k in SHIFTS:
        for side in SIDES:
            rows = getattr(sample, side)
            held = _shift_holds(ctx, index, side, rows, getattr(decoded, side), k)
            if held:
                message = (f"{first.name}: {labels.b} at position p{k:+d} equals {labels.a} at position p "
                           f"({held} of {len(rows)} failing rows of {getattr(labels, side)} checked): "
                           f"positions are off by {abs(k)}")
                return [Diagnosis("position_shift", message, RowShiftEvidence(
                    first.name, shift=k, rows_checked=held, rows_sampled=len(rows)))]
    return []


def _shift_holds(ctx: Context, index: Pair[RowIndex], side: Side, rows: np.ndarray, decoded: np.ndarray,
                 k: int) -> int:
    """How many failing ``rows`` of ``side`` (``decoded``: their values) equal the other side's rows
    where b at p + k pairs with a at p (from a's rows: b's k positions on; from b's: a's k positions
    back), when at least half of them (and at least one) have such a row and every one of those is
    equal; else 0."""
    first, plan, traces = ctx.first, ctx.comparison.plan, ctx.traces
    assert first is not None and first.dtypes is not None
    keys = ctx.tensor(first.name).keys
    other: Side = "b" if side == "a" else "a"
    mine, their_keys = getattr(keys, side), getattr(keys, other)
    shifted = mine.position[rows] + (k if side == "a" else -k)
    ids, known = prefix_ids(getattr(plan.prefixes, side), mine.request_code[rows], shifted,
                            fed_next(mine)[rows])
    theirs = np.where(known, getattr(index, other).find(key_of(ids, shifted, mine.depth[rows])), -1)
    found = np.flatnonzero(theirs >= 0)
    if not len(found) or len(found) < len(rows) // 2:
        return 0
    own = decoded[found]
    partner = values(getattr(traces, other), their_keys, theirs[found])
    at = Pair(own, partner) if side == "a" else Pair(partner, own)
    metrics = metrics_for(first.name, first.dtypes, at.a, at.b)
    bounds = ctx.comparison.tolerances.bounds(first.name, first.dtypes, first.worst)
    return 0 if failing_rows(metrics, bounds).any() else len(found)


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
