"""compare's report for people: terminal (rich) and Markdown, both rendered from the typed ``Report``
(JSON is ``Report.to_json``). Text that came from a trace (names, requests, contract values) is data:
it goes into rich ``Text`` objects, never into markup, and control characters are shown escaped."""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracediff.diff.contract_diff import cause_of, describe_entry, target_differences
from tracediff.diff.results import (
    REASON_TEXT,
    ContractEntry,
    Coverage,
    Report,
    RowRef,
    TensorResult,
    TraceInfo,
    side_labels,
)
from tracediff.eagle3.chains import UNSCORED
from tracediff.text import code, md, safe

SHOWN = ("max_rel", "cosine", "argmax_agree", "kl", "equal")
NO_EXPLANATION = "no known explanation holds"
COLOR = {"match": "green", "diverged": "bold red", "incomplete": "yellow", "incomparable": "yellow"}
STATUS_STYLE = {"match": "green", "diverged": "bold red", "downstream": "red", "unchecked": "dim",
                "shape_mismatch": "yellow", "dtype_mismatch": "yellow", "mixed_records": "yellow",
                "not_comparable": "yellow"}


def cell(text: Any) -> str:
    """A name as a code span inside a Markdown table cell: a ``|`` would end the cell."""
    return code(text).replace("|", "\\|")


def coverage_line(c: Coverage) -> str:
    """All tensors: distinct rows compared per side, and the least-covered tensor's share."""
    share = None if c.fraction is None else f"{100 * c.fraction:.0f}%"
    pct = "" if share is None else f"; least-covered tensor: {share} of its comparable rows"
    return f"{c.compared_a} of {c.rows_a} rows in a, {c.compared_b} of {c.rows_b} in b{pct}"


def skipped_lines(c: Coverage) -> list[str]:
    """'a: 21 outside the shared token prefix, 3 padding' per side that left rows out."""
    return [f"{side}: " + ", ".join(f"{n} {REASON_TEXT.get(r, r)}" for r, n in reasons.items())
            for side, reasons in (("a", c.skipped_a), ("b", c.skipped_b)) if reasons]


def skipped_by_tensor(report: Report) -> list[tuple[list[str], str]]:
    """(tensor names, what was left out of each) for tensors that left rows out; tensors that left
    out the same rows for the same reasons share a line."""
    groups: dict[str, list[str]] = {}
    for t in report.tensors:
        if t.coverage is not None and (lines := skipped_lines(t.coverage)):
            groups.setdefault("; ".join(lines), []).append(t.name)
    return [(names, line) for line, names in groups.items()]


def where(row: RowRef, text: Callable[[Any], str] = safe) -> str:
    if row.position < 0:  # a static tensor: one row, no request or position
        return f"static tensor, step {row.step_a} / {row.step_b}"
    return (f"request {text(row.request_a)} / {text(row.request_b)}, position {row.position}, "
            f"depth {row.depth}, step {row.step_a} / {row.step_b}")


def next_command(report: Report) -> str | None:
    """The command that shows the first diverging row on both sides (``tracediff show A B``), shell-
    quoted so that it pastes (``shell_word``: control characters in a name, a request or a path as
    escapes); None unless the report diverged. A request may hold rows at several steps (training
    epochs, a retried request id): ``--step`` / ``--step-b`` name the diverging row's, left out only
    at step 0 on both sides, which ``show`` picks by default."""
    first = report.first_divergence
    if first is None or report.verdict != "diverged":
        return None
    paths = [trace_argument(report.a), trace_argument(report.b)]
    if paths[0] is None or paths[1] is None:
        return None
    row = first.row
    argv = ["tracediff", "show", paths[0], paths[1], "--name", first.name]
    name_b = next((b for b, a in report.renamed.items() if a == first.name), first.name)
    argv += ["--name-b", name_b] if name_b != first.name else []
    if row.position >= 0:  # a row tensor: a static one is compared whole
        argv += ["--request", row.request_a]
        argv += ["--request-b", row.request_b] if row.request_b != row.request_a else []
        argv += ["--position", str(row.position)]
        argv += ["--depth", str(row.depth)] if row.depth else []
        argv += ["--step", str(row.step_a)] if row.step_a or row.step_b else []
        argv += ["--step-b", str(row.step_b)] if row.step_b != row.step_a else []
    return " ".join(shell_word(part) for part in argv)


def shell_word(part: str) -> str:
    """One argument as bash and zsh read it back: shlex's quoting for plain text, ANSI-C quoting
    (``$'...'``) for text holding control characters, which it writes as escapes (so the command
    prints as data and pastes as the very same bytes, in any locale; a byte a file name could not
    decode is written back as that byte)."""
    if safe(part) == part:
        return shlex.quote(part)
    out = []
    for c in part:
        if c in "\\'":
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:  # its bytes as \xHH: bash reads \u escapes only in a UTF-8 locale, bytes in any
            out.extend(f"\\x{byte:02x}" for byte in c.encode("utf-8", "surrogateescape"))
    return "$'" + "".join(out) + "'"


