"""Rows that hold NaN/Inf at the same elements with the same values on both sides hold the same
data: they are measured on their finite elements, not reported as NaN. One function, shared by
``compare`` (the differ) and ``show A B`` (the row view), so that both give a row the same metrics."""

from __future__ import annotations

import numpy as np

from tracediff.diff.metrics import Engine
from tracediff.diff.pair import Pair


def measure_finite_parts(decoded: Pair[np.ndarray], suspects: np.ndarray, metrics: dict[str, np.ndarray],
                         name: str, engine: Engine) -> np.ndarray:
    """Overwrite the metrics of suspect rows whose non-finite elements agree on both sides (NaN
    against NaN, the same infinity) with those of their finite elements. ``decoded`` holds the
    suspect rows' values, [len(suspects), elements] per side; ``suspects`` their row numbers into
    ``metrics``. Returns which suspects were so measured again (bool per suspect)."""
    a, b = decoded.a, decoded.b
    if a.shape != b.shape:
        return np.zeros(len(suspects), bool)
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    with np.errstate(invalid="ignore"):
        agree = (finite_a == finite_b) & (finite_a | (np.isnan(a) & np.isnan(b)) | (a == b))
    same = agree.all(axis=1)
    if not same.any():
        return same
    kept = Pair(*(np.where(finite_a[same], x[same], 0) for x in (a, b)))
    again = engine.float_metrics(kept.a, kept.b, logits=name.endswith("logits"))
    for k, v in again.items():
        metrics[k][suspects[same]] = v
    return same
