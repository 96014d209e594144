"""``make_bundle``: compare two traces once, slice both around what the report points at, check that
the slices reproduce the report, and write it all into a new directory within a size budget.

The budget bounds the directory's files together, and with ``--zip`` the zip on its own too. It is
spent in this order: report.md and the attached report with no tensor's error profile (known before
any slice: a budget they exceed fails at once), then the widest slices that fit (a binary search over
``ladder``'s windows, which shrink monotonically: a handful of slicings, each first bounded from the
key columns alone; a larger budget never gives a narrower window), and what is left on error
profiles, the first luxury to go. A slice that does not reproduce the compare is widened, when a
wider one fits, whatever the verdict. The output location is claimed before the compare runs: one
that cannot be written fails at once.

With an explanation (``tracediff bundle --draft``: explain's replays, run by the caller), the bundle
holds it too: explain.json, explain.html and a section of report.md, a fixed cost like report.md's
(``Explained``)."""

from __future__ import annotations

import json
import shlex
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tracediff.bundle.budget import file_sizes, kilo, write_zip
from tracediff.bundle.contents import Bundle, BundleSide
from tracediff.bundle.fingerprint import fingerprint
from tracediff.bundle.markdown import explanation_section, least_compare, render
from tracediff.bundle.select import Window, focus_of, ladder, left_out, selections, widened
from tracediff.bundle.stats import trace_stats
from tracediff.bundle.trim import Attached, attach, levels
from tracediff.bundle.verify import Difference, Verification, differences
from tracediff.diff.results import Report
from tracediff.diff.verdict import MIN_COVERAGE
from tracediff.eagle3.explanation import Explanation
from tracediff.errors import InputError
from tracediff.jsonio import to_plain
from tracediff.sizes import human
from tracediff.tools.compare import compare
from tracediff.trace.output import check_output, staged_directory, staged_output
from tracediff.trace.reader import Trace, detect_format, open_trace
from tracediff.trace.slice import Selection, planned_bytes, slice_trace
from tracediff.trace.storage import by_name

DEFAULT_BUDGET = 1_000_000
SEARCHES = 4  # binary searches at most: each after the first allows for what report.md (or the zip) took
ROUNDS = 4  # renderings of the smallest bundle at the budget it suggests, until that budget holds it


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


@dataclass(frozen=True)
class Explained:
    """An explanation as the bundle holds it: its files' text (known before any is written) and the
    flags that reproduce it (``tracediff explain A B`` + ``flags``)."""

    explanation: Explanation
    flags: tuple[str, ...]

    def files(self) -> dict[str, str]:
        from tracediff.report.explain_html import render_explain_html

        ex = self.explanation
        return {"explain.json": ex.to_json(), "explain.html": render_explain_html(ex)}


def make_bundle(a: str | Path, b: str | Path, out: str | Path, *, budget: int = DEFAULT_BUDGET,
                zip: bool = False, tol: list[str] | None = None, rename: dict[str, str] | None = None,
                align: str = "prefix", min_coverage: float = MIN_COVERAGE, force: bool = False,
                explained: Explained | None = None, verify: bool = True) -> Bundle:
    """Write the bundle of traces ``a`` (baseline) and ``b`` into the new directory ``out`` (and the zip
    ``zip_path(out)`` with ``zip``): the directory's files together at most ``budget`` bytes on disk,
    and the zip too. Both are built in a staging directory beside them and appear whole
    (``trace/output.py``): the directory first, then the zip.

    Raises InputError (one line) for unreadable traces, an ``out`` that exists and is not empty or
    cannot be written (checked before the compare), a zip that exists (unless ``force``: then a regular
    file is replaced), a link or non-regular file at either, and a budget that not even the smallest
    bundle fits; nothing is left behind then. ``explained``: explain's result, held too."""
    out = Path(out)
    zip_file = zip_path(out) if zip else None
    check_bundle_output(out, zip, [a, b], force)
    with ExitStack() as stack:  # the zip's staging is left last: the directory is published first
        staged_zip = None if zip_file is None else stack.enter_context(staged_output(zip_file, [a, b], force))
        work = stack.enter_context(staged_directory(out, [a, b]))
        options = _Options(list(tol or []), dict(rename or {}), align, min_coverage)
        report = options.run(a, b)
        with open_trace(a, verify=verify) as ta, open_trace(b, verify=verify) as tb:
            maker = _Maker(report, ta, tb, work, options, budget, staged_zip, explained)
            maker.commands = _commands(a, b, out, budget, zip, options, maker.files, explained)
            bundle = maker.build()
    return _published(bundle, work, out, zip_file)


