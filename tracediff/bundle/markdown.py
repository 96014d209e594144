"""report.md: a bundle as a GitHub issue body. The verdict and whether the slices reproduce it first,
then the commands to reproduce, both environments, the compare report (``to_markdown`` of the typed
Report: nothing recomputed) and what the bundle holds and leaves out. Text from a trace is data: in
this file's own sections it is always a code span (never markup, never an @mention or #reference), in
table cells with its ``|`` escaped.

A GitHub issue body holds 65,536 characters: report.md stays under ``LIMIT``. When the whole of it
would not, it is shortened step by step (``CUTS``): lists of names first, then the compare report's
per-tensor table (every tensor that did not match and what the first divergence depends on, then
fewer), each time saying what was left to report.json / report.html (which hold everything)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tracediff.bundle.contents import Bundle, BundleSide
from tracediff.bundle.fingerprint import NOT_RECORDED
from tracediff.bundle.select import Focus
from tracediff.bundle.verify import short_depths, short_tensors
from tracediff.diff.results import Report
from tracediff.eagle3.explanation import Explanation
from tracediff.report.compare import cell, to_markdown, where
from tracediff.sizes import human
from tracediff.text import code, md, safe
from tracediff.trace.slice import SlicePart

ENVIRONMENT = ("source", "target model", "torch", "transformers", "sglang", "specforge", "tracediff",
               "python", "cuda", "device", "dtype", "attention backend", "TP size", "world size",
               "speculative arguments", "aux layer ids", "aux layer convention", "integration", "platform",
               "created")
WIDENED = {"names": "every tensor in the window", "requests": "every row of the requests involved",
           "all": "the whole traces"}
PRIVATE = ("> **Check before posting publicly**: this bundle holds what the traces recorded about where "
           "they ran: local paths, the hostname, process ids, request ids and the run metadata (in "
           "report.md, report.json, report.html, stats.json and the slices).")
TRIMMED = ("report.json", "report.html")  # what may lack profiles
FILES = {"report.json": "the full compare as JSON (docs/REPORT.md; `tracediff.Report.from_json` reads it)",
         "report.html": "the full compare as a page", "report.md": "this file",
         "stats.json": "summary statistics (full traces) of the tensors the slices leave out",
         "explain.json": "which input costs how many accepted tokens, as JSON (docs/EXPLAIN.md; "
                         "`tracediff.Explanation.from_json` reads it)",
         "explain.html": "the explanation as a page: a bar per run"}


LIMIT = 60_000  # characters of report.md (GitHub's limit for an issue body is 65,536)
ALIGNED = {"prefix": "token prefix, position and draft depth",
           "step": "step, position, draft depth and order (the same producer on both sides)"}


@dataclass(frozen=True)
class Cut:
    """How much of report.md is left to report.json / report.html; None: nothing of that."""

    matched: bool = True  # the compare table lists tensors that matched (that are not part of the focus)
    others: int | None = None  # tensors that did not match (outside the focus) the table lists at most
    focus: int | None = None  # tensors of the focus (the first divergence, what it depends on, ...) at most
    names: int | None = None  # names a list of this file's own shows at most
    reasons: int | None = None  # the compare's reasons listed at most

    @property
    def table_cut(self) -> bool:
        return not self.matched or self.others is not None or self.focus is not None


CUTS = (Cut(), Cut(names=30), Cut(matched=False, names=30),
        Cut(matched=False, others=50, names=10, reasons=20),
        Cut(matched=False, others=0, focus=20, names=5, reasons=5))


def fenced(text: str, lang: str = "sh") -> list[str]:
    """A code block that no backtick run in ``text`` can end."""
    fence = "```"
    while fence in text:
        fence += "`"
    return [fence + lang, text, fence]


def _value(value: Any) -> str:
    if value is None:
        return f"*{NOT_RECORDED}*"
    return cell(value if isinstance(value, str) else json.dumps(value, sort_keys=True))


def _data(value: Any, cut: Cut = CUTS[0]) -> str:
    """A value from a trace or a report in prose: a code span (no markup, no @mention); a list shows
    ``cut.names`` items at most."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        shown = value if cut.names is None else value[:cut.names]
        more = f" and {len(value) - len(shown)} more" if len(shown) < len(value) else ""
        return "(" + ", ".join(_data(v) for v in shown) + more + ")" if value else "none"
    return code(value)


