"""Whether a compare of the slices says what the compare of the full traces said: the same verdict,
first diverging tensor and row, and diagnosis kinds. A bundle states the answer; it never claims a
reproduction it did not check."""

from __future__ import annotations

from dataclasses import dataclass

from tracediff.diff.results import Report, RowRef


@dataclass
class Verification:
    """The slices' compare (None: it could not run, ``differences`` says why) and how it differs from
    the full one (empty: it reproduces it)."""

    report: Report | None
    differences: list[str]

    @property
    def reproduced(self) -> bool:
        return not self.differences


def _row(row: RowRef) -> tuple:
    return row.request_a, row.request_b, row.position, row.depth


def differences(full: Report, small: Report) -> list[str]:
    """What the slices' report says otherwise than the full one, one line each (trace text as is)."""
    out = []
    if small.verdict != full.verdict:
        out.append(f"verdict: {small.verdict} on the slices, {full.verdict} on the full traces")
    first, again = full.first_divergence, small.first_divergence
    if (first is None) != (again is None) or (first and again and first.name != again.name):
        out.append(f"first diverging tensor: {again.name if again else 'none'} on the slices, "
                   f"{first.name if first else 'none'} on the full traces")
    elif first is not None and again is not None and _row(first.row) != _row(again.row):
        out.append(f"first diverging row: {_row(again.row)} on the slices, {_row(first.row)} on the full "
                   "traces (request a, request b, position, depth)")
    kinds, kinds_again = [d.kind for d in full.diagnoses], [d.kind for d in small.diagnoses]
    if kinds != kinds_again:
        out.append(f"diagnoses: {', '.join(kinds_again) or 'none'} on the slices, "
                   f"{', '.join(kinds) or 'none'} on the full traces")
    return out
