"""Terminal rendering of ``tracediff show``. Text from the trace goes into ``rich.text.Text`` through
``safe``: never markup, never terminal escapes."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracediff.text import safe
from tracediff.trace.summary import TensorStats, TraceSummary

if TYPE_CHECKING:  # show itself never loads compare's modules; a row view (--step) brings its own
    from tracediff.diff.rowview import RowSide, RowView

CONTRACT_SHOWN = 64 << 10  # characters of the contract's JSON printed


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _run_lines(summary: TraceSummary) -> list[Text]:
    meta = summary.meta
    lines = [Text(safe(", ".join(summary.paths)), style="bold")]
    if not summary.complete:
        lines.append(Text("incomplete: the writer never closed (killed or out of disk); showing records "
                          "up to its last flush", style="yellow"))
    torch = meta.get("torch") or {}
    producer = f"{meta.get('producer')} {meta.get('producer_version')}"
    lines.append(Text.assemble("source ", (safe(meta.get("source")), "bold"), safe(
        f" · {producer} · format v{meta.get('format_version')} · created {meta.get('created')}")))
    host = meta.get("host") or {}
    lines.append(Text(safe(f"host {host.get('hostname')} pid {host.get('pid')} · python {host.get('python')}"
                           f" · torch {torch.get('version', '-')} on {torch.get('device', '-')}"
                           f" · rank {meta.get('rank')}/{meta.get('world_size')}")))
    for path, final in zip(summary.paths, summary.finals):
        if final is None:
            continue
        note = Text(safe(f"{final.get('records')} records, {human_bytes(final.get('bytes', 0))} written"))
        dropped = final.get("dropped_records", 0)
        if dropped:
            worst = sorted(final.get("dropped", {}).items(), key=lambda kv: -kv[1])[:3]
            note.append(", ").append(f"{dropped} dropped", style="yellow")
            note.append(safe(f" ({', '.join(f'{k}: {v}' for k, v in worst)})"))
        if final.get("stopped"):
            note.append(", ").append(safe(f"stopped: {final['stopped']}"), style="yellow")
        lines.append(Text(safe(path) + ": ").append_text(note) if len(summary.paths) > 1 else note)
    for line in summary.lacking:  # a compare against it is at best incomplete where the other side has more
        lines.append(Text(safe(f"incomplete: {line}"), style="yellow"))
    lines.append(_token_line(summary))
    return lines


def _token_line(summary: TraceSummary) -> Text:
    if not summary.tokens and int(summary.meta.get("format_version") or 0) < 2:
        return Text("token table: none (a format v1 trace)")
    def total(key: str) -> int:
        return sum(int((final or {}).get(key) or 0) for final in summary.finals)

    conflicts = total("token_conflicts")
    line = Text(f"token table: {summary.tokens} tokens of {summary.token_requests} requests")
    if conflicts:
        line.append(f", {conflicts} conflicting", style="yellow")
    calls, rows = total("token_calls_dropped"), total("token_rows_dropped")
    if calls or rows:  # the recorder's bound on the table was reached: it is incomplete
        lost = ", ".join(part for part in (f"{calls} calls" if calls else "", f"{rows} rows" if rows else "")
                         if part)
        line.append(f", incomplete: {lost} not learned (the recorder's memory bound)", style="yellow")
    return line


def _target_line(contract: dict) -> str | None:
    """``target: DeepseekV3ForCausalLM (family deepseek_v2, 6 layers) · aux ids [2, 4, 5] fed [layer 1,
    layer 3, layer 4]``: what served and what each fc-input slot held, where the contract says."""
    from tracediff.eagle3.conventions import labels

    model_class, family = contract.get("target_model_class"), contract.get("target_family")
    if not isinstance(model_class, str):
        return None
    layers = contract.get("target_num_layers")
    about = ", ".join(part for part in (f"family {family}" if family else "",
                                        f"{layers} layers" if isinstance(layers, int) else "") if part)
    line = f"target: {model_class.rsplit('.', 1)[-1]}" + (f" ({about})" if about else "")
    slots = contract.get("aux_slot_states")
    if isinstance(slots, list) and slots:
        line += f" · aux ids {contract.get('aux_layer_ids')} fed {labels(slots)}"
    elif contract.get("aux_capture_set"):
        line += f" · aux ids {contract.get('aux_layer_ids')}: no forward measured what the aux held"
    return line


def render_summary(console: Console, summary: TraceSummary) -> None:
    for line in _run_lines(summary):
        console.print(line, highlight=False)
    contract = summary.contract
    target = _target_line(contract)
    if target is not None:
        console.print(Text(safe(target)), highlight=False, soft_wrap=True)
    if contract:
        text = json.dumps(contract, sort_keys=True)
        if len(text) > CONTRACT_SHOWN:  # metadata may hold 16 MiB: a terminal line of it helps no one
            left = len(text) - CONTRACT_SHOWN
            text = text[:CONTRACT_SHOWN] + f" ... ({left} more characters: --json has all)"
        console.print(Text("contract: " + safe(text)), highlight=False, soft_wrap=True)
    table = Table(title=None, header_style="bold", show_edge=False)
    longest = max((len(t.name) for t in summary.tensors), default=4)
    table.add_column("name", no_wrap=True, min_width=longest)
    for column in ("dtype", "row shape"):
        table.add_column(column)
    for column in ("rows", "records", "steps", "requests", "bytes"):
        table.add_column(column, justify="right")
    for t in summary.tensors:
        shape = "static " + str(tuple(t.row_shape)) if t.static else str(tuple(t.row_shape))
        cells: list[Any] = [t.name, t.dtype, shape, t.rows, t.records, t.steps, t.requests]
        table.add_row(*(Text(safe(cell)) for cell in [*cells, human_bytes(t.bytes)]))
    console.print(table)


def render_stats(console: Console, stats: TensorStats, where: str) -> None:
    heading = safe(f" {where}: {stats.dtype} {tuple(stats.shape)}")
    console.print(Text.assemble((safe(stats.name), "bold"), heading), highlight=False)
    line = Text(f"min {stats.min:.6g}  max {stats.max:.6g}  mean {stats.mean:.6g}  std {stats.std:.6g}  ")
    line.append(f"NaN {stats.nan}  Inf {stats.inf}", style="red" if stats.nan or stats.inf else "")
    console.print(line, highlight=False)
    console.print(Text("first values: " + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v)
                                                    for v in stats.head)), highlight=False)


def render_row_view(console: Console, view: RowView) -> None:
    """Both rows side by side: where each lies, the row metrics, both sides' stats, and the elements
    that differ most."""
    a, b = view.a, view.b
    kinds = {f"{s.stats.dtype} {tuple(s.stats.shape)}" for s in (a, b)}
    what = kinds.pop() if len(kinds) == 1 else f"{a.stats.dtype} {tuple(a.stats.shape)} vs " \
                                                f"{b.stats.dtype} {tuple(b.stats.shape)}"
    console.print(Text.assemble((safe(view.name), "bold"), f": {what}"), highlight=False)
    for label, side in (("a", a), ("b", b)):
        console.print(Text(f"  {label} {safe(side.path)}: {_place(side)}"), highlight=False, soft_wrap=True)
    for label, side in (("a", a), ("b", b)):
        if side.matched > 1:
            tail = "-b" if label == "b" else ""
            narrow = f"--request{tail} or --step{tail}"
            console.print(Text(f"  {label}: {side.matched} rows match; the first at the lowest step is "
                               f"shown (narrow with {narrow})", style="yellow"), highlight=False)
    if view.metrics:
        console.print(Text("row metrics: " + "  ".join(f"{k} {_value(v)}" for k, v in view.metrics.items())),
                      highlight=False)
        style = "red" if view.differing else "green"
        console.print(Text(f"{view.differing} of {view.elements} elements differ", style=style),
                      highlight=False)
    for note in view.notes:
        console.print(Text(f"note: {safe(note)}", style="yellow"), highlight=False, soft_wrap=True)
    stats = Table(show_edge=False, header_style="bold")
    stats.add_column("side")
    for column in ("min", "max", "mean", "std", "NaN", "Inf"):
        stats.add_column(column, justify="right")
    stats.add_column("first values")
    for label, side in (("a", a), ("b", b)):
        s = side.stats
        counts = (Text(str(n), style="red" if n else "") for n in (s.nan, s.inf))
        stats.add_row(label, *(_value(v) for v in (s.min, s.max, s.mean, s.std)), *counts,
                      ", ".join(_value(v) for v in s.head))
    console.print(stats)
    if not view.top:
        return
    console.print(Text(f"largest differences ({len(view.top)} of {view.differing}):"), highlight=False)
    table = Table(show_edge=False, header_style="bold")
    for column in ("index", "a", "b", "|a-b|"):
        table.add_column(column, justify="left" if column == "index" else "right")
    for d in view.top:
        table.add_row(str(tuple(d.index)), _value(d.a), _value(d.b), _value(d.abs_diff))
    console.print(table)


def _place(side: RowSide) -> str:
    """Where a side's row lies, in words (trace text escaped)."""
    if side.request is None:
        return f"static tensor, step {side.step}"
    fed = "" if side.fed is None else f", fed token {side.fed}"
    return (f"request {safe(side.request)}, position {side.position}, depth {side.depth}, step {side.step}, "
            f"token {side.token_id}{fed}")


def _value(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"
