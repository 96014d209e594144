"""Precision only: the rows differ by no more than rounding in the coarser dtype explains."""

from __future__ import annotations

from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.findings import Diagnosis, PrecisionEvidence

EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
ROUNDINGS = 4  # rounding in every op of a few layers adds up to a few eps; a bug is far beyond


def precision(ctx: Context) -> list[Diagnosis]:
    """Run only when no other explanation holds (see ``diagnose``)."""
    first = ctx.first
    if first is None or not first.dtypes or not all(d in EPS for d in first.dtypes) \
            or first.dtypes[0] == first.dtypes[1]:
        return []  # the same dtype on both sides rounds the same way: a difference is real
    coarse = max(first.dtypes, key=EPS.__getitem__)
    worst = first.worst.get("rel_l2")
    limit = ROUNDINGS * EPS[coarse]
    if worst is None or worst > limit or first.worst.get("cosine", 1) < 1 - limit:
        return []
    return [Diagnosis("precision", f"{first.name}: worst rel_l2 {worst:.3g} is within {coarse} rounding "
                      f"({ROUNDINGS} x eps = {limit:.3g}); the sides differ in precision, not in what they "
                      "compute: loosen --tol if that is expected",
                      PrecisionEvidence(first.name, coarse, worst, limit))]