def trace_argument(info: TraceInfo) -> str | None:
    """The path that opens this trace again: the file, or the stem ``NAME.EXT`` of its rank files
    ``NAME.rankN.EXT``; None for files that no one path opens together."""
    if len(info.paths) == 1:
        return info.paths[0]
    stems = {re.sub(r"\.rank\d+(\.[^./]*)$", r"\1", p) for p in info.paths}
    return stems.pop() if len(stems) == 1 and stems != set(info.paths) else None


def depth_summary(c: Coverage) -> str:
    """What the verdict rests on per draft depth, when rows of more than one depth were recorded:
    'depth 0: 821 rows, 1: 40, 2-6: none comparable'; empty for a trace of depth 0 alone."""
    if len(c.depths) < 2:
        return ""
    runs: list[tuple[list[int], str]] = []
    for d in c.depths:
        depth = d.depth if d.depth is not None else 0
        side = d.one_sided
        what = str(d.aligned) if d.aligned else f"only {side} recorded" if side else "none comparable"
        if runs and not d.aligned and runs[-1][1] == what and runs[-1][0][-1] == depth - 1:
            runs[-1][0].append(depth)
        else:
            runs.append(([depth], what))
    parts = [(f"{ds[0]}" if len(ds) == 1 else f"{ds[0]}-{ds[-1]}") + f": {what}" for ds, what in runs]
    unit = " rows" if runs[0][1].isdigit() else ""
    return "depth " + parts[0] + unit + "".join(f", {p}" for p in parts[1:])


def headline(report: Report) -> str:
    """The first line: the verdict, what it rests on (per draft depth too), and where it went wrong
    (or why not judged)."""
    first = report.first_divergence
    c = report.coverage
    pct = "" if c.fraction is None else f", coverage {100 * c.fraction:.0f}%"
    depths = depth_summary(c)
    text = f"{report.verdict} ({c.aligned} rows compared{pct}{'; ' + depths if depths else ''})"
    if first is not None and report.verdict != "incomparable":
        text += f": first diverging tensor {safe(first.name)} ({where(first.row)})"
    elif report.reasons and (report.verdict == "incomplete" and (report.a.gaps or report.b.gaps)  # lacking
                             or report.text_edit is not None and report.verdict != "incomplete"):  # texts
        text = f"{report.verdict}: {safe(report.reasons[0])} ({text[len(report.verdict) + 2:]}"
    elif report.reasons:
        text += f": {safe(report.reasons[0])}"
    return text


def lacking_lines(report: Report) -> list[str]:
    """Per side, what its trace lacks of what its run logged (drops, stops, a writer never closed,
    names a producer attached and never recorded), where it costs the verdict: a banner above it."""
    labels = side_labels(report.a, report.b)  # as the reasons name them
    return [safe(gap.line(side)) for side, info in zip(labels, (report.a, report.b)) for gap in info.gaps]


def trace_notes(report: Report) -> list[str]:
    """A warning when both sides are the same file, and per trace what it lacks that the verdict's
    reasons do not say (its gaps, under an incomparable verdict; gaps of tensors the other side lacks
    too), the recording filters its user set, and whether its rows are not keyed by tokens."""
    notes = []
    if report.same_file:
        paths = [" ".join(info.paths) for info in (report.a, report.b)]
        named = paths[0] if paths[0] == paths[1] else " and ".join(paths)
        files = "files" if len(report.a.paths) > 1 else "file"
        notes.append(f"note: a and b are the same {files} ({safe(named)}): the trace is compared with "
                     "itself, which says nothing about another run")
    for side, info in (("a", report.a), ("b", report.b)):
        where = safe(" ".join(info.paths))
        if report.verdict == "incomparable":  # else the reasons say them
            notes += [f"note: {safe(gap.line(side))}" for gap in info.gaps]
        notes += [f"note: {safe(gap.line(side))}; the other side lacks {safe(gap.tensor)} too: not counted"
                  for gap in info.gaps_ignored]
        if info.filtered:
            notes.append(f"note: {side} ({where}) was recorded with {safe(' '.join(info.filtered))}: what "
                         "they left out is not missing")
        if info.row_keys in ("step_position", "mixed"):
            some = "some of its rows" if info.row_keys == "mixed" else "its rows"
            notes.append(f"note: {side} ({where}): {some} carry no token ids and are keyed by step and "
                         "position only: they align with another run of the same program, never by token "
                         "content")
    return notes


