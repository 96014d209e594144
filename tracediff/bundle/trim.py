"""The compare report a bundle attaches as report.json and report.html. Per-tensor error profiles
(the heatmap cells: up to 256 per draft depth per tensor) are the bulk of both files, and the first
luxury to go: a bundle spends on them only what its slices leave of the budget, keeping all of them,
else the first divergence's (and the tensors an incomplete verdict rests on), the diagnoses' evidence
and the dependencies, else fewer, else none. All else (verdict, coverage, every tensor's status and
worst metrics, diagnoses) is kept; report.md says which profiles were left out. The HTML page is
rendered from the same trimmed report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tracediff.bundle.select import Focus
from tracediff.diff.results import Report
from tracediff.report.html import render_html


@dataclass
class Attached:
    """report.json and report.html of one level, in memory (their size is known before writing)."""

    kept: list[str] | None  # tensors whose profile is kept (None: every one)
    dropped: list[str]  # tensors whose profile was left out
    json: str
    html: str

    @property
    def size(self) -> int:
        return len(self.json.encode()) + len(self.html.encode())


def levels(report: Report, focus: Focus) -> list[list[str] | None]:
    """The profiles each level keeps, richest first (None: all; the last keeps none). Levels that keep
    the same profiles as a richer one are left out."""
    profiled = [t.name for t in report.tensors if t.profile is not None]
    core = [n for n in (focus.tensor, *focus.short) if n is not None]
    wanted: list[list[str] | None] = [None, [*core, *focus.evidence, *focus.deps], [*core, *focus.evidence],
                                      core, []]
    out: list[list[str] | None] = []
    seen: list[frozenset[str]] = []
    for names in wanted:
        kept = frozenset(profiled if names is None else [n for n in names if n in profiled])
        if kept not in seen:
            seen.append(kept)
            out.append(None if kept == frozenset(profiled) else [n for n in profiled if n in kept])
    return out


def attach(report: Report, kept: list[str] | None) -> Attached:
    """The report with the profiles of the tensors not in ``kept`` removed, as JSON and HTML."""
    if kept is None:
        return Attached(None, [], report.to_json(), render_html(report))
    keep = set(kept)
    dropped = [t.name for t in report.tensors if t.profile is not None and t.name not in keep]
    tensors = [t if t.name in keep else dataclasses.replace(t, profile=None) for t in report.tensors]
    trimmed = dataclasses.replace(report, tensors=tensors)
    return Attached(kept, dropped, trimmed.to_json(), render_html(trimmed))