def _published(bundle: Bundle, work: Path, out: Path, zip_file: Path | None) -> Bundle:
    """``bundle`` with the paths it names where the files now are (``out``), not the staging ones."""
    def moved(path: Path) -> Path:
        return out / path.name if path.parent == work else path

    bundle.directory, bundle.zip = out, zip_file
    for side in bundle.sides:
        sliced = side.sliced
        sliced.paths, sliced.empty = [moved(p) for p in sliced.paths], [moved(p) for p in sliced.empty]
        for part in sliced.parts:
            part.path = moved(part.path)
    return bundle


def zip_path(out: Path) -> Path:
    """``DIR.zip`` next to ``DIR``; a directory named ``.`` or ``..`` gives its resolved name."""
    named = out if out.name not in ("", ".", "..") else out.resolve()
    if not named.name:
        raise InputError(out, "has no name to give the zip (DIR.zip): write the bundle into a named "
                              "directory")
    return named.with_name(named.name + ".zip")


def check_bundle_output(out: Path, zip: bool, inputs: list[str | Path], force: bool) -> None:
    """InputError unless ``out`` (and with ``zip`` its zip) can be written as a new bundle: for a
    caller to check before long work of its own (explain's replays), as ``make_bundle`` does."""
    zip_file = zip_path(out) if zip else None
    if not out.parent.is_dir():
        raise InputError(out, f"directory {out.parent} does not exist")
    if not out.is_symlink() and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(out, "exists and is not an empty directory: a bundle goes into a new one")
    check_output(out, inputs, directory=True)  # never through a link
    if zip_file is not None:
        check_output(zip_file, inputs, force)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _suffix(trace: Trace) -> str:
    """The inputs' format for the slices: the same as the trace's own."""
    return by_name(detect_format(trace.paths[0])).suffixes[0]


@dataclass
class _Slices:
    """One window's slices and stats.json, on disk in the bundle directory."""

    window: Window
    sides: tuple[BundleSide, BundleSide]
    bytes: int


