"""Terminal rendering of ``tracediff show``."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from tracediff.trace.summary import TensorStats, TraceSummary


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _run_lines(summary: TraceSummary) -> list[str]:
    meta = summary.meta
    lines = [f"[bold]{', '.join(summary.paths)}[/bold]"]
    if not summary.complete:
        lines.append("[yellow]incomplete: the writer never closed (killed or out of disk); "
                     "showing records up to its last flush[/yellow]")
    torch = meta.get("torch") or {}
    lines.append(
        f"source [bold]{meta.get('source')}[/bold] · {meta.get('producer')} {meta.get('producer_version')}"
        f" · format v{meta.get('format_version')} · created {meta.get('created')}"
    )
    host = meta.get("host") or {}
    lines.append(f"host {host.get('hostname')} pid {host.get('pid')} · python {host.get('python')}"
                 f" · torch {torch.get('version', '-')} on {torch.get('device', '-')}"
                 f" · rank {meta.get('rank')}/{meta.get('world_size')}")
    for path, final in zip(summary.paths, summary.finals):
        if final is None:
            continue
        dropped = final.get("dropped_records", 0)
        note = f"{final.get('records')} records, {human_bytes(final.get('bytes', 0))} written"
        if dropped:
            worst = sorted(final.get("dropped", {}).items(), key=lambda kv: -kv[1])[:3]
            note += f", [yellow]{dropped} dropped[/yellow] ({', '.join(f'{k}: {v}' for k, v in worst)})"
        if final.get("stopped"):
            note += f", [yellow]stopped: {final['stopped']}[/yellow]"
        lines.append(f"{path}: {note}" if len(summary.paths) > 1 else note)
    lines.append(_token_line(summary))
    return lines


def _token_line(summary: TraceSummary) -> str:
    if not summary.tokens and int(summary.meta.get("format_version") or 0) < 2:
        return "token table: none (a format v1 trace)"
    conflicts = sum((final or {}).get("token_conflicts", 0) for final in summary.finals)
    line = f"token table: {summary.tokens} tokens of {summary.token_requests} requests"
    return line + (f", [yellow]{conflicts} conflicting[/yellow]" if conflicts else "")


def render_summary(console: Console, summary: TraceSummary) -> None:
    for line in _run_lines(summary):
        console.print(line, highlight=False)
    contract = dict(summary.meta.get("contract") or {})
    for final in summary.finals:
        contract.update((final or {}).get("contract") or {})
    if contract:
        console.print("contract:", json.dumps(contract, sort_keys=True), highlight=False, soft_wrap=True)
    table = Table(title=None, header_style="bold", show_edge=False)
    longest = max((len(t.name) for t in summary.tensors), default=4)
    table.add_column("name", no_wrap=True, min_width=longest)
    for column in ("dtype", "row shape"):
        table.add_column(column)
    for column in ("rows", "records", "steps", "requests", "bytes"):
        table.add_column(column, justify="right")
    for t in summary.tensors:
        shape = "static " + str(tuple(t.row_shape)) if t.static else str(tuple(t.row_shape))
        table.add_row(t.name, t.dtype, shape, str(t.rows), str(t.records), str(t.steps), str(t.requests),
                      human_bytes(t.bytes))
    console.print(table)


def render_stats(console: Console, stats: TensorStats, where: str) -> None:
    console.print(f"[bold]{stats.name}[/bold] {where}: {stats.dtype} {tuple(stats.shape)}", highlight=False)
    bad = "[red]" if stats.nan or stats.inf else ""
    console.print(
        f"min {stats.min:.6g}  max {stats.max:.6g}  mean {stats.mean:.6g}  std {stats.std:.6g}  "
        f"{bad}NaN {stats.nan}  Inf {stats.inf}", highlight=False,
    )
    console.print("first values:", ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v)
                                             for v in stats.head), highlight=False)
