"""The report as people and tools read it: strict JSON, Markdown that trace text cannot break."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import tracediff as td
from tracediff.diff.results import Report
from tracediff.report.compare import to_markdown


def test_nan_metrics_give_strict_json_that_reads_back(tmp_path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    y = x.copy()
    y[2, 3] = np.nan
    for name, data in (("a", x), ("b", y)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", data, token_ids=np.arange(4))
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    text = report.to_json()
    assert "NaN" in text and report.first_divergence.row.position == 2
    json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # no bare NaN
    again = Report.from_json(text)
    assert np.isnan(again.first_divergence.row.metrics["max_abs"]) and again.to_json() == text


def test_trace_text_cannot_break_the_markdown(tmp_path) -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    name = "h`x|y"
    with td.record(tmp_path / "a.h5", source="train\x1b[31mRED") as rec:
        rec.log(name, x, token_ids=np.arange(3), request="<b>r0</b>")
    with td.record(tmp_path / "b.h5") as rec:
        rec.log(name, x * 2, token_ids=np.arange(3), request="*q*")
    text = to_markdown(td.compare(tmp_path / "a.h5", tmp_path / "b.h5"))
    command = "tracediff show {} {} --name '{}' --request '<b>r0</b>' --request-b '*q*' --position 0"
    next_step = f"Next: `` {command.format(tmp_path / 'a.h5', tmp_path / 'b.h5', name)} ``\n"
    assert next_step in text  # trace text as is only in a code span, which renders it literally
    text = text.replace(next_step, "")
    assert "request `<b>r0</b>` / `*q*`" in text  # request ids in code spans: literal, never a mention
    assert "| `` h`x\\|y `` | diverged |" in text and "train\\\\x1b\\[31mRED" in text
    prose = re.sub(r"(`+)[^`].*?\1", "", text)  # what is not in a code span
    assert "\x1b" not in prose and "<b>" not in prose and "&lt;b&gt;" not in prose


def test_trace_text_in_markdown_prose_never_mentions_anyone(tmp_path) -> None:
    from tracediff.text import md

    assert md("ask @octocat") == "ask @\u2060octocat"  # renders as "@octocat", links to nobody
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for side, scale in (("a", 1), ("b", 2)):
        with td.record(tmp_path / f"{side}.h5", source="@octocat") as rec:
            rec.log("h", x * scale, token_ids=np.arange(3), request="@octocat")
    text = to_markdown(td.compare(tmp_path / "a.h5", tmp_path / "b.h5"))
    prose = re.sub(r"(`+)[^`].*?\1", "", text)
    assert "@octocat" not in prose and "@\u2060octocat" in prose


def test_an_incomparable_headline_gives_the_reason_not_a_divergence(tmp_path) -> None:
    from tests.conftest import cli

    for name, layers in (("a", 4), ("b", 6)):
        with td.record(tmp_path / f"{name}.h5", meta={"target_config": {"num_hidden_layers": layers}}) as rec:
            values = np.random.default_rng(ord(name)).standard_normal((3, 8))
            rec.log("h", values, token_ids=[1, 2, 3])
    out = cli("compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert out.returncode == 2
    assert out.stdout.splitlines()[0] == ("incomparable (3 rows compared, coverage 100%): different target "
                                          "models: target_config.num_hidden_layers a 4, b 6 (--same-target "
                                          "if they are the same model)")


def test_a_missing_rank_file_keeps_the_verdict_from_a_match(tmp_path) -> None:
    from tracediff.report.compare import headline

    for rank in (0, 1):
        with td.record(tmp_path / "run.h5", rank=rank, world_size=2) as rec:
            rec.log("h", np.full((2, 4), rank, np.float32), token_ids=[1, 2], request=f"r{rank}")
    (tmp_path / "run.rank1.h5").unlink()
    report = td.compare(tmp_path / "run.rank0.h5", tmp_path / "run.rank0.h5")
    assert report.a.world_size == 2 and len(report.a.paths) == 1
    assert report.verdict == "incomplete" and [g.kind for g in report.a.gaps] == ["ranks_missing"]
    assert headline(report).startswith("incomplete: a holds 1 of the run's 2 rank files"), headline(report)


def test_show_prints_trace_text_as_data_never_markup_or_escapes(tmp_path) -> None:
    """Names, request ids and metadata from a trace reach the terminal as the characters they are:
    rich markup is printed literally, terminal escapes are shown escaped."""
    import io

    from rich.console import Console

    from tracediff.report.show import render_stats, render_summary
    from tracediff.trace.summary import summarize, tensor_stats

    names = ["m.[bold red]RED[/bold red]", "m.a\x1b[31mANSI\x1b[0m", "m.[link=http://evil]x[/link]",
             "m.\x1b]0;TITLE\x07t"]
    with td.record(tmp_path / "t.h5", source="[red]src[/red]") as rec:
        for name in names:
            rec.log(name, np.ones((2, 4), np.float32), token_ids=[1, 2], request="[b]r[/b]\x1b[2J")
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system="truecolor")
    with td.open_trace(tmp_path / "t.h5") as trace:
        render_summary(console, summarize(trace))
        render_stats(console, tensor_stats(trace.rows(names[0])), "request=[b]r[/b]")
    text = out.getvalue()
    for shown in ("m.[bold red]RED[/bold red]", "m.a\\x1b[31mANSI\\x1b[0m", "m.[link=http://evil]x[/link]",
                  "m.\\x1b]0;TITLE\\x07t", "[red]src[/red]", "request=[b]r[/b]"):
        assert shown in text, shown
    assert "\x1b]" not in text and "\x1b[31m" not in text and "\x1b[2J" not in text  # none from the trace


def test_tensors_on_one_side_and_remarks_beside_a_match_are_said_as_such(tmp_path) -> None:
    """A match rests on the tensors both sides hold: the report names the ones it never compared, and
    a diagnosis beside a match is a note, not a cause."""
    import io

    from rich.console import Console

    from tracediff.report.compare import render

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", x, token_ids=[5, 6, 7], request="p")
        rec.log("only.here", x, token_ids=[5, 6, 7], request="p")
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", x, token_ids=[5, 6, 7], request="p")
        rec.log("h", x, token_ids=[1, 2, 3], request="q")  # a request a never saw
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    out = io.StringIO()
    render(Console(file=out, width=200), report)
    text = out.getvalue()
    assert report.verdict == "match" and "not compared, a: 1 tensor that b lacks (only.here)" in text
    assert "note: token_mismatch" in text and "why:" not in text
    assert "Not compared, a: 1 tensor that b lacks (only.here)." in to_markdown(report)


def test_an_incomparable_pair_is_not_reported_as_a_divergence_to_chase(tmp_path) -> None:
    """Different target models: the verdict says so, and the report offers no unexplained-divergence
    line and no next step into the rows; a divergence's next step is a command that pastes."""
    import io

    from rich.console import Console

    from tracediff.report.compare import render

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    name = "m.[b]x y[/b]"
    for path, model, shift in (("a.h5", "sha-a", 0.0), ("b.h5", "sha-b", 1.0), ("c.h5", "sha-a", 1.0)):
        with td.record(tmp_path / path) as rec:
            rec.update_contract(target_embedding_sha256=model)
            rec.log(name, x + shift, token_ids=[5, 6, 7], request="p")

    def text(b: str) -> str:
        out = io.StringIO()
        render(Console(file=out, width=300), td.compare(tmp_path / "a.h5", tmp_path / b))
        return out.getvalue()

    incomparable = text("b.h5")
    assert incomparable.startswith("incomparable") and "next:" not in incomparable
    assert "no known explanation" not in incomparable
    diverged = text("c.h5")
    assert f"next: tracediff show {tmp_path / 'a.h5'} {tmp_path / 'c.h5'} --name 'm.[b]x y[/b]' " \
           "--request p --position 0\n" in diverged


