"""Terminal rendering of ``tracediff doctor`` findings. Messages quote the checkpoint's own text
(config values, --server-args words): they go into rich ``Text``, never into markup, with control
characters shown escaped."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracediff.eagle3.vocab import Finding
from tracediff.text import safe

STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def headline(findings: list[Finding]) -> Text:
    """``no problems found`` only when nothing but info is listed; else the errors and warnings counted."""
    counts = {severity: sum(f.severity == severity for f in findings) for severity in ("error", "warning")}
    if not any(counts.values()):
        return Text("no problems found", style="green")
    said = [f"{n} {severity}{'s' if n != 1 else ''}" for severity, n in counts.items() if n]
    return Text(", ".join(said) + " found", style=STYLE["error" if counts["error"] else "warning"])


def render_findings(console: Console, findings: list[Finding]) -> None:
    console.print(headline(findings))
    table = Table(show_edge=False, header_style="bold")
    for column in ("severity", "check", "finding", "fix"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(Text(f.severity, style=STYLE.get(f.severity, "")),
                      *(Text(safe(text)) for text in (f.code, f.message, f.fix)))
    if findings:
        console.print(table)
