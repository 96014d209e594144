"""``make_bundle``: compare two traces once, slice both around what the report points at, check that
the slices reproduce the report, and write it all into a new directory within a size budget, trying
smaller windows until the files on disk fit."""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from tracediff.bundle.budget import file_sizes, human, write_zip
from tracediff.bundle.contents import Bundle, Side
from tracediff.bundle.fingerprint import fingerprint
from tracediff.bundle.markdown import render
from tracediff.bundle.select import RADII, Focus, Window, focus_of, ladder, selections, widened
from tracediff.bundle.stats import trace_stats
from tracediff.bundle.verify import Verification, differences
from tracediff.diff.api import compare
from tracediff.diff.jsonio import to_plain
from tracediff.diff.results import Report
from tracediff.diff.verdict import MIN_COVERAGE
from tracediff.errors import InputError
from tracediff.report.html import render_html
from tracediff.trace.reader import Trace, detect_format, open_trace
from tracediff.trace.slice import slice_trace
from tracediff.trace.storage import by_name

DEFAULT_BUDGET = 1_000_000


@dataclass
class _Options:
    """What compare is run with, on the full traces and on the slices alike."""

    tol: list[str]
    rename: dict[str, str]
    align: str
    min_coverage: float

    def run(self, a: str | Path, b: str | Path) -> Report:
        return compare(a, b, tol=self.tol, rename=self.rename, align=self.align,
                       min_coverage=self.min_coverage, warm=False)

    def flags(self) -> list[str]:
        out = [f for t in self.tol for f in ("--tol", t)]
        out += [f for b, a in self.rename.items() for f in ("--map", f"{b}={a}")]
        out += ["--align", self.align] if self.align != "prefix" else []
        return out + (["--min-coverage", str(self.min_coverage)] if self.min_coverage != MIN_COVERAGE else [])


def make_bundle(a: str | Path, b: str | Path, out: str | Path, *, budget: int = DEFAULT_BUDGET,
                zip: bool = False, tol: list[str] | None = None, rename: dict[str, str] | None = None,
                align: str = "prefix", min_coverage: float = MIN_COVERAGE) -> Bundle:
    """Write the bundle of traces ``a`` (baseline) and ``b`` into the new directory ``out`` (and
    ``out.zip`` with ``zip``), all files together at most ``budget`` bytes on disk (the zip too).

    Raises InputError (one line) for unreadable traces, an ``out`` that exists and is not empty, and a
    budget that not even the smallest bundle fits; nothing is left behind then."""
    out = Path(out)
    zip_path = out.with_name(out.name + ".zip") if zip else None
    _check_output(out, zip_path)
    options = _Options(list(tol or []), dict(rename or {}), align, min_coverage)
    report = options.run(a, b)
    created = not out.exists()
    out.mkdir(exist_ok=True)
    try:
        with open_trace(a) as ta, open_trace(b) as tb:
            maker = _Maker(report, ta, tb, out, options, budget, zip_path)
            maker.commands = _commands(a, b, out, budget, zip, options, maker.files)
            return maker.build()
    except BaseException:
        for path in out.iterdir():
            _remove(path)
        if created:
            out.rmdir()
        if zip_path is not None:
            zip_path.unlink(missing_ok=True)
        raise


