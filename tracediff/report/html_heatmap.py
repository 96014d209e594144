"""The heatmap: tensors (dataflow order) x (draft depth, position cell), coloured by error, with the
first divergence marked. Drawn from the report's per-tensor profiles; nothing is recomputed."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from tracediff.diff.results import FirstDivergence, Profile, Report, TensorResult
from tracediff.report.svg import (
    NOT_COMPARED,
    NOT_FINITE,
    cell_colour,
    divergence,
    esc,
    num,
    ramp_swatches,
    text,
)

WIDTH = 1270  # px the picture aims at: a section's width on a 1400 px window
ROW_H, GAP, TOP, RIGHT = 18, 10, 48, 140
LEGEND_W = 1120  # the legend's width: the picture is never narrower
MIN_HOVER = 4  # px: thinner cells get no tooltip
MAX_NAME = 34  # characters of a tensor name shown (the full name is in the tooltip)


@dataclass
class Grid:
    """Where each (depth, position) column and each tensor row lies."""

    columns: list[tuple[int, int]]  # (depth, first position), sorted
    left: float
    cell_w: float
    gaps: dict[int, float]  # depth -> extra x offset (a gap between depths)

    def x(self, index: int) -> float:
        return self.left + index * self.cell_w + self.gaps[self.columns[index][0]]

    def span(self, depth: int, position: int, bucket: int) -> tuple[int, int]:
        """Columns [first, end) that a cell of ``bucket`` positions from ``position`` covers."""
        first = bisect_left(self.columns, (depth, position))
        return first, max(first + 1, bisect_left(self.columns, (depth, position + bucket)))


def mapped(report: Report) -> list[tuple[TensorResult, Profile]]:
    """Tensors with compared rows at a position (static tensors have none), in dataflow order."""
    return [(t, t.profile) for t in report.tensors
            if t.profile is not None and any(p >= 0 for p in t.profile.position)]


def _grid(rows: list[tuple[TensorResult, Profile]]) -> Grid:
    columns = sorted({(d, p) for _, prof in rows for d, p in zip(prof.depth, prof.position) if p >= 0})
    depths = sorted({d for d, _ in columns})
    longest = max(min(len(t.name), MAX_NAME) for t, _ in rows)
    left = min(280.0, 24 + 7.4 * longest)
    room = WIDTH - left - RIGHT - GAP * (len(depths) - 1)
    cell_w = min(44.0, max(0.5, room / len(columns)))
    return Grid(columns, left, cell_w, {d: k * GAP for k, d in enumerate(depths)})


def _short(name: str) -> str:
    return name if len(name) <= MAX_NAME else name[: MAX_NAME - 1] + "…"


def _cells(grid: Grid, t: TensorResult, prof: Profile, y: float) -> list[str]:
    out = []
    edge = ' stroke="var(--bg)" stroke-width="0.6"' if grid.cell_w >= 6 else ""
    for i, (d, p) in enumerate(zip(prof.depth, prof.position)):
        if p < 0:
            continue
        first, end = grid.span(d, p, prof.bucket)
        where = f"position {p}" if prof.bucket == 1 else f"positions {p}-{p + prof.bucket - 1}"
        tip = (f"<title>{esc(t.name)}, depth {d}, {where}: {prof.rows[i]} rows, {prof.failed[i]} out of "
               f"tolerance; rel_l2 {num(prof.rel_l2[i])}, cosine {num(prof.cosine[i], 4)}</title>"
               if grid.cell_w >= MIN_HOVER else "")  # thinner cells cannot be pointed at
        width = grid.x(end - 1) + grid.cell_w - grid.x(first)
        out.append(f'<rect x="{grid.x(first):.2f}" y="{y:.1f}" width="{width:.2f}" height="{ROW_H}" '
                   f'fill="{cell_colour(prof.rows[i], prof.failed[i], prof.rel_l2[i])}"{edge}>{tip}</rect>')
    return out


def _background(grid: Grid, y: float) -> list[str]:
    """Grey under each depth's columns: a tensor without a cell there compared no row there."""
    out = []
    for depth in sorted(grid.gaps):
        first, end = grid.span(depth, -(2**62), 2**63)
        width = grid.x(end - 1) + grid.cell_w - grid.x(first)
        out.append(f'<rect x="{grid.x(first):.1f}" y="{y:.1f}" width="{width:.1f}" height="{ROW_H}" '
                   f'fill="{NOT_COMPARED}" opacity="0.55"/>')
    return out