def _codes(names: list[str], cut: Cut, where: str) -> str:
    """Names as code spans, ``cut.names`` at most, then how many more and ``where`` they are all."""
    shown = names if cut.names is None else names[:cut.names]
    more = f" and {len(names) - len(shown)} more ({where})" if len(shown) < len(names) else ""
    return ", ".join(code(n) for n in shown) + more


def _headline(bundle: Bundle, cut: Cut) -> list[str]:
    report, first = bundle.report, bundle.report.first_divergence
    lines = [f"# tracediff bundle: {report.verdict}", "", PRIVATE, ""]
    if cut != CUTS[0]:
        lines += [f"> Shortened to {LIMIT} characters at most (a GitHub issue body holds 65,536): each "
                  "shortened list or table says what it leaves out; report.json and report.html hold it all.",
                  ""]
    if first is not None:
        lines += [f"First diverging tensor {code(first.name)} ({where(first.row, code)}).", ""]
    errors = [d for d in report.diagnoses if d.severity == "error"]
    lines += [f"- why: **{d.kind}**: {code(d.message)}" for d in errors]
    lines += [f"- warning: **{d.kind}**: {code(d.message)}" for d in report.diagnoses
              if not errors and d.severity == "warning"]
    lines += [f"- {report.verdict}: {code(r)}" for r in report.reasons[:3]]
    lines += [""] if lines[-1] else []
    return [*lines, f"Rows aligned by {ALIGNED.get(report.align, code(report.align))} "
                    f"({code('--align ' + report.align)}).", ""]


def _tried(bundle: Bundle) -> str:
    if not bundle.widened:
        return ""
    return " Wider slices tried first: " + "; ".join(f"{WIDENED[w]} ({outcome})"
                                                     for w, outcome in bundle.widened.items()) + "."


def _reproduction(bundle: Bundle, cut: Cut) -> list[str]:
    check, report = bundle.verification, bundle.report
    said = check.report
    if check.reproduced and said is not None:
        kinds = ", ".join(d.kind for d in said.diagnoses) or "none"
        listed = _codes(short_tensors(said), cut, "report.json lists them")
        depths = short_depths(said)
        short = "".join((f", tensors compared too little ({listed})" if short_tensors(said) else "",
                         f", draft depths never compared ({', '.join(map(str, depths))})" if depths else "")
                        ) if said.verdict == "incomplete" else ""
        what = "first diverging tensor and row" if report.first_divergence is not None else \
            "the same text edit" if report.text_edit is not None else "no divergence"
        wider = bundle.window.wide and (f" A slice of the default window did not reproduce it, so the slices "
                                        f"hold {WIDENED[bundle.window.wide]}.")
        lines = [f"**Reproduced on the slices**: `tracediff compare` on this bundle's slices gives the same "
                 f"verdict ({said.verdict}), {what}{short}, and diagnoses with the same evidence ({kinds})."
                 f"{wider or ''}{_tried(bundle)}", ""]
    else:
        lines = ["**Not reproduced on the slices**: `tracediff compare` on this bundle's slices differs from "
                 "the compare of the full traces:", "",
                 *[f"- {md(d.what)}: {_data(d.slices, cut)} on the slices, {_data(d.full, cut)} on the full "
                   "traces" for d in check.differences], "",
                 f"Use the full traces to reproduce (commands below).{_tried(bundle)}", ""]
    if report.first_divergence is None and report.text_edit is not None:
        lines[0] = (f"The full compare found that the sides were fed other text ({report.verdict}): the "
                    f"slices hold the request pair it names. " + lines[0])
    elif report.first_divergence is None:
        held = "the rows of the tensors compared too little" if bundle.focus.short else \
            "the start of one request pair"
        lines[0] = (f"The full compare found no divergence ({report.verdict}): the slices hold {held}, for a "
                    f"look at the data. " + lines[0])
    return lines


def explanation_section(explanation: Explanation | None) -> list[str]:
    """explain's section: the draft replayed on both traces' inputs and the swaps (full traces)."""
    if explanation is None:
        return []
    from tracediff.report.explain import explanation_markdown

    return ["## Explain: which input costs acceptance (full traces)", "",
            "The draft checkpoint replayed teacher-forced on A's inputs, on B's, and with each input group "
            "taken from the other side (`tracediff explain`; explain.json and explain.html hold it).", "",
            explanation_markdown(explanation).rstrip("\n"), ""]