def _check_output(out: Path, zip_path: Path | None) -> None:
    if not out.parent.is_dir():
        raise InputError(out, f"directory {out.parent} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(out, "exists and is not an empty directory: a bundle goes into a new one")
    if zip_path is not None and zip_path.exists():
        raise InputError(zip_path, "exists: a bundle never overwrites a file")


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _suffix(trace: Trace) -> str:
    """The inputs' format for the slices: the same as the trace's own."""
    return by_name(detect_format(trace.paths[0])).suffixes[0]


class _Maker:
    """One bundle's construction: fixed files first, then windows tried until one fits."""

    def __init__(self, report: Report, a: Trace, b: Trace, out: Path, options: _Options, budget: int,
                 zip_path: Path | None) -> None:
        self.report, self.traces, self.out, self.options = report, (a, b), out, options
        self.budget, self.zip_path = budget, zip_path
        self.focus = focus_of(report, a, b, options.rename)
        self.stats = trace_stats(a), trace_stats(b)
        self.prints = fingerprint(a), fingerprint(b)
        self.files = {"a": f"a{_suffix(a)}", "b": f"b{_suffix(b)}"}
        self.commands: dict[str, str] = {}
        self.smallest = 0  # the smallest total measured so far, for when nothing fits

    def build(self) -> Bundle:
        (self.out / "report.json").write_text(self.report.to_json())
        (self.out / "report.html").write_text(render_html(self.report), encoding="utf-8")
        windows = ladder(self.focus)
        for k, window in enumerate(windows):
            bundle = self._attempt(window)
            if bundle is None:
                continue
            if k == 0 and not bundle.verification.reproduced and self.report.verdict == "diverged":
                wider = next((w for w in map(self._attempt, widened(self.focus))
                              if w is not None and w.verification.reproduced), None)
                bundle = wider or self._attempt(window)
            if bundle is not None:
                return bundle
        fixed = file_sizes(self.out)
        raise InputError(self.out, f"not even the smallest bundle fits the budget of {human(self.budget)}: "
                                   f"it takes at least {human(self.smallest)} (report.json "
                                   f"{human(fixed['report.json'])} and report.html "
                                   f"{human(fixed['report.html'])} of it); give a larger --budget")

    def _clear(self) -> None:
        for path in self.out.iterdir():
            if path.name not in ("report.json", "report.html"):
                _remove(path)

    def _attempt(self, window: Window) -> Bundle | None:
        """Write the bundle of one window; None when its files (or zip) exceed the budget."""
        self._clear()
        sides = []
        for label, trace, selection, stats, print_ in zip("ab", self.traces, selections(self.focus, window,
                                                          self.options.rename), self.stats, self.prints):
            sliced = slice_trace(trace, self.out / self.files[label], selection)
            summarized = [s.name for s in stats if s.name not in sliced.names]
            sides.append(Side([str(p) for p in trace.paths], self.files[label], selection, sliced, summarized,
                              print_))
        if window.stats:
            kept = {label: [to_plain(s) for s in stats if s.name in side.summarized]
                    for label, stats, side in zip("ab", self.stats, sides)}
            (self.out / "stats.json").write_text(json.dumps(_stats_doc(kept, sides), indent=1))
        if not self._fits(sum(file_sizes(self.out).values()), final=False):  # report.md only adds to it
            return None
        bundle = Bundle(self.out, self.report, self.focus, window, (sides[0], sides[1]), self._verify(),
                        left_out(self.focus, window), self.commands, self.budget, zip=self.zip_path)
        return self._finish(bundle)

    def _verify(self) -> Verification:
        """Compare the slices as the full traces were compared."""
        try:
            check = self.options.run(self.out / self.files["a"], self.out / self.files["b"])
        except InputError as exc:  # e.g. a slice with no rows
            return Verification(None, [f"compare of the slices fails: {exc.problem}"])
        return Verification(check, differences(self.report, check))

    def _finish(self, bundle: Bundle) -> Bundle | None:
        """Write report.md (sized to state its own size) and the zip; None when they break the budget."""
        text, size = "", -1
        for _ in range(8):  # report.md states the total, its own size included: settle on a fixed point
            bundle.files = {**file_sizes(self.out), "report.md": len(text.encode())}
            text = render(bundle)
            if len(text.encode()) == size:
                break
            size = len(text.encode())
        (self.out / "report.md").write_text(text, encoding="utf-8")
        bundle.files = file_sizes(self.out)
        if not self._fits(bundle.total):
            return None
        if self.zip_path is not None:
            bundle.zip_size = write_zip(self.out, self.zip_path)
            if not self._fits(bundle.zip_size):
                self.zip_path.unlink()
                return None
        return bundle

    def _fits(self, size: int, final: bool = True) -> bool:
        """Whether ``size`` is within the budget; the smallest bundle seen is kept for the error
        (a partial bundle's size counts only when it is already over: then it is a lower bound)."""
        fits = size <= self.budget
        if final or not fits:
            self.smallest = min(self.smallest, size) if self.smallest else size
        return fits


def _stats_doc(kept: dict[str, list], sides: list[Side]) -> dict:
    return {label: {"paths": side.paths, "tensors": kept[label]} for label, side in zip("ab", sides)}


def left_out(focus: Focus, window: Window) -> list[str]:
    """What a window leaves out that the default one keeps, one line each."""
    if window.wide:
        return []
    lines = []
    if window.radius < RADII[0] and not focus.centred:
        lines.append(f"positions from {2 * window.radius + 1} on (the default keeps {2 * RADII[0] + 1})")
    elif window.radius < RADII[0]:
        lines.append(f"positions more than {window.radius} from the first divergence's ({focus.position}; "
                     f"the default keeps {RADII[0]} each side)")
    if window.extra_depths < 1:
        lines.append(f"draft depths past {focus.depth}")
    if window.deps < len(focus.deps):
        lines.append("tensors the first divergence depends on: " + ", ".join(focus.deps[window.deps:]))
    if not window.evidence and focus.evidence:
        lines.append("tensors the diagnoses read: " + ", ".join(focus.evidence))
    if not window.stats:
        lines.append("stats.json (summary statistics of the tensors not sliced)")
    return lines


def _commands(a: str | Path, b: str | Path, out: Path, budget: int, zip: bool, options: _Options,
              files: dict[str, str]) -> dict[str, str]:
    """What each reproduce command does -> the command, shell-quoted."""
    flags = options.flags()
    made = ["tracediff", "bundle", str(a), str(b), "-o", str(out), "--budget", str(budget),
            *(["--zip"] if zip else []), *flags]
    return {"In this directory, the slices": shlex.join(["tracediff", "compare", files["a"], files["b"],
                                                        *flags]),
            "The full traces, as the bundle compared them": shlex.join(["tracediff", "compare", str(a),
                                                                       str(b), *flags]),
            "The command that made this bundle": shlex.join(made)}
