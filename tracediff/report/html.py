"""compare's report as one self-contained HTML page: inline CSS and SVG, no script, no network (a
Content-Security-Policy forbids both), so it opens the same anywhere and can be attached to a bug.

A pure function of the typed ``Report``: the page re-runs nothing. Every piece of text from a trace
(names, requests, messages, contract values) goes through ``esc``: it is data, never markup."""

from __future__ import annotations

from pathlib import Path

from tracediff.diff.findings import Diagnosis
from tracediff.diff.results import Report
from tracediff.report.compare import (
    NO_EXPLANATION,
    acceptance_lines,
    coverage_line,
    depth_summary,
    diagnosis_label,
    lacking_lines,
    next_command,
    one_sided,
    producer,
    skipped_by_tensor,
    skipped_lines,
    trace_notes,
    unexplained,
    where,
)
from tracediff.report.html_curves import curves_html
from tracediff.report.html_heatmap import heatmap_svg
from tracediff.report.html_parts import contract_html, slot_evidence, slot_matrix, tensor_table, tokens_html
from tracediff.report.html_style import CSS
from tracediff.report.svg import divergence, esc, num
from tracediff.trace.output import staged_output

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
FIRST_METRICS = ("cosine", "rel_l2", "max_rel", "max_abs", "argmax_agree", "kl", "equal")
LISTED = 8  # names a note lists


def _files(report: Report) -> str:
    def side(label: str, paths: list[str], source: str) -> str:
        files = " ".join(f"<code>{esc(p)}</code>" for p in paths)
        return f"{label} {files}" + (f" ({esc(source)})" if source else "")

    a, b = side("a", report.a.paths, report.a.source), side("b", report.b.paths, report.b.source)
    return f"{a} &nbsp;vs&nbsp; {b}"


def _header(report: Report) -> str:
    first, c = divergence(report), report.coverage
    pct = "" if c.fraction is None else f", least-covered tensor {100 * c.fraction:.0f}%"
    rested = f"{c.aligned} row pairs compared{pct}"
    verdict = esc(report.verdict)
    lines = []
    if first is not None:
        title = f"first divergence in <code>{esc(first.name)}</code>"
        lines.append(f'<p class="where">at {esc(where(first.row))}</p>')
        shown = [(k, first.row.metrics[k]) for k in FIRST_METRICS if k in first.row.metrics]
        if shown:
            spans = "".join(f"<span>{esc(k)} <b>{num(v, 4)}</b></span>" for k, v in shown)
            lines.append(f'<p class="metrics">{spans}</p>')
    elif report.reasons:
        title = esc(report.reasons[0])
    else:
        title = "every compared row is within tolerance"
    lacking = "".join(f"<p>{esc(line)}</p>" for line in lacking_lines(report))
    banner = f'<div class="warn partial"><b>Partial trace</b>: {lacking}</div>' if lacking else ""
    return (f'{banner}<header class="verdict v-{verdict}">'
            f'<div class="kicker">tracediff compare · {rested}</div>'
            f'<h1><span class="badge">{verdict}</span>{title}</h1>{"".join(lines)}'
            f'<p class="files">{_files(report)}</p>{_acceptance(report)}{_coverage(report)}</header>')


def _acceptance(report: Report) -> str:
    lines = acceptance_lines(report)
    return "".join(f'<p class="acceptance">{esc(line)}</p>' for line in lines)


def _diagnosis(report: Report, d: Diagnosis, matrices: dict[int, str]) -> str:
    label = diagnosis_label(report)
    matrix = matrices.get(id(d.evidence), "")
    return (f'<div class="diag"><span class="sev sev-{esc(d.severity)}">{esc(d.severity)}</span>'
            f'<span class="muted">{label}:</span> <span class="kind">{esc(d.kind)}</span>: {esc(d.message)}'
            f"{matrix}</div>")


def _why(report: Report) -> str:
    matrices = {id(ev): slot_matrix(ev) for ev in slot_evidence(report.diagnoses)}
    items = [_diagnosis(report, d, matrices) for d in report.diagnoses]
    first = report.first_divergence
    if first is not None and unexplained(report):
        numbers = ", ".join(f"{esc(k)} {num(v, 4)}" for k, v in first.row.metrics.items())
        items.append(f'<div class="diag"><span class="kind">{NO_EXPLANATION}</span>; first failing row: '
                     f"{numbers}</div>")
    if not items:
        return ""
    heading = "Why" if diagnosis_label(report) == "why" else "Notes"
    return f"<section><h2>{heading}</h2>{''.join(items)}</section>"