def _next_line(report: Report) -> str | None:
    """The ``next:`` line of the terminal report, if any."""
    import io

    from rich.console import Console

    from tracediff.report.compare import render

    out = io.StringIO()
    render(Console(file=out, width=400), report)
    return next((line for line in out.getvalue().splitlines() if line.startswith("next: ")), None)


def test_the_next_step_shows_the_failing_row_on_both_sides_in_text_and_markdown(tmp_path) -> None:
    """Both traces, each side's request (producers name them differently), the position, and the
    draft depth when it is not 0; the Markdown report holds the same command in a code span."""
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for path, request, shift in (("a b.h5", "sample0", 0.0), ("c.h5", "req 0", 1.0)):
        with td.record(tmp_path / path) as rec:
            rec.log("draft.hidden", x, token_ids=[5, 6, 7], request=request)
            deeper = {"token_ids": [6, 7], "positions": [1, 2], "request": request, "depth": 1}
            rec.log("draft.input_ids", np.array([9, 4]), **deeper)  # fed the same tokens on both sides
            rec.log("draft.hidden", x[1:] + shift, **deeper)
    report = td.compare(tmp_path / "a b.h5", tmp_path / "c.h5")
    assert report.verdict == "diverged" and report.first_divergence.row.depth == 1
    command = (f"tracediff show '{tmp_path / 'a b.h5'}' {tmp_path / 'c.h5'} --name draft.hidden --request "
               "sample0 --request-b 'req 0' --position 1 --depth 1")
    assert _next_line(report) == f"next: {command}"
    assert f"\nNext: `{command}`\n" in to_markdown(report)