class _Maker:
    """One bundle's construction: the fixed cost first, then the widest window that fits, then profiles."""

    def __init__(self, report: Report, a: Trace, b: Trace, out: Path, options: _Options, budget: int,
                 zip_file: Path | None, explained: Explained | None = None) -> None:
        self.report, self.traces, self.out, self.options = report, (a, b), out, options
        self.explanation = None if explained is None else explained.explanation
        self.explain_files = {} if explained is None else explained.files()
        self.budget, self.zip_file = budget, zip_file
        short = report.shortfall  # found from the compare's own plan
        self.focus = focus_of(report, a, b, options.rename, short)
        self.stats = trace_stats(a), trace_stats(b)
        self.prints = fingerprint(a), fingerprint(b)
        self.files = {"a": f"a{_suffix(a)}", "b": f"b{_suffix(b)}"}
        self.commands: dict[str, str] = {}
        self.levels = levels(report, self.focus)
        self.least = len(self.levels) - 1  # the level with no tensor's profile
        self.attached: dict[int, Attached] = {}
        # bytes report.md takes at least, and the explanation's files and section (a fixed cost)
        explained_bytes = len("\n".join(explanation_section(self.explanation)).encode()) + sum(
            len(text.encode()) for text in self.explain_files.values())
        self.md_floor = least_compare(report, self.focus) + explained_bytes
        self.on_disk: _Slices | None = None
        self.checked: dict[tuple[Selection, Selection], Verification] = {}
        self.tried: dict[str, str] = {}  # wider windows tried so far -> outcome (report.md says so)
        self.sizes: dict[Window, int] = {}  # bytes of each window's slices and stats.json, once written
        self.fixed = 0  # what the last bundle _finish gave up on took beside its slices (zip overshoot added)

    def _attach(self, level: int) -> Attached:
        if level not in self.attached:
            self.attached[level] = attach(self.report, self.levels[level])
        return self.attached[level]

    def build(self) -> Bundle:
        """Reproduction first: the window is chosen beside report.json / report.html with no tensor's
        profile, and only the room it leaves goes to profiles (``_finish``)."""
        windows = ladder(self.focus)
        floor = self._attach(self.least).size + self.md_floor
        bundle = self._search(windows, floor) if floor <= self.budget else None
        if bundle is None:
            raise self._too_small(windows)
        return self._widen(bundle, windows, floor)

    def _search(self, windows: list[Window], floor: int) -> Bundle | None:
        """The bundle of the widest window whose slices fit beside ``floor`` bytes: the smallest is
        tried first (none fits if it does not), then a binary search. When report.md (or the zip)
        turns out larger than ``floor`` allowed for, the search runs again with the excess added."""
        for _ in range(SEARCHES):
            def fits(k: int, floor: int = floor) -> bool:
                size = self._size(windows[k], floor)
                return size is not None and size + floor <= self.budget

            if not fits(len(windows) - 1):
                return None
            lo, hi = 0, len(windows) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
            written = self._write(windows[lo], floor)
            assert written is not None  # it fitted
            bundle = self._finish(written)
            if bundle is not None:
                return bundle
            floor = max(floor + 1, self.fixed)
        return None

    def _widen(self, bundle: Bundle, windows: list[Window], floor: int) -> Bundle:
        """``bundle`` if its slices reproduce the compare; else the first wider window that fits and
        reproduces it; else the search's pick again, report.md saying what was tried."""
        if bundle.verification.reproduced:
            return bundle
        for window in widened(self.focus):
            written = self._write(window, floor)
            wider = None if written is None else self._finish(written)
            if wider is not None and wider.verification.reproduced:
                return wider
            self.tried[window.wide] = "does not fit the budget" if wider is None else \
                "does not reproduce it either"
        # the first pick again; report.md now says what was tried, so it may take a smaller window
        again = self._search(windows, floor)
        if again is None:
            raise self._too_small(windows)
        return again

    def _size(self, window: Window, floor: int) -> int | None:
        """Bytes of one window's slices and stats.json on disk (written once, then remembered)."""
        if window not in self.sizes:
            written = self._write(window, floor)
            if written is None:
                return None
        return self.sizes[window]

    def _write(self, window: Window, floor: int | None) -> _Slices | None:
        """Write one window's slices and stats.json (the last one written stays on disk); None, writing
        nothing, when their tensor bytes alone exceed the budget beside ``floor`` bytes."""
        if self.on_disk is not None and self.on_disk.window == window:
            return self.on_disk
        chosen = selections(self.focus, window, self.options.rename)
        if floor is not None and sum(planned_bytes(t, s) for t, s in zip(self.traces, chosen)) + floor \
                > self.budget:
            return None
        self.on_disk = None
        for path in self.out.iterdir():
            _remove(path)
        sides = []
        for label, trace, selection, stats, print_ in zip("ab", self.traces, chosen, self.stats, self.prints):
            sliced = slice_trace(trace, self.out / self.files[label], selection)
            summarized = [s.name for s in stats if s.name not in sliced.names]
            sides.append(BundleSide([str(p) for p in trace.paths], self.files[label], selection, sliced,
                                    summarized, print_))
        if window.stats:
            kept = {label: [to_plain(s) for s in stats if s.name in side.summarized]
                    for label, stats, side in zip("ab", self.stats, sides)}
            (self.out / "stats.json").write_text(json.dumps(_stats_doc(kept, sides), indent=1))
        written = _Slices(window, (sides[0], sides[1]), sum(file_sizes(self.out).values()))
        self.on_disk, self.sizes[window] = written, written.bytes
        return written

    def _verify(self, written: _Slices) -> Verification:
        """Compare the slices on disk as the full traces were compared (once per pair of selections:
        windows that differ in stats.json alone slice alike)."""
        key = (written.sides[0].selection, written.sides[1].selection)
        if key not in self.checked:
            try:
                check = self.options.run(self.out / self.files["a"], self.out / self.files["b"])
                self.checked[key] = Verification(check, differences(self.report, check))
            except InputError as exc:  # e.g. a slice with no rows
                self.checked[key] = Verification(None, [Difference("the compare", f"fails ({exc.problem})",
                                                                   self.report.verdict)])
        return self.checked[key]

    def _bundle(self, written: _Slices, level: int, budget: int | None = None,
                tried: dict[str, str] | None = None) -> tuple[Bundle, str]:
        """The bundle of the slices on disk with report level ``level``, and its report.md (unwritten);
        ``budget`` and ``tried`` as report.md states them (by default this bundle's)."""
        attached = self._attach(level)
        bundle = Bundle(self.out, self.report, self.focus, written.window, written.sides,
                        self._verify(written), left_out(self.focus, written.window), self.commands,
                        self.budget if budget is None else budget, profiles_dropped=attached.dropped,
                        widened=dict(self.tried if tried is None else tried),
                        windows_sliced=len(self.sizes), zip=self.zip_file, explanation=self.explanation)
        sizes = {**file_sizes(self.out), "report.json": len(attached.json.encode()),
                 "report.html": len(attached.html.encode()),
                 **{name: len(text.encode()) for name, text in self.explain_files.items()}}
        return bundle, _settle(bundle, sizes)

    def _finish(self, written: _Slices) -> Bundle | None:
        """Verify the slices, then write report.json / report.html with the most profiles that fit,
        report.md (sized to state its own size) and the zip; None when even no profile breaks the
        budget (``fixed`` says what it took beside the slices)."""
        for level in range(len(self.levels)):
            attached = self._attach(level)
            if written.bytes + attached.size + self.md_floor > self.budget:
                continue
            made, text = self._bundle(written, level)
            self.fixed = made.total - written.bytes
            if made.total > self.budget:
                continue
            (self.out / "report.json").write_text(attached.json)
            (self.out / "report.html").write_text(attached.html, encoding="utf-8")
            (self.out / "report.md").write_text(text, encoding="utf-8")
            for name, content in self.explain_files.items():
                (self.out / name).write_text(content, encoding="utf-8")
            made.files = file_sizes(self.out)
            if self.zip_file is None:
                return made
            made.zip_size = write_zip(self.out, self.zip_file)
            self.fixed += made.zip_size - self.budget
            if made.zip_size <= self.budget:
                return made
            self.zip_file.unlink()
            for name in ("report.json", "report.html", "report.md", *self.explain_files):
                (self.out / name).unlink()
        return None

    def _needs(self, window: Window) -> tuple[Bundle, int]:
        """The bundle of ``window`` with no tensor's profile as report.md states it at the budget that
        holds it, and that budget (whole kB: what the error suggests; report.md states the budget, so
        it is rendered at the one suggested until that one holds it). Slices that do not reproduce the
        compare get report.md's list of the wider ones tried first, as a bundle of them would."""
        written = self._write(window, None)
        assert written is not None  # no floor: always written
        tried = {} if self._verify(written).reproduced else \
            {w.wide: "does not fit the budget" for w in widened(self.focus)}
        budget = self.budget
        for _ in range(ROUNDS):
            bundle, _ = self._bundle(written, self.least, budget=budget, tried=tried)
            if bundle.total <= budget and kilo(bundle.total) == budget:
                break
            budget = kilo(bundle.total)
        return bundle, budget

    def _reproducing(self, windows: list[Window]) -> Window | None:
        """The narrowest window whose slices reproduce the compare, taking reproduction as monotone
        along the ladder (a binary search; wider slices hold what narrower ones do); None when the
        default window's do not."""
        def reproduces(k: int) -> bool:
            written = self._write(windows[k], None)
            assert written is not None  # no floor: always written
            return self._verify(written).reproduced

        if not reproduces(0):
            return None
        lo, hi = 0, len(windows) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if reproduces(mid) else (lo, mid - 1)
        return windows[lo]

    def _too_small(self, windows: list[Window]) -> InputError:
        """The error for a budget below the smallest bundle, with that bundle's exact size (its slices
        written, its report.md rendered: the smallest window and no tensor's profile) and the budget
        that holds it; when its slices do not reproduce the compare, the budget for the smallest whose
        slices do too (or only that one, when it is no larger)."""
        smallest, need = self._needs(windows[-1])
        window = None if smallest.verification.reproduced else self._reproducing(windows)
        enough = None
        if window is not None:
            reproducing, enough = self._needs(window)
            if enough <= need:
                smallest, need, enough = reproducing, enough, None
        files = smallest.files
        fixed = ("report.json", "report.html", "report.md", *self.explain_files)
        slices = smallest.total - sum(files[n] for n in fixed)
        explained = "".join(f", {name} {files[name]}" for name in self.explain_files)
        said = (f"not even the smallest bundle fits the budget of {human(self.budget)} ({self.budget} "
                f"bytes): it takes {smallest.total} bytes (report.json {files['report.json']} and "
                f"report.html {files['report.html']} with no tensor's profile, report.md "
                f"{files['report.md']}{explained}, its slices {slices}; report.md states the budget: its "
                "size at the budget suggested)")
        if smallest.verification.reproduced:
            return InputError(self.out, f"{said}; give --budget {need // 1000}k or more")
        if enough is None:
            return InputError(self.out, f"{said}; give --budget {need // 1000}k or more (its slices do not "
                                        "reproduce the compare, nor do those of the default window)")
        return InputError(self.out, f"{said}, but its slices do not reproduce the compare; give --budget "
                                    f"{enough // 1000}k or more for slices that do, or {need // 1000}k for "
                                    "the smallest bundle")


