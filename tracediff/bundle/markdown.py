"""report.md: a bundle as a GitHub issue body. The verdict and whether the slices reproduce it first,
then the commands to reproduce, both environments, the compare report (``to_markdown`` of the typed
Report: nothing recomputed) and what the bundle holds and leaves out. Text from a trace is data:
code spans or escaped prose, never markup."""

from __future__ import annotations

import json
from typing import Any

from tracediff.bundle.budget import human
from tracediff.bundle.contents import Bundle, Side
from tracediff.bundle.fingerprint import NOT_RECORDED
from tracediff.report.compare import cell, to_markdown, where
from tracediff.report.text import code, md, safe

ENVIRONMENT = ("source", "target model", "torch", "transformers", "sglang", "specforge", "tracediff",
               "python", "cuda", "device", "dtype", "attention backend", "TP size", "world size",
               "speculative arguments", "aux layer ids", "aux layer convention", "integration", "platform",
               "created")
WIDENED = {"names": "every tensor in the window", "requests": "every row of the requests involved",
           "all": "the whole traces"}
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


def _headline(bundle: Bundle) -> list[str]:
    report, first = bundle.report, bundle.report.first_divergence
    lines = [f"# tracediff bundle: {report.verdict}", ""]
    if first is not None:
        lines += [f"First diverging tensor {code(first.name)} ({where(first.row, md)}).", ""]
    lines += [f"- why: **{d.kind}**: {md(d.message)}" for d in report.diagnoses if d.severity == "error"]
    lines += [f"- {report.verdict}: {md(r)}" for r in report.reasons[:3]]
    return lines + ([""] if lines[-1] else [])


def _reproduction(bundle: Bundle) -> list[str]:
    check, report = bundle.verification, bundle.report
    said = check.report
    if report.first_divergence is None:
        verdict = f"says **{said.verdict}**" if said is not None else "does not run"
        return [f"The full compare found no divergence ({report.verdict}): the slices hold the start of one "
                f"request pair, for a look at the data. `tracediff compare` on them {verdict}"
                f"{'' if check.reproduced else ' (' + md('; '.join(check.differences)) + ')'}.", ""]
    if check.reproduced and said is not None:
        kinds = ", ".join(d.kind for d in said.diagnoses) or "none"
        wider = bundle.window.wide and (f" A slice of the first divergence's window did not reproduce it, so "
                                        f"the slices hold {WIDENED[bundle.window.wide]}.")
        return [f"**Reproduced on the slices**: `tracediff compare` on this bundle's slices gives the same "
                f"verdict ({said.verdict}), first diverging tensor and row, and diagnoses ({kinds})."
                f"{wider or ''}", ""]
    return ["**Not reproduced on the slices**: `tracediff compare` on this bundle's slices differs from the "
            "compare of the full traces:", "", *[f"- {md(line)}" for line in check.differences], "",
            "Use the full traces to reproduce (commands below).", ""]


def _commands(bundle: Bundle) -> list[str]:
    lines = ["## Reproduce", ""]
    for what, command in bundle.commands.items():
        lines += [f"{what}:", "", *fenced(safe(command)), ""]
    return lines


def _environment(bundle: Bundle) -> list[str]:
    a, b = bundle.sides
    lines = ["## Environment", "", "As each trace's run metadata and contract state it.", "",
             f"| | a: {md(a.fingerprint.facts.get('source') or '')} | "
             f"b: {md(b.fingerprint.facts.get('source') or '')} |",
             "|---|---|---|"]
    for fact in ENVIRONMENT:
        shown = (_value(side.fingerprint.facts.get(fact)) for side in (a, b))
        lines.append(f"| {fact} | {' | '.join(shown)} |")
    lines.append(f"| tensor dtypes | {_value(a.fingerprint.tensor_dtypes)} | "
                 f"{_value(b.fingerprint.tensor_dtypes)} |")
    return [*lines, ""]


def _holds(side: Side) -> str:
    sliced, sel = side.sliced, side.selection
    if sel.requests is None and sel.positions is None and sel.names is None:
        return f"the whole trace: {sliced.records} records, {sliced.rows} rows"
    where_ = []
    if sel.requests is not None:
        where_.append("request " + ", ".join(code(r) for r in sel.requests))
    if sel.positions is not None:
        where_.append(f"positions {sel.positions.start}:{sel.positions.stop}")
    if sel.depths is not None:
        where_.append("depths " + ", ".join(str(s) for s in sel.depths))
    return (f"{len(sliced.names)} tensors, {sliced.rows} rows ({'; '.join(where_) or 'every row'}), "
            f"{sliced.tokens} request tokens")


def _contents(bundle: Bundle) -> list[str]:
    zipped = "" if bundle.zip is None else f"; also zipped as {code(bundle.zip.name)}"
    lines = ["## This bundle", "", f"{human(bundle.total)} in {len(bundle.files)} files, within the budget "
             f"of {human(bundle.budget)}{zipped}.", "", "| file | size | holds |", "|---|---|---|"]
    slices = {}
    for label, side in zip("ab", bundle.sides):
        for path in side.sliced.paths:
            slices[path.name] = f"{label}'s slice: {_holds(side)}"
    for name, size in bundle.files.items():
        lines.append(f"| {cell(name)} | {human(size)} | {slices.get(name) or FILES.get(name, '')} |")
    lines += ["", "<details><summary>Tensors in the slices and in stats.json</summary>", ""]
    for label, side in zip("ab", bundle.sides):
        lines.append(f"- {label} ({' '.join(code(p) for p in side.paths)}): sliced "
                     f"{', '.join(code(n) for n in side.sliced.names) or 'none'}")
        if side.summarized:
            where_ = "stats.json" if bundle.window.stats else "nowhere: stats.json was left out"
            lines.append(f"  - summarized in {where_}: {', '.join(code(n) for n in side.summarized)}")
    lines += ["", "</details>", ""]
    lines += ["### Left out", ""]
    lines += [f"- to fit the budget: {md(line)}" for line in bundle.left_out] or ["- nothing to fit the "
                                                                                  "budget"]
    lines += ["- by design: rows outside the window above, and every row of the tensors not sliced (their "
              "summary statistics are in stats.json)", ""]
    return lines


def render(bundle: Bundle) -> str:
    """report.md of a bundle whose files (report.md's own size included) are in ``bundle.files``."""
    lines = [*_headline(bundle), *_reproduction(bundle), *_commands(bundle), *_environment(bundle),
             "## The compare report (full traces)", "", to_markdown(bundle.report).rstrip("\n"), "",
             *_contents(bundle)]
    return "\n".join(lines) + "\n"
