"""explain's result as one self-contained HTML page: the conclusion, then a bar per run (its accept
length over the chains every run scores), the run whose swap restores acceptance marked.
Inline CSS, no script, no network (the compare page's Content-Security-Policy); every piece of
text from a trace goes through ``esc``: it is data, never markup."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tracediff.eagle3.explanation import Explanation
from tracediff.report.explain import accuracy_text, header_lines
from tracediff.report.html import CSP
from tracediff.report.html_style import CSS
from tracediff.report.svg import esc
from tracediff.trace.output import staged_output

BAR_WIDTH = 420  # px of the longest possible bar (every depth accepted)
BAR_CSS = (".bars td{padding:2px 8px;vertical-align:middle}.bar{height:14px;background:#4a78c2}"
           ".bar.restored{background:#2f9e44}.bar.base{background:#888}.restored-row{font-weight:600}")


def _bar(ex: Explanation, accept: float, kind: str) -> str:
    width = max(1, round(BAR_WIDTH * (accept - 1) / max(ex.depths, 1)))  # 1.0 (nothing accepted) is empty
    return f'<div class="bar {kind}" style="width:{width}px"></div>'


def render_explain_html(ex: Explanation) -> str:
    rows = []
    for run in ex.runs:
        kind = "restored" if run.name == ex.restored_by else "base" if not run.swapped else ""
        mark = " ← restores acceptance" if run.name == ex.restored_by else ""
        rows.append(f'<tr class="{"restored-row" if mark else ""}"><td>{esc(run.name)}{mark}</td>'
                    f"<td>{_bar(ex, run.expected_accept_len, kind)}</td>"
                    f"<td>{run.expected_accept_len:.2f}</td>"
                    f"<td>{run.chains}</td><td>{run.own_accept_len:.2f} ({run.own_chains})</td>"
                    f"<td>{accuracy_text(run.depth_accuracy)}</td></tr>")
    facts = header_lines(ex)
    body = (f"<section><h1>{esc(ex.conclusion)}</h1><ul class=plain>"
            + "".join(f"<li>{esc(fact)}</li>" for fact in facts) + "</ul></section>"
            "<section><h2>Runs</h2><table class=bars><tr><th>run</th><th>accept length per verify</th>"
            "<th></th><th>chains</th><th>own figure</th><th>accuracy per depth</th></tr>"
            + "".join(rows) + "</table></section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="color-scheme" content="light dark">'
            f"<title>{esc('tracediff explain: ' + ex.conclusion)}</title>"
            f"<style>{CSS}{BAR_CSS}</style></head>\n"
            f"<body><main>{body}</main></body></html>\n")


def write_explain_html(ex: Explanation, path: Path, inputs: Sequence[Path], force: bool = False) -> None:
    """The page at ``path``, published whole; an existing path only with ``force`` (never an input)."""
    text = render_explain_html(ex)
    with staged_output(path, list(inputs), force) as staged:
        staged.write_text(text, encoding="utf-8")
