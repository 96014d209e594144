"""report.md: a bundle as a GitHub issue body. The verdict and whether the slices reproduce it first,
then the commands to reproduce, both environments, the compare report (``to_markdown`` of the typed
Report: nothing recomputed) and what the bundle holds and leaves out. Text from a trace is data: in
this file's own sections it is always a code span (never markup, never an @mention or #reference), in
table cells with its ``|`` escaped."""

from __future__ import annotations

import json
from typing import Any

from tracediff.bundle.budget import human
from tracediff.bundle.contents import Bundle, Side
from tracediff.bundle.fingerprint import NOT_RECORDED
from tracediff.bundle.verify import short_tensors
from tracediff.report.compare import cell, to_markdown, where
from tracediff.report.text import code, md, safe
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
         "stats.json": "summary statistics (full traces) of the tensors the slices leave out"}


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


def _data(value: Any) -> str:
    """A value from a trace or a report in prose: a code span (no markup, no @mention)."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_data(v) for v in value) + ")" if value else "none"
    return code(value)


def _headline(bundle: Bundle) -> list[str]:
    report, first = bundle.report, bundle.report.first_divergence
    lines = [f"# tracediff bundle: {report.verdict}", "", PRIVATE, ""]
    if first is not None:
        lines += [f"First diverging tensor {code(first.name)} ({where(first.row, code)}).", ""]
    lines += [f"- why: **{d.kind}**: {code(d.message)}" for d in report.diagnoses if d.severity == "error"]
    lines += [f"- {report.verdict}: {code(r)}" for r in report.reasons[:3]]
    return lines + ([""] if lines[-1] else [])


def _tried(bundle: Bundle) -> str:
    if not bundle.widened:
        return ""
    return " Wider slices tried first: " + "; ".join(f"{WIDENED[w]} ({outcome})"
                                                     for w, outcome in bundle.widened.items()) + "."


def _reproduction(bundle: Bundle) -> list[str]:
    check, report = bundle.verification, bundle.report
    said = check.report
    if check.reproduced and said is not None:
        kinds = ", ".join(d.kind for d in said.diagnoses) or "none"
        short = f", tensors compared too little ({', '.join(code(n) for n in short_tensors(said))})" \
            if said.verdict == "incomplete" else ""
        what = "first diverging tensor and row" if report.first_divergence is not None else "no divergence"
        wider = bundle.window.wide and (f" A slice of the default window did not reproduce it, so the slices "
                                        f"hold {WIDENED[bundle.window.wide]}.")
        lines = [f"**Reproduced on the slices**: `tracediff compare` on this bundle's slices gives the same "
                 f"verdict ({said.verdict}), {what}{short}, and diagnoses with the same evidence ({kinds})."
                 f"{wider or ''}{_tried(bundle)}", ""]
    else:
        lines = ["**Not reproduced on the slices**: `tracediff compare` on this bundle's slices differs from "
                 "the compare of the full traces:", "",
                 *[f"- {md(d.what)}: {_data(d.slices)} on the slices, {_data(d.full)} on the full traces"
                   for d in check.differences], "",
                 f"Use the full traces to reproduce (commands below).{_tried(bundle)}", ""]
    if report.first_divergence is None:
        held = "the rows of the tensors compared too little" if bundle.focus.short else \
            "the start of one request pair"
        lines[0] = (f"The full compare found no divergence ({report.verdict}): the slices hold {held}, for a "
                    f"look at the data. " + lines[0])
    return lines


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


def _where(side: Side) -> str:
    """Which rows a side's selection keeps, for a table cell."""
    sel = side.selection
    if sel.requests is None and sel.positions is None and sel.names is None:
        return "the whole trace"
    where_ = []
    if sel.requests is not None:
        where_.append(("requests " if len(sel.requests) > 1 else "request ")
                      + ", ".join(cell(r) for r in sel.requests))
    if sel.positions is not None:
        where_.append(f"positions {sel.positions.start}:{sel.positions.stop}")
    if sel.depths is not None:
        where_.append("depths " + ", ".join(str(s) for s in sel.depths))
    return "; ".join(where_) or "every row"


def _holds(label: str, side: Side, part: SlicePart) -> str:
    """One slice file's row of the table: what it holds (per rank file, its own counts)."""
    rank = "" if len(side.sliced.parts) == 1 else f" (rank file {side.sliced.parts.index(part)})"
    return f"{label}'s slice{rank}: {part.describe()} ({_where(side)})"


def _contents(bundle: Bundle) -> list[str]:
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
    lines += ["", "<details><summary>Tensors in the slices and in stats.json</summary>", ""]
    for label, side in zip("ab", bundle.sides):
        lines.append(f"- {label} ({' '.join(code(p) for p in side.paths)}): sliced "
                     f"{', '.join(code(n) for n in side.sliced.names) or 'none'}")
        if side.summarized and bundle.window.stats:
            lines.append(f"  - summarized in stats.json: {', '.join(code(n) for n in side.summarized)}")
        elif side.summarized:
            lines.append(f"  - neither sliced nor summarized (stats.json was left out to fit the budget): "
                         f"{', '.join(code(n) for n in side.summarized)}")
    lines += ["", "</details>", ""]
    lines += ["### Left out", ""]
    left = [f"- to fit the budget: {md(line.what)}{', '.join(code(n) for n in line.names)}"
            for line in bundle.left_out]
    if bundle.profiles_dropped:
        left.append(f"- to fit the budget: the error profiles (heatmap cells) of "
                    f"{len(bundle.profiles_dropped)} tensors in report.json and report.html (the rest of "
                    f"their results is kept): {', '.join(code(n) for n in bundle.profiles_dropped)}")
    lines += left or ["- nothing to fit the budget"]
    summary = "their summary statistics are in stats.json" if bundle.window.stats else "stats.json left out"
    lines += ["- by design: rows outside the window above, and every row of the tensors not sliced "
              f"({summary})", ""]
    return lines


def render(bundle: Bundle) -> str:
    """report.md of a bundle whose files (report.md's own size included) are in ``bundle.files``."""
    lines = [*_headline(bundle), *_reproduction(bundle), *_commands(bundle), *_environment(bundle),
             "## The compare report (full traces)", "", to_markdown(bundle.report).rstrip("\n"), "",
             *_contents(bundle)]
    return "\n".join(lines) + "\n"
