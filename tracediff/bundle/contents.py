"""What a bundle holds, as plain data: ``make_bundle`` returns it and report.md is rendered from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tracediff.bundle.fingerprint import Fingerprint
from tracediff.bundle.select import Focus, LeftOut, Window
from tracediff.bundle.verify import Verification
from tracediff.diff.results import Report
from tracediff.eagle3.explanation import Explanation
from tracediff.trace.slice import Selection, SliceResult


@dataclass
class BundleSide:
    """One trace's part of a bundle."""

    paths: list[str]  # the full trace's files
    file: str  # its slice in the bundle directory, e.g. "a.h5"
    selection: Selection
    sliced: SliceResult
    summarized: list[str]  # tensors left out of the slice, summarized in stats.json (if kept)
    fingerprint: Fingerprint


@dataclass
class Bundle:
    directory: Path
    report: Report  # the full traces' compare
    focus: Focus
    window: Window
    sides: tuple[BundleSide, BundleSide]
    verification: Verification  # the slices' compare
    left_out: list[LeftOut]  # what the budget made the slices leave out
    commands: dict[str, str]  # what each reproduce command does -> the command (shell-quoted)
    budget: int
    profiles_dropped: list[str] = field(default_factory=list)  # tensors whose profile report.json/html lack
    widened: dict[str, str] = field(default_factory=dict)  # wider window tried ('names', ...) -> outcome
    windows_sliced: int = 0  # windows sliced to find this one (the search's work)
    files: dict[str, int] = field(default_factory=dict)  # file -> bytes, report.md included
    zip: Path | None = None
    zip_size: int | None = None
    explanation: Explanation | None = None  # explain's result (``bundle --draft``), in explain.json/html

    @property
    def total(self) -> int:
        return sum(self.files.values())
