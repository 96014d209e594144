"""Where an ``incomplete`` compare falls short, for a bundle to slice there: the tensors its reasons
name, and the request pair holding most of their rows that the other side lacks. Read from compare's
own row alignment (``make_plan``, key columns only): a slice of a fully covered request would match.

Coverage is judged on the side with fewer comparable rows, so the rows looked for are that side's
unpaired ones (depth 0, not padding: rows left out by design never count against coverage)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tracediff.bundle.verify import short_tensors
from tracediff.diff.pair import Pair
from tracediff.diff.plan import TensorPlan, make_plan
from tracediff.diff.results import EXCUSED, Report
from tracediff.trace.reader import Trace


@dataclass
class Shortfall:
    tensors: list[str] = field(default_factory=list)  # a's names, as the report orders them
    requests: tuple[str, str] | None = None  # (a's, b's) request holding the most lacking rows
    position: int = 0  # the first lacking row's position in that pair


def shortfall(report: Report, a: Trace, b: Trace, rename: dict[str, str] | None = None) -> Shortfall:
    """The short tensors of ``report`` (compared as it was: same names, same alignment) and where
    their rows fall short; ``requests`` is None when no row is found unpaired (a shape or dtype
    mismatch: every row is short alike)."""
    names = short_tensors(report)
    if not names:
        return Shortfall()
    plan = make_plan(Pair(a, b), rename, report.align)
    eligible = {t.name: _eligible(t.coverage) for t in report.tensors if t.coverage is not None}
    for tensor in plan.tensors:
        if tensor.name in names and tensor.problem is None:
            found = _lacking(tensor, eligible.get(tensor.name, (0, 0)), plan.tensors)
            if found is not None:
                return Shortfall(names, found[0], found[1])
    return Shortfall(names)


def _eligible(coverage) -> tuple[int, int]:
    """Comparable rows per side: rows but those left out by design."""
    return (coverage.rows_a - sum(coverage.skipped_a.get(r, 0) for r in EXCUSED),
            coverage.rows_b - sum(coverage.skipped_b.get(r, 0) for r in EXCUSED))


def _lacking(tensor: TensorPlan, eligible: tuple[int, int],
             every: list[TensorPlan]) -> tuple[tuple[str, str], int] | None:
    """((a's request, b's request), position) of the request with the most unpaired rows on the side
    coverage is judged on (the one with fewer comparable rows; on a tie, the one with more unpaired)."""
    sides = []
    for k, (keys, paired) in enumerate(((tensor.keys.a, tensor.matched.rows.a),
                                        (tensor.keys.b, tensor.matched.rows.b))):
        unpaired = np.ones(len(keys), dtype=bool)
        unpaired[paired] = False
        unpaired &= (keys.position >= 0) & (keys.depth == 0)
        sides.append((eligible[k], -int(unpaired.sum()), k, unpaired))
    for _, missing, k, unpaired in sorted(sides, key=lambda s: s[:3]):
        if not missing:
            continue
        keys = tensor.keys.a if k == 0 else tensor.keys.b
        requests = keys.request[unpaired].astype(str)
        request = Counter(requests.tolist()).most_common(1)[0][0]
        position = int(keys.position[unpaired][requests == request].min())
        partner = _partner(request, k, [tensor, *every])
        if partner is not None:
            return ((request, partner) if k == 0 else (partner, request)), position
    return None


def _partner(request: str, side: int, tensors: list[TensorPlan]) -> str | None:
    """The other side's request most often paired with ``request`` in any tensor's aligned rows."""
    for tensor in tensors:
        keys, rows = (tensor.keys.a, tensor.keys.b), (tensor.matched.rows.a, tensor.matched.rows.b)
        mine, theirs = keys[side].request[rows[side]], keys[1 - side].request[rows[1 - side]]
        hits = theirs[mine.astype(str) == request].astype(str)
        if len(hits):
            return Counter(hits.tolist()).most_common(1)[0][0]
    return None
