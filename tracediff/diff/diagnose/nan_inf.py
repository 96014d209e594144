"""The first NaN/Inf: which tensor, on which side, at which row produced a non-finite value first."""

from __future__ import annotations

import numpy as np

from tracediff.diff.diagnose.types import Diagnosis
from tracediff.diff.differ import Comparison
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import FLOAT_TAGS
from tracediff.trace.reader import Trace


def nan_inf(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    if comparison.first_divergence is None:
        return []
    sides = traces.map(lambda t: str(t.meta.get("source") or "?"))
    for tensor in comparison.tensors:
        if tensor.name not in comparison.rows or not tensor.dtypes or tensor.dtypes[0] not in FLOAT_TAGS:
            continue
        rows, picked = comparison.rows[tensor.name], comparison.matched[tensor.name]
        for side, label in (("a", sides.a), ("b", sides.b)):
            values = getattr(rows, side).numpy()[getattr(picked, side)]
            bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if bad.any():
                i = int(getattr(picked, side)[int(np.argmax(bad))])
                side_rows = getattr(rows, side)
                where = {"request": str(side_rows.request[i]), "position": int(side_rows.position[i]),
                         "depth": int(side_rows.depth[i]), "step": int(side_rows.step[i])}
                message = (f"first NaN/Inf: {tensor.name} on side {side} ({label}) at request "
                           f"{where['request']}, position {where['position']}, depth {where['depth']}")
                return [Diagnosis("nan_inf", message,
                                  {"tensor": tensor.name, "side": side, "rows_non_finite": int(bad.sum()),
                                   **where})]
    return []
