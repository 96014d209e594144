"""Where an ``incomplete`` compare falls short: the tensors compared too little (``is_short``, the
one rule the verdict and the bundle read), and the request pair holding most of their rows that the
other side lacks, for a bundle to slice there. Found from the compare's own plan (its row
alignment), once, and carried in the Report: a slice of a fully covered request would match.

Coverage is judged on the side with fewer comparable rows, so the rows looked for are that side's
unpaired ones (depth 0, not padding: rows left out by design never count against coverage). A slice
of positions reproduces the shortfall only when it holds unpaired rows of both sides and rows both
sides hold (else the side lacking rows is the smaller one in the slice, and fully covered, or the
slices share no row): ``spots`` are, per side, the unpaired row nearest to a paired one and that
paired row, the places a bundle's narrower slices keep.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from tracediff.diff.plan import Plan, TensorPlan
from tracediff.diff.results import EXCUSED, INCOMPLETE_STATUSES, Shortfall, TensorResult


def is_short(t: TensorResult, min_coverage: float) -> bool:
    """A tensor present on both sides compared too little: a mismatch status, no row aligned, or
    coverage below ``min_coverage``."""
    c = t.coverage
    return t.status in INCOMPLETE_STATUSES[1:] or (c is not None and (
        not c.aligned or (c.fraction or 0.0) < min_coverage))


def short_tensors(tensors: list[TensorResult], min_coverage: float) -> list[str]:
    """The names of the tensors ``is_short``, in the report's order."""
    return [t.name for t in tensors if is_short(t, min_coverage)]


def find_shortfall(tensors: list[TensorResult], plan: Plan, min_coverage: float,
                   lacking: tuple[str, ...] = ()) -> Shortfall:
    """The short tensors and where their rows fall short in ``plan``; ``requests`` is None when no
    row is found unpaired (a shape or dtype mismatch: every row is short alike). ``lacking``: a's
    names of the tensors a side's trace lacks records of (dropped, never recorded): short too, after
    those compared too little, so that a bundle's slices hold them."""
    short = short_tensors(tensors, min_coverage)
    names = short + [t.name for t in tensors if t.name in lacking and t.name not in short]
    if not names:
        return Shortfall()
    eligible = {t.name: _eligible(t.coverage) for t in tensors if t.coverage is not None}
    for tensor in plan.tensors:
        if tensor.name in names and tensor.problem is None:
            found = _lacking(tensor, eligible.get(tensor.name, (0, 0)), plan.tensors)
            if found is not None:
                return Shortfall(names, *found)
    return Shortfall(names)


def _eligible(coverage) -> tuple[int, int]:
    """Comparable rows per side: rows but those left out by design."""
    return (coverage.rows_a - sum(coverage.skipped_a.get(r, 0) for r in EXCUSED),
            coverage.rows_b - sum(coverage.skipped_b.get(r, 0) for r in EXCUSED))


def _lacking(tensor: TensorPlan, eligible: tuple[int, int],
             every: list[TensorPlan]) -> tuple[tuple[str, str], int, list[tuple[int, int]]] | None:
    """((a's request, b's request), the lacking row's position, spots) of the request with the most
    unpaired rows on the side coverage is judged on (the one with fewer comparable rows; on a tie, the
    one with more unpaired): that side's spot first, then the other side's (if it lacks rows of that
    pair too), each as (first, last) position."""
    sides = []
    for k, (keys, paired) in enumerate(((tensor.keys.a, tensor.matched.rows.a),
                                        (tensor.keys.b, tensor.matched.rows.b))):
        unpaired = np.ones(len(keys), dtype=bool)
        unpaired[paired] = False
        unpaired &= (keys.position >= 0) & (keys.depth == 0)
        sides.append((eligible[k], -int(unpaired.sum()), k, unpaired))
    masks = {k: unpaired for _, _, k, unpaired in sides}
    for _, missing, k, unpaired in sorted(sides, key=lambda s: s[:3]):
        if not missing:
            continue
        keys = tensor.keys.a if k == 0 else tensor.keys.b
        requests = keys.request[unpaired].astype(str)
        request = Counter(requests.tolist()).most_common(1)[0][0]
        partner = _partner(request, k, [tensor, *every])
        if partner is not None:
            found = [_spot(tensor, side, r, masks[side]) for side, r in ((k, request), (1 - k, partner))]
            spots = [spot for spot in found if spot is not None]
            pair = (request, partner) if k == 0 else (partner, request)
            return pair, spots[0][0], [(min(spot), max(spot)) for spot in spots]
    return None


def _spot(tensor: TensorPlan, side: int, request: str, unpaired: np.ndarray) -> tuple[int, int] | None:
    """(lacking, held): the positions of one side's unpaired row of ``request`` nearest to a paired row
    of it, and of that paired row (the first unpaired row twice when none is paired); None when none
    is unpaired."""
    keys = tensor.keys.a if side == 0 else tensor.keys.b
    mine = keys.request.astype(str) == request
    lacking = np.unique(keys.position[mine & unpaired])
    if not len(lacking):
        return None
    paired = np.zeros(len(keys), dtype=bool)
    paired[tensor.matched.rows.a if side == 0 else tensor.matched.rows.b] = True
    held = np.unique(keys.position[mine & paired & (keys.depth == 0)])
    if not len(held):
        return int(lacking[0]), int(lacking[0])
    at = np.searchsorted(held, lacking)
    below, above = held[np.maximum(at - 1, 0)], held[np.minimum(at, len(held) - 1)]
    near = np.where(np.abs(lacking - below) <= np.abs(above - lacking), below, above)
    k = int(np.argmin(np.abs(lacking - near)))
    return int(lacking[k]), int(near[k])


def _partner(request: str, side: int, tensors: list[TensorPlan]) -> str | None:
    """The other side's request most often paired with ``request`` in any tensor's aligned rows."""
    for tensor in tensors:
        keys, rows = (tensor.keys.a, tensor.keys.b), (tensor.matched.rows.a, tensor.matched.rows.b)
        mine, theirs = keys[side].request[rows[side]], keys[1 - side].request[rows[1 - side]]
        hits = theirs[mine.astype(str) == request].astype(str)
        if len(hits):
            return Counter(hits.tolist()).most_common(1)[0][0]
    return None