def one_sided(report: Report) -> list[str]:
    """The tensors only one side holds: never compared, and outside the coverage figures (trace text
    as is: the caller escapes it for its medium)."""
    lines = []
    for side, status in (("a", "missing_in_b"), ("b", "missing_in_a")):
        names = [t.name for t in report.tensors if t.status == status]
        if names:
            other = "b" if side == "a" else "a"
            what = "tensor" if len(names) == 1 else "tensors"
            lines.append(f"{side}: {len(names)} {what} that {other} lacks ({', '.join(names[:8])}"
                         f"{', ...' if len(names) > 8 else ''})")
    return lines


def unexplained(report: Report) -> bool:
    """A divergence no diagnosis explains (an incomparable pair's rows are not a divergence to explain)."""
    return report.first_divergence is not None and report.verdict == "diverged" \
        and not [d for d in report.diagnoses if d.severity == "error"]


def diagnosis_label(report: Report) -> str:
    """What a diagnosis is to the reader: the cause ("why") of what went wrong, or a remark beside a
    match (e.g. requests on one side with no counterpart)."""
    return "note" if report.verdict == "match" else "why"


def producer(info: TraceInfo) -> str:
    made = f"{info.producer} {info.producer_version}".strip() or "unknown producer"
    torch = f"torch {info.torch} on {info.device}" if info.torch else ""
    run = ", ".join(filter(None, (info.source, f"format v{info.format_version}", torch, info.created)))
    return f"{' '.join(info.paths)}: {made} ({run})"


def _worst(t: TensorResult) -> str:
    return " ".join(f"{k} {t.worst[k]:.3g}" for k in SHOWN if k in t.worst)


def _numbers(row: RowRef) -> str:
    """The first failing row's metrics, for when no diagnosis explains them."""
    return "first failing row: " + ", ".join(f"{k} {v:.4g}" for k, v in row.metrics.items())


def _json(value: Any) -> str:
    return safe(json.dumps(value))


def contract_differences(report: Report) -> list[tuple[ContractEntry, str]]:
    """The differing contract keys with what each can change (the config-cause table), those that
    can change some tensor first, then those that change none by themselves."""
    diff = report.contract
    declared = report.same_target and bool(target_differences(diff))
    described = [(e, describe_entry(e, diff, declared)) for e in diff.differing]
    return sorted(described, key=lambda pair: cause_of(pair[0].key).effect == "none")


def acceptance_lines(report: Report) -> list[str]:
    """Each side's own acceptance estimate (its recorded drafts against its target tokens)."""
    out = []
    for side, info in (("a", report.a), ("b", report.b)):
        acc = info.acceptance
        if acc is not None:
            per_depth = " / ".join("-" if math.isnan(v) else f"{v:.2f}" for v in acc.depth_accuracy)
            over = f"{acc.chains} rows" if acc.scored_on == "every row" else \
                f"{acc.chains} of the server's chains"
            over += f"; {acc.chains_unscored} more unscored: {UNSCORED}" if acc.chains_unscored else ""
            server = "" if acc.server_accept_len is None else \
                f"; the {acc.server_verifies} verifies it recorded (the server's own outcomes) accepted " \
                f"{acc.server_accept_len:.4f}"
            if acc.chains:
                out.append(f"{side}'s recorded drafts would be accepted {acc.expected_accept_len:.2f} tokens "
                           f"per verify (over {over}; accuracy per depth {per_depth}){server}")
            else:  # never a figure over no chain
                out.append(f"{side}'s recorded drafts: no chain scorable (over {over}; accuracy per depth "
                           f"{per_depth}){server}")
    return out


