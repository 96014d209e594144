"""Error curves of the first diverging tensor: worst cosine and worst rel_l2 per position cell, one
line per draft depth (integer tensors: the share of rows that differ), from its profile."""

from __future__ import annotations

import math
from collections.abc import Callable

from tracediff.diff.results import FirstDivergence, Profile
from tracediff.report.svg import esc, num, text

W, H = 620, 250
PAD_L, PAD_R, PAD_T, PAD_B = 62, 16, 44, 44
DEPTH_COLOURS = ("#1F5FA8", "#D9771E", "#2E8B57", "#8A4FB5", "#B0413E", "#0E7490", "#7A6A00", "#555555")
Scale = Callable[[float], float]


def _ticks_linear(low: float, high: float) -> list[float]:
    step = (high - low) / 4
    return [low + k * step for k in range(5)]


def _points(prof: Profile, values: list[float | None], x: Scale, y: Scale,
            depth: int) -> list[tuple[float, float, int]]:
    """(x, y, cell index) of one depth's finite values."""
    return [(x(prof.position[i]), y(v), i) for i, v in enumerate(values)
            if prof.depth[i] == depth and v is not None and math.isfinite(v) and prof.position[i] >= 0]


def _chart(prof: Profile, values: list[float | None], title: str, y: Scale, ticks: list[tuple[float, str]],
           first: FirstDivergence | None) -> str:
    positions = [p for p in prof.position if p >= 0]
    lo, hi = min(positions), max(positions)
    span = max(hi - lo, 1)

    def x(p: float) -> float:
        return PAD_L + 10 + (p - lo) / span * (W - PAD_L - PAD_R - 20)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}">',
           text(PAD_L, 18, esc(title), "cv-title"),
           f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" height="{H - PAD_T - PAD_B}" '
           'class="cv-frame"/>']
    for value, label in ticks:
        out += [f'<line x1="{PAD_L}" y1="{y(value):.1f}" x2="{W - PAD_R}" y2="{y(value):.1f}" '
                'class="cv-grid"/>',
                text(PAD_L - 6, y(value) + 4, label, "cv-tick", "end")]
    step = max(prof.bucket, round(span / 8 / prof.bucket) * prof.bucket)
    for p in range(lo, hi + 1, step):
        out.append(text(x(p), H - PAD_B + 16, str(p), "cv-tick", "middle"))
    out.append(text((PAD_L + W - PAD_R) / 2, H - 8, "position", "cv-tick", "middle"))
    if first is not None and first.row.position >= 0:
        fx = x(first.row.position // prof.bucket * prof.bucket)
        out += [f'<line x1="{fx:.1f}" y1="{PAD_T}" x2="{fx:.1f}" y2="{H - PAD_B}" class="cv-first"/>',
                text(fx - 4, PAD_T + 12, "first divergence", "cv-first-label", "end") if fx > W * 0.6
                else text(fx + 4, PAD_T + 12, "first divergence", "cv-first-label")]
    depths = sorted(set(prof.depth))
    for k, depth in enumerate(depths):
        colour = DEPTH_COLOURS[k % len(DEPTH_COLOURS)]
        pts = _points(prof, values, x, y, depth)
        if len(pts) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _ in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
        for px, py, i in pts:
            fill = colour if prof.failed[i] == 0 else "#C62828"
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.8" fill="{fill}" stroke="var(--bg)" '
                       f'stroke-width="0.8"><title>depth {depth}, position {prof.position[i]}: '
                       f'{num(values[i], 4)} ({prof.failed[i]} of {prof.rows[i]} rows out of tolerance)'
                       "</title></circle>")
        if len(depths) > 1 or depth != 0:
            lx = PAD_L + 76 * k
            out += [f'<line x1="{lx}" y1="30" x2="{lx + 16}" y2="30" stroke="{colour}" stroke-width="2.5"/>',
                    text(lx + 20, 34, f"depth {depth}", "cv-tick")]
    out.append("</svg>")
    return "".join(out)


def _linear_chart(prof: Profile, values: list[float | None], title: str, low: float, high: float,
                  first: FirstDivergence | None) -> str:
    def y(v: float) -> float:
        return PAD_T + (high - v) / (high - low) * (H - PAD_T - PAD_B)

    return _chart(prof, values, title, y, [(v, f"{v:.3g}") for v in _ticks_linear(low, high)], first)


def _log_chart(prof: Profile, values: list[float | None], title: str, first: FirstDivergence | None) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    low = math.floor(math.log10(min(finite))) if finite else -8
    high = math.ceil(math.log10(max(finite))) if finite else 0
    low = min(low, high - 2)
    floor = 10.0**low

    def y(v: float) -> float:
        exponent = math.log10(max(v, floor))
        return PAD_T + (high - exponent) / (high - low) * (H - PAD_T - PAD_B)

    step = max(1, round((high - low) / 5))
    ticks = [(10.0**e, f"1e{e}") for e in range(low, high + 1, step)]
    return _chart(prof, values, title, y, ticks, first)


def curves_html(name: str, prof: Profile, first: FirstDivergence | None) -> str:
    """Two charts (cosine, rel_l2) for a float tensor, one (share of rows differing) for an integer one."""
    if all(v is None for v in prof.cosine):
        share: list[float | None] = [f / r if r else None for f, r in zip(prof.failed, prof.rows)]
        title = f"{name}: share of rows that differ, per position"
        charts = [_linear_chart(prof, share, title, 0.0, 1.0, first)]
    else:
        cos = [v for v in prof.cosine if v is not None and math.isfinite(v)]
        low = min(0.9, math.floor(min(cos, default=1.0) * 10) / 10)
        charts = [_linear_chart(prof, prof.cosine, f"{name}: worst cosine per position", max(low, -1.0), 1.0,
                                first),
                  _log_chart(prof, prof.rel_l2, f"{name}: worst rel_l2 per position (log)", first)]
    nan = sum(1 for v in prof.rel_l2 if v is not None and math.isnan(v))
    held = "1 cell holds" if nan == 1 else f"{nan} cells hold"
    note = f'<p class="muted">{held} a NaN/Inf row (not drawn).</p>' if nan else ""
    key = ('<p class="muted">One point per position cell (the worst row in it), one line per draft depth; '
           "red points: cells with rows out of tolerance.</p>")
    return f'<div class="charts">{"".join(charts)}</div>{key}{note}'
