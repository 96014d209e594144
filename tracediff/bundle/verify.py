"""Whether a compare of the slices says what the compare of the full traces said: the same verdict,
first diverging tensor and row, diagnoses (kind, severity and typed evidence: the tensor, side,
slots, the row where it applies, ...), and for an ``incomplete`` verdict the same tensors compared
too little. A bundle states the answer; it never claims a reproduction it did not check.

Evidence fields are checked one by one, each as its dataclass field declares
(``tracediff.diff.findings.Reproduce``, in the field's metadata; exact when undeclared): counts of
the rows a diagnosis read shrink with the slice and are not compared; statistics of those rows (a
lowest cosine, a spread, a fit's residual) are bounded by the thresholds that make the kind hold, so
the kind agreeing is what counts; an estimate (a sampled norm ratio, a fitted weight's mean) agrees
within its declared relative tolerance, or, for the mean of rows that spread, within ``SPREAD_Z``
standard errors of the two means; every other field (names, sides, slots, layers, shifts, d2t
entries, tokens, the request, position, depth and step of the row) must be equal."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tracediff.diff import shortfall
from tracediff.diff.findings import Diagnosis, Evidence, Reproduce, reproduction
from tracediff.diff.results import Report, RowRef

SPREAD_Z = 4.0  # standard errors two estimates of one mean may differ by (the slices read fewer rows)


@dataclass
class Difference:
    """One thing the slices' compare says otherwise: ``what`` is prose, the values are data."""

    what: str
    slices: Any
    full: Any

    def __str__(self) -> str:
        return f"{self.what}: {self.slices} on the slices, {self.full} on the full traces"


@dataclass
class Verification:
    """The slices' compare (None: it could not run, ``differences`` says why) and how it differs from
    the full one (empty: it reproduces it)."""

    report: Report | None
    differences: list[Difference]

    @property
    def reproduced(self) -> bool:
        return self.report is not None and not self.differences


def short_tensors(report: Report) -> list[str]:
    """The tensors an ``incomplete`` verdict rests on: present on both sides and compared too little,
    as its reasons say (``verdict.is_short``)."""
    return shortfall.short_tensors(report.tensors, report.min_coverage)


def short_depths(report: Report) -> list[int]:
    """The draft depths an ``incomplete`` verdict names as never compared (no row aligned there)."""
    return [d.depth for d in report.coverage.depths if not d.aligned and d.depth is not None]


def _row(row: RowRef) -> tuple:
    return row.request_a, row.request_b, row.position, row.depth, row.step_a, row.step_b


ROW_FIELDS = "(request a, request b, position, depth, step a, step b)"


def _agree(rule: Reproduce, full: Any, small: Any, evidence: tuple[Evidence, Evidence]) -> bool:
    if rule.rule == "ignored" or full == small:
        return True
    if isinstance(full, float) and isinstance(small, float):
        if math.isnan(full) and math.isnan(small):
            return True
        return (math.isfinite(full) and math.isfinite(small)  # relative to the full traces' value
                and abs(small - full) <= _tolerance(rule, *evidence) * abs(full))
    return False


def _tolerance(rule: Reproduce, full: Evidence, small: Evidence) -> float:
    """An estimate's relative tolerance: the declared one, or for the mean of rows whose relative
    spread is ``rule.spread``, SPREAD_Z standard errors of the difference of the two means."""
    if rule.rule != "estimate":
        return 0.0
    if rule.spread is None:
        return rule.rel_tol
    spread = max(float(getattr(e, rule.spread)) for e in (full, small))
    rows = [max(int(getattr(e, rule.rows)), 1) for e in (full, small)]
    error = SPREAD_Z * spread * math.sqrt(sum(1 / n for n in rows))
    return max(rule.rel_tol, error) if math.isfinite(error) else rule.rel_tol


def evidence_differences(k: int, full: Diagnosis, small: Diagnosis) -> list[Difference]:
    """How the slices' k-th diagnosis differs from the full one's, field by field, each as its field
    declares (``reproduction``)."""
    label = f"diagnosis {k + 1} ({full.kind})"
    if (small.kind, small.severity) != (full.kind, full.severity):
        return [Difference(f"diagnosis {k + 1}", f"{small.kind} ({small.severity})",
                           f"{full.kind} ({full.severity})")]
    if type(small.evidence) is not type(full.evidence):
        return [Difference(f"{label} evidence", type(small.evidence).__name__, type(full.evidence).__name__)]
    out = []
    for f in dataclasses.fields(full.evidence):
        mine, theirs = getattr(small.evidence, f.name), getattr(full.evidence, f.name)
        if not _agree(reproduction(f), theirs, mine, (full.evidence, small.evidence)):
            out.append(Difference(f"{label} {f.name}", mine, theirs))
    return out


def differences(full: Report, small: Report) -> list[Difference]:
    """What the slices' report says otherwise than the full one (values are trace text as is)."""
    out = []
    if small.verdict != full.verdict:
        out.append(Difference("verdict", small.verdict, full.verdict))
    first, again = full.first_divergence, small.first_divergence
    if (first is None) != (again is None) or (first and again and first.name != again.name):
        out.append(Difference("first diverging tensor", again.name if again else None,
                              first.name if first else None))
    elif first is not None and again is not None and _row(first.row) != _row(again.row):
        out.append(Difference(f"first diverging row {ROW_FIELDS}", _row(again.row), _row(first.row)))
    if len(small.diagnoses) != len(full.diagnoses):
        out.append(Difference("diagnoses", [d.kind for d in small.diagnoses],
                              [d.kind for d in full.diagnoses]))
    else:
        for k, (d_full, d_small) in enumerate(zip(full.diagnoses, small.diagnoses)):
            out += evidence_differences(k, d_full, d_small)
    if full.verdict == "incomplete" and short_tensors(small) != short_tensors(full):
        out.append(Difference("tensors compared too little", short_tensors(small), short_tensors(full)))
    if full.verdict == "incomplete" and short_depths(small) != short_depths(full):
        out.append(Difference("draft depths never compared", short_depths(small), short_depths(full)))
    return out