def _commands(bundle: Bundle) -> list[str]:
    lines = ["## Reproduce", ""]
    for what, command in bundle.commands.items():
        lines += [f"{what}:", "", *fenced(safe(command)), ""]
    return lines


def _environment(bundle: Bundle) -> list[str]:
    a, b = bundle.sides
    lines = ["## Environment", "", "As each trace's run metadata and contract state it.", "",
             f"| | a: {_value(a.fingerprint.facts.get('source'))} | "
             f"b: {_value(b.fingerprint.facts.get('source'))} |",
             "|---|---|---|"]
    for fact in ENVIRONMENT:
        shown = (_value(side.fingerprint.facts.get(fact)) for side in (a, b))
        lines.append(f"| {fact} | {' | '.join(shown)} |")
    lines.append(f"| tensor dtypes | {_value(a.fingerprint.tensor_dtypes)} | "
                 f"{_value(b.fingerprint.tensor_dtypes)} |")
    return [*lines, ""]


def _where(side: BundleSide) -> str:
    """Which rows a side's selection keeps, for a table cell."""
    sel = side.selection
    if sel.requests is None and sel.positions is None and sel.names is None:
        return "the whole trace"
    where_ = []
    if sel.requests is not None:
        where_.append(("requests " if len(sel.requests) > 1 else "request ")
                      + ", ".join(cell(r) for r in sel.requests))
    if sel.positions is not None:
        where_.append("positions " + ", ".join(str(s) for s in sel.positions))
    if sel.depths is not None:
        where_.append("depths " + ", ".join(str(s) for s in sel.depths))
    return "; ".join(where_) or "every row"


def _holds(label: str, side: BundleSide, part: SlicePart) -> str:
    """One slice file's row of the table: what it holds (per rank file, its own counts)."""
    ranked = len(side.sliced.parts) + len(side.sliced.empty) > 1
    rank = f" (rank file {part.part})" if ranked else ""
    return f"{label}'s slice{rank}: {part.describe()} ({_where(side)})"


def _contents(bundle: Bundle, cut: Cut) -> list[str]:
    zipped = "" if bundle.zip is None else f" Also zipped as {code(bundle.zip.name)}, within the budget too."
    lines = ["## This bundle", "", f"{bundle.total} bytes ({human(bundle.total)}) in {len(bundle.files)} "
             f"files, within the budget of {bundle.budget} bytes ({human(bundle.budget)})."
             f"{zipped} The budget bounds the directory's files together, and with `--zip` the zip on its "
             "own too.", "", "| file | size | holds |", "|---|---|---|"]
    slices = {}
    for label, side in zip("ab", bundle.sides):
        for part in side.sliced.parts:
            slices[part.path.name] = _holds(label, side, part)
    trimmed = f", less the error profiles of {len(bundle.profiles_dropped)} tensors (see Left out)" \
        if bundle.profiles_dropped else ""
    for name, size in bundle.files.items():
        about = slices.get(name) or FILES.get(name, "") + (trimmed if name in TRIMMED else "")
        lines.append(f"| {cell(name)} | {size} bytes | {about} |")
    empty = [f"- {code(path.name)} is not written: {label}'s slice keeps nothing of that rank file (the "
             f"others read as {code(side.file)} alone)"
             for label, side in zip("ab", bundle.sides) for path in side.sliced.empty]
    lines += ["", *empty] if empty else []
    lines += ["", "<details><summary>Tensors in the slices and in stats.json</summary>", ""]
    for label, side in zip("ab", bundle.sides):
        lines.append(f"- {label} ({' '.join(code(p) for p in side.paths)}): sliced "
                     f"{_codes(side.sliced.names, cut, 'the slice holds them') or 'none'}")
        if side.summarized and bundle.window.stats:
            listed = _codes(side.summarized, cut, "stats.json lists them")
            lines.append(f"  - summarized in stats.json: {listed}")
        elif side.summarized:
            lines.append(f"  - neither sliced nor summarized (stats.json was left out to fit the budget): "
                         f"{_codes(side.summarized, cut, 'report.json lists every tensor')}")
    lines += ["", "</details>", ""]
    lines += ["### Left out", ""]
    left = [f"- to fit the budget: {md(line.what)}{_codes(line.names, cut, 'report.json lists every tensor')}"
            for line in bundle.left_out]
    if bundle.profiles_dropped:
        left.append(f"- to fit the budget: the error profiles (heatmap cells) of "
                    f"{len(bundle.profiles_dropped)} tensors in report.json and report.html (the rest of "
                    f"their results is kept): "
                    f"{_codes(bundle.profiles_dropped, cut, 'report.json has no profile for them')}")
    lines += left or ["- nothing to fit the budget"]
    summary = "their summary statistics are in stats.json" if bundle.window.stats else "stats.json left out"
    lines += ["- by design: rows outside the window above, and every row of the tensors not sliced "
              f"({summary})", ""]
    return lines