def test_the_next_step_quotes_control_characters_and_names_rank_files_by_their_stem(tmp_path) -> None:
    """A request id with a terminal escape is written ANSI-C quoted (its escape as text; the shell
    reads back the very id). Rank files are named by their stem, which opens them all; a static
    tensor is shown whole (no row to name)."""
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", x, token_ids=[5, 6, 7], request="r\x1b[2J")
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", x + 1, token_ids=[5, 6, 7], request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    line = _next_line(report)
    assert report.verdict == "diverged" and line is not None and "\x1b" not in line
    assert "--request $'r\\x1b[2J' --request-b r" in line
    assert line.removeprefix("next: ") in to_markdown(report)
    for rank in (0, 1):
        with td.record(tmp_path / "run.h5", rank=rank, world_size=2) as rec:
            rec.log("h", x, token_ids=[5, 6, 7], request=f"r{rank}")
            rec.log_static("w", np.ones(4, np.float32))
    with td.record(tmp_path / "w.h5") as rec:
        rec.log("h", x, token_ids=[5, 6, 7], request="r0")
        rec.log_static("w", np.zeros(4, np.float32))
    report = td.compare(tmp_path / "run.h5", tmp_path / "w.h5")
    assert report.a.paths == [str(tmp_path / "run.rank0.h5"), str(tmp_path / "run.rank1.h5")]
    assert report.first_divergence.name == "w"
    assert _next_line(report) == f"next: tracediff show {tmp_path / 'run.h5'} {tmp_path / 'w.h5'} --name w"


def test_the_row_view_prints_trace_text_as_data(tmp_path) -> None:
    """Request ids and names from the traces reach the terminal as the characters they are."""
    import io

    from rich.console import Console

    from tracediff.diff.rowview import row_view
    from tracediff.report.show import render_row_view

    name, request = "m.[bold]x[/bold]\x1b[2J", "[b]r[/b]\x1b]0;T\x07"
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    for path, shift in (("a.h5", 0.0), ("b.h5", 1.0)):
        with td.record(tmp_path / path) as rec:
            rec.log(name, x + shift, token_ids=[1, 2], request=request)
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system="truecolor")
    render_row_view(console, row_view(tmp_path / "a.h5", tmp_path / "b.h5", name, position=1))
    text = out.getvalue()
    assert "m.[bold]x[/bold]\\x1b[2J" in text and "request [b]r[/b]\\x1b]0;T\\x07, position 1" in text
    assert "\x1b]" not in text and "\x1b[2J" not in text  # none from the trace
    assert "4 of 4 elements differ" in text and "largest differences (4 of 4):" in text


def test_the_next_step_names_the_steps_unless_both_are_0(tmp_path) -> None:
    """A request recorded at several steps (epochs, a retried id) needs the diverging row's step on
    each side; --step-b only where b's differs from a's. Text and Markdown give the same command,
    and the rows it names are the ones compare measured."""
    import shlex

    from tracediff.diff.rowview import row_view
    from tracediff.report.compare import next_command

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for path, epochs in (("a.h5", [(0, x), (1, x + 1)]), ("b.h5", [(5, x)]), ("c.h5", [(0, x + 1)])):
        with td.record(tmp_path / path) as rec:
            for step, rows in epochs:
                rec.log("h", rows, token_ids=[5, 6, 7], request="R", step=step)
    for a, b, steps in (("a.h5", "b.h5", ["--step", "1", "--step-b", "5"]),
                        ("c.h5", "b.h5", ["--step", "0", "--step-b", "5"]),
                        ("a.h5", "a.h5", None)):
        report = td.compare(tmp_path / a, tmp_path / b)
        if steps is None:
            assert report.verdict == "match" and next_command(report) is None
            continue
        command = next_command(report)
        assert command is not None and shlex.split(command)[-4:] == steps
        assert _next_line(report) == f"next: {command}" and f"\nNext: `{command}`\n" in to_markdown(report)
        row = report.first_divergence.row
        view = row_view(tmp_path / a, tmp_path / b, "h", request="R", position=row.position,
                        step=int(steps[1]), step_b=int(steps[3]))
        assert (view.a.step, view.b.step) == (row.step_a, row.step_b)
        assert view.metrics == pytest.approx(row.metrics, rel=1e-12) and view.differing == 8


