"""Terminal rendering of ``tracediff doctor`` findings. Messages quote the checkpoint's own text
(config values, --server-args words): they go into rich ``Text``, never into markup, with control
characters shown escaped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracediff.eagle3.vocab import Finding
from tracediff.report.text import safe

STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def render_findings(console: Console, findings: list[Finding]) -> None:
    problems = [f for f in findings if f.severity != "info"]
    if not problems:
        console.print(Text("no problems found", style="green"))
    table = Table(show_edge=False, header_style="bold")
    for column in ("severity", "check", "finding", "fix"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(Text(f.severity, style=STYLE.get(f.severity, "")),
                      *(Text(safe(text)) for text in (f.code, f.message, f.fix)))
    if findings:
        console.print(table)
