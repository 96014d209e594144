"""Terminal rendering of ``tracediff replay``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracediff.eagle3.chains import UNSCORED
from tracediff.eagle3.names import DRAFT_TOKEN_TARGET
from tracediff.eagle3.replay import RECORDED, ReplayReport
from tracediff.text import safe


def render_replay(console: Console, report: ReplayReport) -> None:
    heading = Text("fc input: ")
    heading.append(safe(report.aux), style="bold")  # read from the trace: data, never markup
    heading.append(f" · {report.requests} request{'s' if report.requests != 1 else ''}")
    if report.engine:
        heading.append(f" · draft computed as {report.engine} computes it ({report.engine_from})")
    console.print(heading, highlight=False)
    for note in report.engine_notes:
        console.print(Text(f"note: {note}"), soft_wrap=True)
    table = Table(show_edge=False, header_style="bold")
    for column in ("depth", "accuracy", "rows"):
        table.add_column(column, justify="right")
    for depth, (acc, rows) in enumerate(zip(report.depth_accuracy, report.depth_rows)):
        table.add_row(str(depth), "-" if rows == 0 else f"{acc:.3f}", str(rows))
    console.print(table)
    on = f"{report.chains} of the server's chains" if report.scored_on == "the server's chains" \
        else f"a chain from each of {report.chains} rows"
    if report.chains_unscored:
        on += f"; {report.chains_unscored} more unscored: {UNSCORED}"
    line = f"expected accept length (tokens per verify, chain of {len(report.depth_accuracy)}, from " \
           f"{safe(report.depths_from)}): [bold]{report.expected_accept_len:.2f}[/bold] ({on})"
    if report.verified_accept_len is not None:
        line += (f" · the server's own verify over {report.verified_chains} of those chains: "
                 f"{report.verified_accept_len:.2f}")
    depths = len(report.depth_accuracy)
    if report.server_num_steps is not None and depths != report.server_num_steps:
        line += f" (a chain of {depths}: the server drafted {report.server_num_steps}, so not its figure)"
    console.print(line, highlight=False)
    if report.not_the_servers:
        console.print(Text(f"not the server's figure: {report.not_the_servers}"), soft_wrap=True)
    without = report.requests_without_context
    if without:
        shown = ", ".join(safe(r) for r in without[:5]) + (f" and {len(without) - 5} more"
                                                           if len(without) > 5 else "")
        console.print(Text(f"left out: {len(without)} requests whose rows start past position 0 with no "
                           f"recorded request holding the rows before ({shown}): a prefix-cache hit on rows "
                           "computed for a request the trace lacks; replayed without them the draft would "
                           "attend to nothing there"), soft_wrap=True)
    check = report.self_check
    if check is not None:
        left = check.first_departure
        if left is None:
            console.print(f"self-check: fed their own recorded inputs, replay reproduces all {check.chains} "
                          f"recorded chains (draft.token at every depth; draft.hidden max rel "
                          f"{check.hidden_max_rel:.1g})", highlight=False)
        else:
            console.print(Text(safe(
                f"self-check: replay reproduces {check.reproduced} of {check.chains} recorded chains; it "
                f"leaves the recorded draft at depth {left.depth} (request {left.request}, position "
                f"{left.position}): {left.tensor} {left.detail}: "
                + ("replay maps draft ids to target ids otherwise than the server did (--d2t)"
                   if left.tensor == DRAFT_TOKEN_TARGET else "the draft is not computed as the server "
                   "computed it (its checkpoint or config, or the server's reading of it, differs)")
                + (f"; {check.suspect}" if check.suspect else ""))), soft_wrap=True)
    elif report.scored_on == "the server's chains" and report.aux != RECORDED:
        console.print("self-check: not run (--aux replaces the fc input the server recorded)",
                      highlight=False)
    if report.scored_on == "the server's chains":
        console.print(f"teacher-forced from every row (prompt rows included): "
                      f"{report.every_row_accept_len:.2f} ({report.every_row_chains} rows)", highlight=False)
