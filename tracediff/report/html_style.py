"""The report page's stylesheet (inline: the page is one self-contained file), light and dark."""

CSS = """
:root { --bg: #ffffff; --fg: #1d2330; --muted: #5f6878; --line: #dde1e8; --panel: #f6f7f9; --code: #eef0f4;
  --red: #c62828; --red-bg: #fdecea; --green: #1a7f37; --green-bg: #e7f5ec; --amber: #a15c00;
  --amber-bg: #fff4e0; --blue: #1f5fa8; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #14171c; --fg: #e3e6eb; --muted: #9aa3b2; --line: #2d333d; --panel: #1b1f26; --code: #252a33;
    --red: #ff6b6b; --red-bg: #3a1d1f; --green: #4cc27a; --green-bg: #16301f; --amber: #f0b45a;
    --amber-bg: #33280f; --blue: #7fb0ff; }
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1360px; margin: 0 auto; padding: 24px 20px 64px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace;
  font-size: 0.92em; overflow-wrap: anywhere; }
code { background: var(--code); padding: 1px 5px; border-radius: 4px; }
h1 { font-size: 26px; line-height: 1.3; margin: 6px 0 4px; font-weight: 650; }
h2 { font-size: 18px; margin: 0 0 10px; font-weight: 650; }
section { margin-top: 18px; padding: 18px 20px; border: 1px solid var(--line); border-radius: 10px; }
section > p:first-of-type { margin-top: 0; }
.muted { color: var(--muted); }
.warn { border-left: 4px solid var(--amber); padding-left: 8px; }
.kicker { font-size: 13px; letter-spacing: 0.06em; text-transform: uppercase; color: var(--muted); }
header.verdict { padding: 20px 22px; border-radius: 12px; border: 1px solid var(--line);
  border-left-width: 8px; }
.v-diverged { border-left-color: var(--red) !important; background: var(--red-bg); }
.v-match { border-left-color: var(--green) !important; background: var(--green-bg); }
.v-incomplete, .v-incomparable { border-left-color: var(--amber) !important; background: var(--amber-bg); }
.badge { display: inline-block; font-size: 15px; font-weight: 700; letter-spacing: 0.05em;
  text-transform: uppercase; color: #fff; padding: 3px 12px; border-radius: 999px; vertical-align: 4px;
  margin-right: 8px; }
.v-diverged .badge { background: var(--red); } .v-match .badge { background: var(--green); }
.v-incomplete .badge, .v-incomparable .badge { background: var(--amber); }
@media (prefers-color-scheme: dark) { .badge { color: #111; } }
.where { font-size: 15px; margin: 4px 0; }
.metrics span { display: inline-block; margin-right: 14px; }
.files { color: var(--muted); margin: 6px 0 0; font-size: 14px; }
.diag { margin: 0 0 12px; padding: 10px 14px; border-radius: 8px; background: var(--panel); }
.diag .kind { font-weight: 700; }
.sev { font-size: 12px; font-weight: 700; text-transform: uppercase; padding: 1px 8px; border-radius: 999px;
  margin-right: 6px; color: #fff; background: var(--muted); }
.sev-error { background: var(--red); } .sev-warning { background: var(--amber); }
ul.plain { margin: 6px 0; padding-left: 20px; }
.figure-scroll { overflow-x: auto; }
svg.heatmap, svg.curve { max-width: 100%; height: auto; }
svg text { fill: var(--fg); font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; }
.hm-label { font: 12px ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; }
.hm-label-first { fill: var(--red); font-weight: 700; }
.hm-axis { font-size: 12px; } .hm-tick, .cv-tick { font-size: 11px; fill: var(--muted); }
.hm-caption { font-size: 12px; fill: var(--muted); }
.hm-count { font-size: 11px; fill: var(--muted); } .hm-bad { fill: var(--red); font-weight: 600; }
.hm-rule { stroke: var(--muted); stroke-width: 1; }
.hm-first-outer { fill: none; stroke: var(--fg); stroke-width: 3.5; }
.hm-first-inner { fill: none; stroke: var(--bg); stroke-width: 1.2; }
.hm-pin { stroke: var(--fg); stroke-width: 1.5; stroke-dasharray: 3 2; }
.hm-first-label { font-size: 13px; font-weight: 700; fill: var(--red); }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
.cv-title { font-size: 13px; font-weight: 600; }
.cv-frame { fill: none; stroke: var(--line); } .cv-grid { stroke: var(--line); stroke-width: 0.8; }
.cv-first { stroke: var(--red); stroke-width: 1.5; stroke-dasharray: 5 3; }
.cv-first-label { font-size: 11px; fill: var(--red); font-weight: 600; }
table { border-collapse: collapse; font-size: 13.5px; }
table.tensors, table.contract { width: 100%; }
table.tensors th, table.tensors td, table.contract th, table.contract td { text-align: left; padding: 5px 8px;
  border-bottom: 1px solid var(--line); vertical-align: top; }
th { font-weight: 600; color: var(--muted); font-size: 12.5px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.row-first td { background: var(--red-bg); }
tr.row-first td:first-child { box-shadow: inset 4px 0 var(--red); }
.status { font-size: 12px; padding: 1px 8px; border-radius: 999px; white-space: nowrap;
  background: var(--panel); }
.st-match { color: var(--green); } .st-diverged { color: #fff; background: var(--red); font-weight: 700; }
.st-downstream { color: var(--red); } .st-unchecked { color: var(--muted); }
.st-not_comparable, .st-shape_mismatch, .st-dtype_mismatch, .st-mixed_records { color: var(--amber); }
.st-missing_in_a, .st-missing_in_b { color: var(--muted); }
figure.slots { margin: 10px 0 4px; }
figure.slots figcaption { font-size: 13px; color: var(--muted); margin-bottom: 6px; }
.slot-matrix th, .slot-matrix td { border: 1px solid var(--line); padding: 6px 10px; }
.slot-matrix th.sm-row { text-align: left; white-space: nowrap; }
.slot-matrix th.sm-col { text-align: center; white-space: nowrap; min-width: 140px; }
.sm-cell { width: 96px; height: 40px; text-align: center; font-weight: 700; font-size: 16px; }
.sm-same { background: #2e8b57; color: #fff; } .sm-moved { background: #d9771e; color: #fff; }
.sm-normed { background: #e7c14a; color: #222; } .sm-wrong { background: var(--red-bg); color: var(--red); }
.tokens { font: 12.5px/1.35 ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; }
.tok-line { display: flex; flex-wrap: nowrap; margin-bottom: 10px; }
.tok { display: flex; flex-direction: column; align-items: center; min-width: 50px; padding: 2px 3px;
  border: 1px solid transparent; border-radius: 5px; }
.tok span { padding: 0 2px; } .tok .tok-pos { font-size: 10.5px; color: var(--muted); }
.tok-side { color: var(--muted); min-width: 34px; font-weight: 600; }
.tok-diff { background: var(--red-bg); }
.tok-first { background: var(--red); color: #fff; font-weight: 700; } .tok-first .tok-pos { color: #fff; }
.tok-focus { border: 2px solid var(--blue); }
.tok-key { padding: 0 6px; border-radius: 4px; font-size: 13px; }
.tok-key.tok-focus { border-width: 2px; }
.compared { margin-top: 12px; padding-top: 10px; border-top: 1px solid var(--line); font-size: 14px; }
.compared p { margin: 0 0 4px; } .compared ul { margin: 0; }
details summary { cursor: pointer; color: var(--muted); margin: 6px 0; }
"""
