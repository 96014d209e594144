"""compare's report: terminal (rich), JSON (docs/REPORT.md) and Markdown from the same data."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tracediff.diff.diagnose import Diagnosis
from tracediff.diff.differ import Comparison, TensorResult

REPORT_VERSION = 1
SHOWN = ("max_rel", "cosine", "argmax_agree", "kl", "equal")
NO_EXPLANATION = "no known explanation holds"


def to_dict(c: Comparison, diagnoses: list[Diagnosis]) -> dict:
    first = c.first_divergence
    return {
        "report_version": REPORT_VERSION,
        "verdict": c.verdict,
        "a": c.paths.a,
        "b": c.paths.b,
        "first_divergence": None if first is None else {"name": first.name, **(first.first_bad or {})},
        "diagnoses": [asdict(d) for d in diagnoses],
        "tensors": [asdict(t) for t in c.tensors],
        "contract": c.contract,
        "token_mismatch": c.token_mismatch,
    }


def to_json(c: Comparison, diagnoses: list[Diagnosis]) -> str:
    return json.dumps(to_dict(c, diagnoses), indent=1, default=str)


def _worst(t: TensorResult) -> str:
    return " ".join(f"{k} {t.worst[k]:.3g}" for k in SHOWN if k in t.worst)


def _numbers(t: TensorResult) -> str:
    """The first failing row's metrics, for when no diagnosis explains them."""
    metrics = (t.first_bad or {}).get("metrics") or {}
    return "first failing row: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def _where(t: TensorResult) -> str:
    bad = t.first_bad
    if not bad:
        return ""
    return (f"request {bad['request']['a']} / {bad['request']['b']}, position {bad['position']}, "
            f"depth {bad['depth']}, step {bad['step']['a']} / {bad['step']['b']}")


def render(console: Console, c: Comparison, diagnoses: list[Diagnosis]) -> None:
    color = {"match": "green", "diverged": "bold red", "incomparable": "yellow"}[c.verdict]
    first = c.first_divergence
    headline = f"[{color}]{c.verdict}[/]"
    if first is not None:
        headline += f": first diverging tensor [bold]{first.name}[/bold] ({_where(first)})"
    console.print(headline, highlight=False)
    for d in diagnoses:
        console.print(f"  why: [bold]{d.kind}[/bold]: {escape(d.message)}", highlight=False)
    if first is not None and not diagnoses:
        console.print(f"  why: {NO_EXPLANATION}; {escape(_numbers(first))}", highlight=False)
    if c.token_mismatch:
        m = c.token_mismatch
        console.print(f"[yellow]token sequences differ: request {escape(m['request_b'])} of b at position "
                      f"{m['position']} holds {m['b']}, a holds {m['a']}; only the shared prefix is "
                      "compared[/]")
    if c.contract:
        console.print("contract differences:")
        for item in c.contract:
            console.print(escape(f"  {item['key']}: a={json.dumps(item['a'])} b={json.dumps(item['b'])}"),
                          highlight=False, soft_wrap=True)
    table = Table(show_edge=False, header_style="bold")
    for column in ("tensor", "status", "rows", "failed", "not comparable", "worst"):
        table.add_column(column, no_wrap=column == "tensor")
    style = {"match": "green", "diverged": "bold red", "downstream": "red", "unchecked": "dim"}
    for t in c.tensors:
        status = f"[{style[t.status]}]{t.status}[/]" if t.status in style else t.status
        table.add_row(t.name, status, str(t.rows), str(t.failed), str(t.not_comparable), _worst(t))
    console.print(table)
    if first is not None:
        console.print(f"next: tracediff show {c.paths.b[0]} --name {first.name}", highlight=False)


def to_markdown(c: Comparison, diagnoses: list[Diagnosis]) -> str:
    first = c.first_divergence
    a, b = " ".join(c.paths.a), " ".join(c.paths.b)
    lines = [f"**tracediff compare**: `{a}` vs `{b}` — **{c.verdict}**", ""]
    if first is not None:
        lines += [f"First diverging tensor: `{first.name}` ({_where(first)})", ""]
    lines += [f"- **{d.kind}**: {d.message}" for d in diagnoses]
    if first is not None and not diagnoses:
        lines += [f"- {NO_EXPLANATION}; {_numbers(first)}"]
    lines += ["", "| tensor | status | rows | failed | worst |", "|---|---|---|---|---|"]
    lines += [f"| `{t.name}` | {t.status} | {t.rows} | {t.failed} | {_worst(t)} |" for t in c.tensors]
    return "\n".join(lines) + "\n"