def _axes(grid: Grid, bottom: float) -> list[str]:
    """Depth headers above the columns, position ticks below."""
    out = []
    every = max(1, int(-(-44 // grid.cell_w)))
    for depth in sorted(grid.gaps):
        first, end = grid.span(depth, -(2**62), 2**63)
        x0, x1 = grid.x(first), grid.x(end - 1) + grid.cell_w
        out.append(f'<line x1="{x0:.1f}" y1="{TOP - 8}" x2="{x1:.1f}" y2="{TOP - 8}" class="hm-rule"/>')
        out.append(text((x0 + x1) / 2, TOP - 13, f"depth {depth}", "hm-axis", "middle"))
        for k in range(first, end, every):
            centre = grid.x(k) + grid.cell_w / 2
            if k == first or centre < x1 - 20:  # clear of the next depth's first label
                out.append(text(centre, bottom + 14, str(grid.columns[k][1]), "hm-tick", "middle"))
    hover = "; hover a cell for its numbers" if grid.cell_w >= MIN_HOVER else ""
    out.append(text(grid.left, bottom + 30, f"position (first of each cell){hover}", "hm-caption"))
    return out


def _first_mark(grid: Grid, prof: Profile, first: FirstDivergence, y: float) -> list[str]:
    """A heavy outline around the first divergence's cell and a label above its column."""
    row = first.row
    cell = (row.position // prof.bucket) * prof.bucket
    if (row.depth, cell) not in set(zip(prof.depth, prof.position)):
        return []
    a, end = grid.span(row.depth, cell, prof.bucket)
    x, width = grid.x(a), grid.x(end - 1) + grid.cell_w - grid.x(a)
    if width < 8:  # a thin cell: the mark stays visible
        x, width = x + width / 2 - 4, 8.0
    label = f"first divergence: {esc(first.name)}, position {row.position}, depth {row.depth}"
    right = x + width / 2 > WIDTH * 0.6
    return [
        f'<line x1="{x + width / 2:.1f}" y1="16" x2="{x + width / 2:.1f}" y2="{y - 3:.1f}" class="hm-pin"/>',
        f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="{width + 4:.1f}" height="{ROW_H + 4}" '
        'class="hm-first-outer hm-first-cell"/>',
        f'<rect x="{x - 0.5:.1f}" y="{y - 0.5:.1f}" width="{width + 1:.1f}" height="{ROW_H + 1}" '
        'class="hm-first-inner"/>',
        text(x + width / 2 + (-6 if right else 6), 12, label, "hm-first-label", "end" if right else "start"),
    ]


def _legend(y: float) -> list[str]:
    x = 0.0
    out = [text(x, y + 11, "within tolerance, rel_l2", "hm-axis"), ramp_swatches(x + 158, y, 150, 14, False),
           text(x + 158, y + 28, "1e-8", "hm-tick"), text(x + 308, y + 28, "1", "hm-tick", "end")]
    x = 350
    out += [text(x, y + 11, "out of tolerance, rel_l2", "hm-axis"), ramp_swatches(x + 160, y, 150, 14, True),
            text(x + 160, y + 28, "1e-4", "hm-tick"), text(x + 310, y + 28, "≥ 1", "hm-tick", "end")]
    x = 700
    for colour, label in ((NOT_FINITE, "NaN / Inf"), (NOT_COMPARED, "not compared")):
        out += [f'<rect x="{x}" y="{y}" width="14" height="14" fill="{colour}"/>', text(x + 20, y + 11, label,
                                                                                       "hm-axis")]
        x += 130
    out += [f'<rect x="{x + 1}" y="{y + 1}" width="12" height="12" fill="none" class="hm-first-outer"/>',
            text(x + 20, y + 11, "first divergence", "hm-axis")]
    out.append(text(0, y + 46, "integer tensors: teal when equal, orange to red by the share of rows that "
                    "differ", "hm-caption"))
    return out


def heatmap_svg(report: Report) -> str:
    rows = mapped(report)
    if not rows:
        return ('<p class="muted">Nothing to map: no tensor of this report has an error profile by '
                "position.</p>")
    grid = _grid(rows)
    bottom = TOP + ROW_H * len(rows)
    grid_end = grid.x(len(grid.columns) - 1) + grid.cell_w
    width = max(LEGEND_W, grid_end + RIGHT)
    first = divergence(report)
    body, marks = [], []
    for r, (t, prof) in enumerate(rows):
        y = TOP + r * ROW_H
        is_first = first is not None and t.name == first.name
        body += _background(grid, y) + _cells(grid, t, prof, y)
        label_cls = "hm-label hm-label-first" if is_first else "hm-label"
        body.append(f'<text x="{grid.left - 10:.1f}" y="{y + 13:.1f}" text-anchor="end" class="{label_cls}">'
                    f"<title>{esc(t.name)} ({t.status})</title>{esc(_short(t.name))}</text>")
        failed = f"{t.failed} / {t.rows} failed" if t.failed else f"{t.rows} ok"
        body.append(text(grid_end + 10, y + 13, failed, "hm-count hm-bad" if t.failed else "hm-count"))
        if is_first and first is not None:
            marks = _first_mark(grid, prof, first, y)
    height = bottom + 100
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{width:.0f}" '
             f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
             'aria-label="error heatmap">',
             *body, *_axes(grid, bottom), *marks, *_legend(bottom + 44), "</svg>"]
    return "".join(parts)