def test_the_next_step_names_bs_tensor_as_compare_map_renamed_it(tmp_path) -> None:
    """Under --map b calls the tensor otherwise: the command names b's tensor too, and it runs."""
    import shlex

    from tests.conftest import cli

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for side, name, scale in (("a", "target.layer.3", 1), ("b", "model.layers.3", 2)):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log(name, x * scale, token_ids=[5, 6, 7], request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", rename={"model.layers.3": "target.layer.3"})
    assert report.renamed == {"model.layers.3": "target.layer.3"}
    assert Report.from_json(report.to_json()).renamed == report.renamed
    line = _next_line(report)
    assert line is not None and "--name target.layer.3 --name-b model.layers.3" in line
    argv = shlex.split(line.removeprefix("next: "))
    shown = cli(*argv[1:])
    assert shown.returncode == 0, shown.stderr
    assert "8 of 8 elements differ" in shown.stdout


def _page_text(page: str) -> str:
    import html

    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_a_static_tensor_has_no_error_profile_by_nature_and_the_html_page_says_so(tmp_path) -> None:
    """A static tensor (draft.d2t) is compared whole, as one row: it has no positions, so no profile.
    A full report must not say its profile was left out (e.g. by a bundle's budget); a trimmed one
    counts only the row tensors whose profile it dropped."""
    import dataclasses

    from tracediff.report.html import render_html

    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    d2t = np.arange(4, dtype=np.int64)
    for side, table in (("a", d2t), ("b", d2t), ("c", d2t + 1)):
        with td.record(tmp_path / f"{side}.h5", source=side) as rec:
            rec.log("target.layer.1", x, token_ids=np.arange(6), request="r")
            rec.log_static("draft.d2t", table)
    full = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert [(t.name, t.static, t.profile is None) for t in full.tensors] == [
        ("target.layer.1", False, False), ("draft.d2t", True, True)]
    assert Report.from_json(full.to_json()) == full
    text = _page_text(render_html(full))
    assert "no error profile in this report" not in text and "left out" not in text
    assert "1 static tensor (draft.d2t) is compared whole, as one row: it has no positions, so no error " \
           "profile by nature; not drawn below." in text
    trimmed = dataclasses.replace(full, tensors=[dataclasses.replace(t, profile=None) for t in full.tensors])
    text = _page_text(render_html(trimmed))
    assert "1 compared tensor carries no error profile in this report (left out to keep it small" in text
    # a static first divergence: no per-position curves, and no claim that they were left out
    static_first = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    assert static_first.first_divergence.name == "draft.d2t"
    text = _page_text(render_html(static_first))
    assert "left out" not in text
    assert "The first divergence is in the static tensor draft.d2t (no position)" in text


def test_a_trace_compared_with_itself_is_noted_through_any_path_or_hard_link(tmp_path) -> None:
    """``compare X X`` matches trivially: the report says the two sides are the same file, by device
    and inode (the same path, another path to it, a hard link), in JSON, terminal and Markdown; a
    copy is another file."""
    import io
    import os
    import shutil

    from rich.console import Console

    from tracediff.report.compare import render

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    with td.record(tmp_path / "x.h5") as rec:
        rec.log("h", x, token_ids=[1, 2, 3], request="r")
    (tmp_path / "sub").mkdir()
    os.link(tmp_path / "x.h5", tmp_path / "sub" / "linked.h5")
    shutil.copy(tmp_path / "x.h5", tmp_path / "copy.h5")
    x_path = str(tmp_path / "x.h5")
    for other in (x_path, str(tmp_path / "sub" / ".." / "x.h5"), str(tmp_path / "sub" / "linked.h5")):
        report = td.compare(x_path, other)
        assert report.verdict == "match" and report.same_file
        assert Report.from_json(report.to_json()).same_file and '"same_file": true' in report.to_json()
        note = (f"note: a and b are the same file ({x_path}" + ("" if other == x_path else f" and {other}")
                + "): the trace is compared with itself, which says nothing about another run")
        out = io.StringIO()
        render(Console(file=out, width=400), report)
        assert note in out.getvalue().splitlines()
        assert f"- {note}" in to_markdown(report).replace("\\_", "_").splitlines()
    copied = td.compare(x_path, tmp_path / "copy.h5")
    assert copied.verdict == "match" and not copied.same_file
    assert "same file" not in to_markdown(copied)
