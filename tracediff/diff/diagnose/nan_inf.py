"""The first NaN/Inf: which tensor, on which side, at which row produced a non-finite value first."""

from __future__ import annotations

from tracediff.diff.diagnose.evidence import Context, row_where
from tracediff.diff.findings import Diagnosis, NonFiniteEvidence


def nan_inf(ctx: Context) -> list[Diagnosis]:
    """The differ notes rows holding NaN/Inf as it reads, in the baseline's execution order; the
    first side and tensor it met is where the non-finite values were produced."""
    comparison = ctx.comparison
    if comparison.first_divergence is None or not comparison.first_non_finite:
        return []
    side, name = next(iter(comparison.first_non_finite.items()))
    tensor = ctx.tensor(name)
    seen = getattr(comparison.tallies[name].non_finite, side)
    where = row_where(getattr(tensor.keys, side), seen.first_row)
    message = (f"first NaN/Inf: {name} on side {side} ({getattr(ctx.labels, side)}) at request "
               f"{where['request']}, position {where['position']}, depth {where['depth']}")
    evidence = NonFiniteEvidence(tensor=name, side=side, rows_non_finite=seen.rows, **where)
    return [Diagnosis("nan_inf", message, evidence)]