def _coverage(report: Report) -> str:
    depths = depth_summary(report.coverage)
    lines = [f"<b>per draft depth</b>: {esc(depths)}"] if depths else []
    lines += [f"not compared, {esc(line)}" for line in skipped_lines(report.coverage)]
    lines += [f"not compared, {esc(line)}" for line in one_sided(report)]
    first = report.first_divergence
    told = first is None or report.verdict == "incomparable"
    lines += [f'<b>{esc(report.verdict if told else "also")}</b>: {esc(r)}' for r in report.reasons]
    lines += [esc(line) for line in trace_notes(report)]
    by = "token prefix" if report.align == "prefix" else "step"
    rule = (f"A match needs every tensor on both sides compared on at least {100 * report.min_coverage:.0f}% "
            f"of its comparable rows; rows aligned by {by}.")
    items = "".join(f"<li>{line}</li>" for line in lines)
    return (f'<div class="compared"><p><b>Compared:</b> {esc(coverage_line(report.coverage))}. '
            f'<span class="muted">{rule}</span></p>{f"<ul class=plain>{items}</ul>" if items else ""}</div>')


def _where(report: Report) -> str:
    first = divergence(report)
    note = ""
    if first is not None and first.row.position < 0:
        note = (f"<p>The first divergence is in the static tensor <code>{esc(first.name)}</code> "
                "(no position).</p>")
    statics = [t.name for t in report.tensors if t.static and t.rows]
    if statics:
        one = len(statics) == 1
        note += (f'<p class="muted">{len(statics)} static tensor{"" if one else "s"} '
                 f"({esc(', '.join(statics[:LISTED]))}{', ...' if len(statics) > LISTED else ''}) "
                 f"{'is' if one else 'are'} compared whole, as one row: {'it has' if one else 'they have'} "
                 "no positions, so no error profile by nature; not drawn below.</p>")
    unprofiled = [t.name for t in report.tensors if t.rows and t.profile is None and not t.static]
    if unprofiled:
        one = len(unprofiled) == 1
        note += (f'<p class="warn">{len(unprofiled)} compared tensor{"" if one else "s"} '
                 f"carr{'ies' if one else 'y'} no error profile in this report (left out to keep it small, "
                 "e.g. by a bundle's size budget; the full report has them): not drawn below.</p>")
    note += ('<p class="muted">A cell holds the worst row at its depth and positions over every request and '
             "step; the first divergence is the first failing row in the baseline's execution order, so "
             "failing cells may lie left of it.</p>")
    return (f"<section><h2>Where: error by tensor (dataflow order) and position</h2>{note}"
            f'<div class="figure-scroll">{heatmap_svg(report)}</div></section>')


def _curves(report: Report) -> str:
    first = divergence(report)
    if first is None:
        return ""
    tensor = next((t for t in report.tensors if t.name == first.name), None)
    if tensor is not None and tensor.profile is None and tensor.rows and not tensor.static:
        return (f"<section><h2>First diverging tensor <code>{esc(first.name)}</code>, per position</h2>"
                '<p class="warn">Its error profile was left out of this report (e.g. by a bundle\'s size '
                "budget): the full report draws it.</p></section>")
    if tensor is None or tensor.profile is None or not any(p >= 0 for p in tensor.profile.position):
        return ""
    return (f"<section><h2>First diverging tensor <code>{esc(first.name)}</code>, per position</h2>"
            f"{curves_html(first.name, tensor.profile, first)}</section>")


def _tokens(report: Report) -> str:
    if report.tokens is None:
        return ""
    return f"<section><h2>Tokens on both sides</h2>{tokens_html(report.tokens)}</section>"


def _skipped(report: Report) -> str:
    grouped = skipped_by_tensor(report)
    if not grouped:
        return ""
    items = "".join(f"<li>{', '.join(f'<code>{esc(n)}</code>' for n in names)}: {esc(line)}</li>"
                    for names, line in grouped)
    return f"<details><summary>Rows not compared, per tensor</summary><ul class=plain>{items}</ul></details>"


def _next(report: Report) -> str:
    command = next_command(report)
    if command is None:
        return ""
    return f'<p class="muted">Next, the row on both sides: <code>{esc(command)}</code></p>'


def render_html(report: Report) -> str:
    """The whole page for ``report``."""
    a, b = (" ".join(info.paths) for info in (report.a, report.b))
    title = esc(f"tracediff: {report.verdict}: {a} vs {b}")
    producers = "".join(f"<li>{side}: {esc(producer(info))}</li>"
                        for side, info in (("a", report.a), ("b", report.b)))
    body = [
        _header(report), _why(report), _where(report), _curves(report), _tokens(report),
        f"<section><h2>Tensors</h2>{tensor_table(report)}{_skipped(report)}{_next(report)}</section>",
        f"<section><h2>Run contracts</h2>{contract_html(report)}</section>",
        f"<section><h2>Producers</h2><ul class=plain>{producers}</ul></section>",
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="color-scheme" content="light dark">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{title}</title><style>{CSS}</style></head>\n<body><main>{''.join(body)}</main></body></html>\n")



def write_html(report: Report, path: Path, force: bool = False) -> None:
    """The page at ``path``, written beside it and published whole (``trace/output.py``): an existing
    path is refused unless ``force``, and then only a regular file that is none of the compared traces
    is replaced (never a FIFO, device, directory or link). InputError (one line) otherwise."""
    text = render_html(report)
    with staged_output(path, [*report.a.paths, *report.b.paths], force) as staged:
        staged.write_text(text, encoding="utf-8")
