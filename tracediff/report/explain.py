"""Rendering of ``tracediff explain``: the conclusion, then one row per run (terminal or Markdown).
Names and paths read from traces are data: printed through ``safe``/``Text``, never as markup."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracediff.eagle3.chains import UNSCORED
from tracediff.eagle3.explanation import GROUP_NAMES, Explanation
from tracediff.text import safe


def accuracy_text(values: Sequence[float]) -> str:
    """Accuracy per depth, '-' where no row was scored."""
    return " / ".join("-" if math.isnan(v) else f"{v:.2f}" for v in values)


def header_lines(ex: Explanation) -> list[str]:
    """What the conclusion rests on, one line each (the terminal, Markdown and HTML say the same)."""
    differing = ", ".join(GROUP_NAMES[g] for g in ex.differing) or "none"
    agree = ", ".join(f"{side.upper()} {'-' if v is None else f'{v:.0%}'}"
                      for side, v in ex.recorded_agreement.items())
    logits = ", ".join(f"{side.upper()} {'not recorded' if v is None else f'{v:.2g}'}"
                       for side, v in ex.recorded_logits_max_diff.items())
    return [f"A: {ex.a}", f"B: {ex.b}",
            f"{ex.requests} request pair{'s' if ex.requests != 1 else ''}"
            + "".join(f" ({sum(n.values())} of {side.upper()}'s requests unpaired)"
                      for side, n in ex.unpaired.items() if sum(n.values()))
            + f", {ex.rows} shared rows"
            + (" (rows never replayed: " + ", ".join(f"{side.upper()} {n}" for side, n in
                                                     ex.rows_left.items()) + ")"
               if any(ex.rows_left.values()) else "")
            + "; scored on "
            f"{ex.scored_on}"
            + (f" ({ex.chains_unscored} more unscored: {UNSCORED})" if ex.chains_unscored else "")
            + f"; chain of {ex.depths} (from {ex.depths_from}); "
            + ("too few chains to estimate the noise" if math.isinf(ex.noise) else
               f"noise {ex.noise:.2f} tokens per verify"),
            f"inputs that differ: {differing}",
            f"recorded draft tokens the replay reproduces on each side's own inputs (depth 0): {agree}",
            f"recorded draft logits against the replay on each side's own inputs (depth 0), max |diff|: "
            f"{logits}"]


def render_explanation(console: Console, ex: Explanation) -> None:
    console.print(Text(safe(ex.conclusion), style="bold"), soft_wrap=True)
    for line in header_lines(ex):
        console.print(Text(safe(line)), soft_wrap=True)
    table = Table(show_edge=False, header_style="bold")
    for column in ("run", "accept length", "chains", "own figure", "accuracy per depth"):
        table.add_column(column, justify="left" if column in ("run", "accuracy per depth") else "right")
    for run in ex.runs:
        table.add_row(Text(run.name), f"{run.expected_accept_len:.2f}", str(run.chains),
                      f"{run.own_accept_len:.2f} ({run.own_chains})", accuracy_text(run.depth_accuracy))
    console.print(table)


def explanation_markdown(ex: Explanation) -> str:
    """The explanation as Markdown for a bug report (trace text escaped as data)."""
    def cell(text: str) -> str:
        return safe(text).replace("|", "\\|")

    lines = [f"**{cell(ex.conclusion)}**", ""] + [f"- {cell(line)}" for line in header_lines(ex)] + [
        "", "| run | accept length | chains | own figure (chains) | accuracy per depth |",
        "|---|---:|---:|---:|---|"]
    lines += [f"| {cell(r.name)} | {r.expected_accept_len:.2f} | {r.chains} | {r.own_accept_len:.2f} "
              f"({r.own_chains}) | {accuracy_text(r.depth_accuracy)} |" for r in ex.runs]
    return "\n".join(lines) + "\n"
