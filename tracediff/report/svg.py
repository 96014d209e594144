"""Shared pieces of the HTML report's pictures: escaping (text from a trace is data, never markup),
number formatting and the error colour scale, so that the heatmap, its legend and the curves agree."""

from __future__ import annotations

import html
import math
from typing import Any

from tracediff.diff.results import FirstDivergence, Report
from tracediff.text import safe

LOG_LOW, LOG_PASS_HIGH, LOG_FAIL_LOW = -8.0, 0.0, -4.0  # log10 rel_l2 bounds of the two ramps
PASS_RAMP = ((0xEE, 0xF6, 0xF3), (0x3E, 0x9C, 0x88))  # within tolerance: pale to teal
FAIL_RAMP = ((0xF8, 0xB8, 0x6A), (0x9B, 0x0D, 0x12))  # out of tolerance: orange to deep red
NOT_FINITE = "#6B3FA0"
NOT_COMPARED = "#D4D4D8"


def esc(value: Any) -> str:
    """Trace text for HTML text or a double-quoted attribute: control characters shown as escapes,
    ``<>&"'`` as entities."""
    return html.escape(safe(value), quote=True)


def divergence(report: Report) -> FirstDivergence | None:
    """The first divergence the pictures mark: none for an incomparable pair, whose rows are not a
    divergence to chase."""
    return None if report.verdict == "incomparable" else report.first_divergence


def num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if math.isnan(value):
        return "NaN"
    return f"{value:.{digits}g}"


def _mix(ramp: tuple[tuple[int, int, int], tuple[int, int, int]], t: float) -> str:
    t = min(1.0, max(0.0, t))
    low, high = ramp
    return "#" + "".join(f"{round(lo + (hi - lo) * t):02X}" for lo, hi in zip(low, high))


def _log_share(value: float, low: float, high: float) -> float:
    if value <= 0:
        return 0.0
    return (math.log10(value) - low) / (high - low)


def cell_colour(rows: int, failed: int, rel_l2: float | None) -> str:
    """Hue says within / out of tolerance, lightness how large the error: rel_l2 on a log scale for
    floats, the share of rows out of tolerance for integer tensors (no rel_l2)."""
    if rows == 0:
        return NOT_COMPARED
    if rel_l2 is not None and not math.isfinite(rel_l2):
        return NOT_FINITE
    if failed == 0:
        return _mix(PASS_RAMP, 0.15 if rel_l2 is None else _log_share(rel_l2, LOG_LOW, LOG_PASS_HIGH))
    if rel_l2 is None:
        return _mix(FAIL_RAMP, 0.3 + 0.7 * failed / rows)
    return _mix(FAIL_RAMP, _log_share(rel_l2, LOG_FAIL_LOW, 0.0))


def ramp_swatches(x: float, y: float, width: float, height: float, failing: bool) -> str:
    """A colour bar of one ramp, drawn as small rects (no gradient ids that could clash in a page)."""
    steps = 24
    low, high = (LOG_FAIL_LOW, 0.0) if failing else (LOG_LOW, LOG_PASS_HIGH)
    parts = []
    for i in range(steps):
        value = 10 ** (low + (high - low) * (i + 0.5) / steps)
        colour = cell_colour(1, int(failing), value)
        parts.append(f'<rect x="{x + i * width / steps:.1f}" y="{y}" width="{width / steps + 0.3:.1f}" '
                     f'height="{height}" fill="{colour}"/>')
    return "".join(parts)


def text(x: float, y: float, content: str, cls: str = "", anchor: str = "start") -> str:
    """An SVG text element; ``content`` must already be escaped."""
    klass = f' class="{cls}"' if cls else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{klass}>{content}</text>'