def _focus(report: Report, focus: Focus) -> list[str]:
    """The tensors a shortened compare table keeps first: the first divergence, the tensors compared
    too little, the diagnoses' evidence, what the first divergence depends on (nearest first)."""
    names = {t.name for t in report.tensors}
    return [n for n in dict.fromkeys([*([focus.tensor] if focus.tensor else []), *focus.short,
                                      *focus.evidence, *focus.deps]) if n in names]


def compare_section(report: Report, focus: Focus, cut: Cut) -> list[str]:
    """The compare report of the full traces, its per-tensor table and reasons cut as ``cut`` says
    (a line says what the table leaves to report.json / report.html)."""
    lines = ["## The compare report (full traces)", ""]
    if not cut.table_cut and cut.reasons is None:
        return [*lines, to_markdown(report).rstrip("\n"), ""]
    core = _focus(report, focus)
    kept = set(core if cut.focus is None else core[:cut.focus])
    others = [t.name for t in report.tensors if t.name not in kept and (cut.matched or t.status != "match")]
    kept |= set(others if cut.others is None else others[:cut.others])
    shown = [t for t in report.tensors if t.name in kept]
    reasons = report.reasons if cut.reasons is None else report.reasons[:cut.reasons]
    left = Counter(t.status for t in report.tensors if t.name not in kept)
    if left:
        focused = "the first divergence, what it depends on" if report.first_divergence is not None else \
            "the tensors compared too little"
        focused += " and the diagnoses' evidence" + ("" if cut.focus is None else f" ({cut.focus} at most)")
        rest = "every other tensor that did not match" if cut.others is None else \
            f"up to {cut.others} other tensors that did not match" if cut.others else ""
        what = f"{focused}, {rest}" if rest else focused
        lines += [f"The per-tensor table below lists {len(shown)} of the {len(report.tensors)} tensors "
                  f"({what}); the other {sum(left.values())} ("
                  + ", ".join(f"{n} {status}" for status, n in sorted(left.items()))
                  + ") are in report.json and report.html, with every tensor's row.", ""]
    if len(reasons) < len(report.reasons):
        lines += [f"The list below shows {len(reasons)} of the compare's {len(report.reasons)} reasons; "
                  "report.json holds them all.", ""]
    trimmed = dataclasses.replace(report, tensors=shown, reasons=reasons)
    return [*lines, to_markdown(trimmed).rstrip("\n"), ""]


def least_compare(report: Report, focus: Focus) -> int:
    """Bytes report.md's compare section takes at least (cut the most): a floor for the budget."""
    return len("\n".join(compare_section(report, focus, CUTS[-1])).encode())


def compose(bundle: Bundle, cut: Cut) -> str:
    """report.md of a bundle whose files (report.md's own size included) are in ``bundle.files``,
    shortened as ``cut`` says."""
    lines = [*_headline(bundle, cut), *_reproduction(bundle, cut), *explanation_section(bundle.explanation),
             *_commands(bundle),
             *_environment(bundle),
             *compare_section(bundle.report, bundle.focus, cut), *_contents(bundle, cut)]
    return "\n".join(lines) + "\n"


def render(bundle: Bundle) -> str:
    """report.md as the first of ``CUTS`` that keeps it under ``LIMIT`` characters gives it (the last
    one whatever it gives)."""
    for cut in CUTS:
        text = compose(bundle, cut)
        if len(text) <= LIMIT:
            break
    return text