def _settle(bundle: Bundle, sizes: dict[str, int]) -> str:
    """report.md's text: it states the total, its own size included, so render to a fixed point."""
    text, size = "", -1
    for _ in range(8):
        bundle.files = dict(sorted({**sizes, "report.md": len(text.encode())}.items()))
        text = render(bundle)
        if len(text.encode()) == size:
            break
        size = len(text.encode())
    bundle.files = dict(sorted({**sizes, "report.md": len(text.encode())}.items()))
    return text


def _stats_doc(kept: dict[str, list], sides: list[BundleSide]) -> dict:
    return {label: {"paths": side.paths, "tensors": kept[label]} for label, side in zip("ab", sides)}


def _commands(a: str | Path, b: str | Path, out: Path, budget: int, zip: bool, options: _Options,
              files: dict[str, str], explained: Explained | None = None) -> dict[str, str]:
    """What each reproduce command does -> the command, shell-quoted."""
    flags = options.flags()
    explain_flags = [] if explained is None else list(explained.flags)
    made = ["tracediff", "bundle", str(a), str(b), "-o", str(out), "--budget", str(budget),
            *(["--zip"] if zip else []), *flags, *explain_flags]
    explain = {} if explained is None else {
        "The explanation (the draft replayed on the full traces; the checkpoints are not in the bundle)":
            shlex.join(["tracediff", "explain", str(a), str(b), *explain_flags])}
    return {"In this directory, the slices": shlex.join(["tracediff", "compare", files["a"], files["b"],
                                                        *flags]),
            "The full traces, as the bundle compared them": shlex.join(["tracediff", "compare", str(a),
                                                                       str(b), *flags]),
            **explain, "The command that made this bundle": shlex.join(made)}