def render(console: Console, report: Report) -> None:
    console.print(Text(headline(report), style=COLOR[report.verdict]))
    for line in acceptance_lines(report):
        console.print(Text(f"acceptance: {line}"))
    console.print(Text(f"compared: {coverage_line(report.coverage)}"))
    for line in skipped_lines(report.coverage):
        console.print(Text(f"  not compared, {line}"))
    for line in one_sided(report):
        console.print(Text(f"  not compared, {safe(line)}"))
    for d in report.diagnoses:
        said = diagnosis_label(report)
        console.print(Text.assemble(f"  {said}: ", (d.kind, "bold"), f": {safe(d.message)}"))
    first = report.first_divergence
    if first is not None and unexplained(report):
        console.print(Text(f"  why: {NO_EXPLANATION}; {_numbers(first.row)}"))
    told = first is None or report.verdict == "incomparable"  # the headline gave the first reason
    for reason in report.reasons[1 if told else 0:]:
        console.print(Text(f"  {report.verdict if told else 'also'}: {safe(reason)}", style="yellow"))
    for line in trace_notes(report):
        console.print(Text(line, style="yellow"))
    if report.contract.differing:
        console.print("contract differences (a | b):")
        for e, what in contract_differences(report):
            line = f"  {safe(e.key)}: {_json(e.a)} | {_json(e.b)} ({safe(what)})"
            console.print(Text(line), soft_wrap=True)
    for side, keys in (("a", report.contract.only_a), ("b", report.contract.only_b)):
        if not keys:
            continue
        console.print(Text(f"contract keys only {side} states: {safe(', '.join(keys))}"), soft_wrap=True)
    table = Table(show_edge=False, header_style="bold")
    for column in ("tensor", "status", "aligned", "rows a / b", "failed", "worst"):
        table.add_column(column, no_wrap=column == "tensor")
    for t in report.tensors:
        c = t.coverage
        table.add_row(Text(safe(t.name)), Text(t.status, style=STATUS_STYLE.get(t.status, "")),
                      "" if c is None else str(c.aligned), "" if c is None else f"{c.rows_a} / {c.rows_b}",
                      str(t.failed), Text("; ".join(filter(None, (_worst(t), safe(t.note))))))
    console.print(table)
    grouped = skipped_by_tensor(report)
    if grouped:
        console.print("rows not compared:")
        for names, line in grouped:
            console.print(Text(f"  {safe(', '.join(names))}: {line}"), soft_wrap=True)
    command = next_command(report)
    if command is not None:
        console.print(Text(f"next: {command}"), soft_wrap=True)  # one line whatever the width: it pastes


def to_markdown(report: Report) -> str:
    first = report.first_divergence
    a, b = (" ".join(code(p) for p in info.paths) for info in (report.a, report.b))
    lines = [f"**tracediff compare**: {a} vs {b}: **{report.verdict}**", ""]
    lacking = [f"> **Partial trace**: {md(line)}." for line in lacking_lines(report)]
    lines += ["\n>\n".join(lacking), ""] if lacking else []  # one quote, a paragraph a gap
    if first is not None:
        lines += [f"First diverging tensor: {code(first.name)} ({where(first.row, code)})", ""]
        command = next_command(report)
        lines += [f"Next: {code(command)}", ""] if command is not None else []
    lines += [f"Acceptance: {line}." for line in acceptance_lines(report)]
    lines += [f"Compared: {coverage_line(report.coverage)}."]
    lines += [f"Compared per draft depth: {depths}."] if (depths := depth_summary(report.coverage)) else []
    lines += [f"Not compared, {line}." for line in skipped_lines(report.coverage)]
    lines += [f"Not compared, {md(line)}." for line in one_sided(report)]
    said = diagnosis_label(report)
    bullets = [f"- {said}: **{d.kind}** ({d.severity}): {md(d.message)}" for d in report.diagnoses]
    if first is not None and unexplained(report):
        bullets += [f"- {NO_EXPLANATION}; {_numbers(first.row)}"]
    label = report.verdict if first is None or report.verdict == "incomparable" else "also"
    bullets += [f"- {label}: {md(r)}" for r in report.reasons]
    bullets += [f"- {md(line)}" for line in trace_notes(report)]
    lines += ["", *bullets] if bullets else []
    lines += ["", "| tensor | status | aligned | rows a / b | failed | worst |", "|---|---|---|---|---|---|"]
    for t in report.tensors:
        c = t.coverage
        lines.append(f"| {cell(t.name)} | {t.status} | {'' if c is None else c.aligned} | "
                     f"{'' if c is None else f'{c.rows_a} / {c.rows_b}'} | {t.failed} | "
                     f"{'; '.join(filter(None, (_worst(t), md(t.note))))} |")
    grouped = skipped_by_tensor(report)
    if grouped:
        lines += ["", "<details><summary>Rows not compared, per tensor</summary>", ""]
        lines += [f"- {', '.join(code(n) for n in names)}: {line}" for names, line in grouped]
        lines += ["", "</details>"]
    if report.contract.differing or report.contract.only_a or report.contract.only_b:
        lines += ["", "<details><summary>Run contracts</summary>", ""]
        lines += [f"- differs: {code(e.key)}: {code(_json(e.a))} | {code(_json(e.b))} ({md(what)})"
                  for e, what in contract_differences(report)]
        lines += [f"- only {side} states {code(k)} = {code(_json(v))}" for side, keys in
                  (("a", report.contract.only_a), ("b", report.contract.only_b)) for k, v in keys.items()]
        lines += ["", "</details>"]
    lines += ["", "<details><summary>Producers</summary>", "", f"- a: {md(producer(report.a))}",
              f"- b: {md(producer(report.b))}", "", "</details>"]
    return "\n".join(lines) + "\n"
