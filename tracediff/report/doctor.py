"""Terminal rendering of ``tracediff doctor`` findings."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tracediff.eagle3.vocab import Finding

STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def render_findings(console: Console, findings: list[Finding]) -> None:
    problems = [f for f in findings if f.severity != "info"]
    if not problems:
        console.print("[green]no problems found[/green]")
    table = Table(show_edge=False, header_style="bold")
    for column in ("severity", "check", "finding", "fix"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(f"[{STYLE[f.severity]}]{f.severity}[/]", f.code, f.message, f.fix)
    if findings:
        console.print(table)
