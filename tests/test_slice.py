"""tracediff slice: a smaller trace that is still a trace. Selection semantics per axis, what is copied
whole (metadata, contract, statics, token sequences), per-rank traces (a rank file the selection keeps
nothing of is not written), outputs that would overwrite or hide files or join another trace's rank
files, names and requests taken whole (commas included), and bad input."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import tracediff as td
from tracediff.cli import app
from tracediff.errors import InputError
from tracediff.trace.slice import Selection, Span, parse_spans, slice_trace
from tracediff.trace.summary import summarize

REQUESTS = ("r0", "r1")
LENGTH = 12  # tokens per request; each step logs 4 positions of each request


def tokens_of(request: str) -> np.ndarray:
    return np.arange(LENGTH) + (100 if request == "r0" else 200)


def values(request: str, positions: np.ndarray, depth: int = 0, width: int = 8) -> np.ndarray:
    """Row values that say which key they belong to (a slice must keep rows with their keys)."""
    code = (1000 if request == "r1" else 0) + positions[:, None] * 10 + depth
    return (code + np.arange(width)[None, :] / 100).astype(np.float32)


def write_trace(path: Path, rank: int | None = None, world_size: int | None = None) -> Path:
    """3 steps x 2 requests x 4 positions; target rows at depth 0, draft rows at depths 0..2; a static
    d2t; each request's whole token sequence declared; a contract learned during the run. With
    ``rank``, the recorder writes ``stem.rankR.ext``."""
    ranks = {} if rank is None else {"rank": rank, "world_size": world_size}
    with td.record(path, source="serving", meta={"target_model": "tiny", "aux_layer_ids": [1, 2]},
                   **ranks) as rec:
        rec.log_static("draft.d2t", np.arange(16, dtype=np.int64))
        for request in REQUESTS:
            rec.request_tokens(request, tokens_of(request))
        for step in range(3):
            for request in REQUESTS:
                at = np.arange(4 * step, 4 * step + 4)
                keys = dict(step=step, request=request, positions=at, token_ids=tokens_of(request)[at])
                rec.log("target.layer.0", values(request, at), **keys)
                for depth in range(3):  # each chain fed the target's next tokens (what compare pairs by)
                    fed = tokens_of(request)[np.minimum(at + depth + 1, LENGTH - 1)]
                    rec.log("draft.input_ids", fed, depth=depth, **keys)
                    rec.log("draft.hidden", values(request, at, depth), depth=depth, **keys)
        rec.update_contract(speculative_args={"num_steps": 3})
    return path


@pytest.fixture
def trace_path(tmp_path: Path, fmt: str) -> Path:
    return write_trace(tmp_path / f"run.{fmt}")


def digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_requests_positions_and_steps_keep_exactly_the_rows_they_name(trace_path, tmp_path) -> None:
    out = tmp_path / f"small{trace_path.suffix}"
    selection = Selection(names=("target.*",), requests=("r1",), positions=(Span(2, 6),), steps=(Span(0, 2),))
    result = slice_trace(trace_path, out, selection)
    with td.open_trace(out) as small:
        assert small.names() == ["target.layer.0"] == result.names
        rows = small.rows("target.layer.0")
    # positions 2, 3 were logged at step 0 and 4, 5 at step 1; r0's rows and step 2 are gone
    assert rows.request.tolist() == ["r1"] * 4 and rows.position.tolist() == [2, 3, 4, 5]
    assert rows.step.tolist() == [0, 0, 1, 1] and rows.token_id.tolist() == [202, 203, 204, 205]
    np.testing.assert_array_equal(rows.numpy(), values("r1", np.arange(2, 6)))
    assert (result.records, result.rows) == (2, 4)


def test_depths_and_steps_choose_records_and_statics_of_a_kept_name_stay(trace_path, tmp_path) -> None:
    out = tmp_path / f"small{trace_path.suffix}"
    slice_trace(trace_path, out, Selection(names=("draft.h*", "draft.d2t"), steps=(Span(2, None),),
                                           depths=(Span(1, 3),)))
    with td.open_trace(out) as small:
        assert small.names() == ["draft.d2t", "draft.hidden"]
        rows = small.rows("draft.hidden")
        assert sorted(set(rows.depth.tolist())) == [1, 2] and set(rows.step.tolist()) == {2}
        d2t = small.read(small.select(name="draft.d2t")[0])
    assert d2t.static and d2t.numpy().tolist() == list(range(16))  # steps and depths never drop a static
    np.testing.assert_array_equal(rows.numpy()[rows.depth == 2][:4], values("r0", np.arange(8, 12), 2))


def test_the_slice_keeps_metadata_contract_and_whole_token_sequences(trace_path, tmp_path) -> None:
    out = tmp_path / f"small{trace_path.suffix}"
    selection = Selection(requests=("r0",), positions=(Span(8, 9),))
    slice_trace(trace_path, out, selection)
    with td.open_trace(trace_path) as full, td.open_trace(out) as small:
        assert {k: v for k, v in small.meta.items() if k != "sliced_from"} == full.meta
        assert small.meta["sliced_from"] == {"path": str(trace_path), "selection": selection.to_dict()}
        assert small.contract == full.contract and small.contract["speculative_args"] == {"num_steps": 3}
        table = small.request_tokens()
        assert table.requests() == ["r0"]  # r1's tokens go with r1's rows
        assert table.sequence("r0")[1].tolist() == tokens_of("r0").tolist()  # all 12, not just position 8
        final = small.finals[0]  # d2t; of step 2 target.layer.0, and 2 draft tensors at 3 depths
        assert final["records"] == 8 and final["tokens"] == LENGTH and final["closed"] is True


def test_a_slice_is_a_valid_trace_that_show_and_compare_read(trace_path, tmp_path) -> None:
    out = tmp_path / f"small{trace_path.suffix}"
    slice_trace(trace_path, out, Selection(requests=("r1",), positions=(Span(0, 6),), depths=(Span(0, 2),)))
    with td.open_trace(out) as small:
        summary = summarize(small)
    assert [(t.name, t.rows) for t in summary.tensors] == [("draft.d2t", 0), ("target.layer.0", 6),
                                                           ("draft.input_ids", 12), ("draft.hidden", 12)]
    report = td.compare(trace_path, out)
    # every row the slice kept matches; the depth it left out was never compared, and says so
    assert report.first_divergence is None and report.coverage.fraction == 1.0
    assert report.verdict == "incomplete" and report.reasons == [
        "depth 2: only a recorded rows there (48 / 0 rows): never compared"]
    shown = CliRunner().invoke(app, ["show", str(out)])
    assert shown.exit_code == 0 and "target.layer.0" in shown.stdout


def test_reading_the_source_never_modifies_it(trace_path, tmp_path) -> None:
    before = digest(trace_path)
    slice_trace(trace_path, tmp_path / "small.h5", Selection(requests=("r0",)))
    slice_trace(trace_path, tmp_path / "small.arrow", Selection(names=("draft.*",)))
    assert digest(trace_path) == before


def test_a_trace_of_rank_files_is_sliced_per_rank(tmp_path, fmt) -> None:
    for rank in (0, 1):
        write_trace(tmp_path / f"run.{fmt}", rank=rank, world_size=2)
    result = slice_trace(tmp_path / f"run.{fmt}", tmp_path / f"small.{fmt}",
                         Selection(positions=(Span(0, 4),)))
    assert [p.name for p in result.paths] == [f"small.rank0.{fmt}", f"small.rank1.{fmt}"]
    with td.open_trace(tmp_path / f"small.{fmt}") as small:
        rows = small.rows("target.layer.0")
        assert sorted(set(rows.rank.tolist())) == [0, 1] and set(rows.position.tolist()) == {0, 1, 2, 3}
        assert [f.meta["rank"] for f in small.files] == [0, 1]


def test_an_output_that_is_the_input_is_refused(trace_path) -> None:
    before = digest(trace_path)
    same = trace_path.parent / "." / trace_path.name
    with pytest.raises(InputError, match="would overwrite the input"):
        slice_trace(trace_path, same, Selection())
    assert digest(trace_path) == before


@pytest.mark.parametrize("text, span", [("3:7", Span(3, 7)), ("3:", Span(3, None)), (":7", Span(None, 7)),
                                        ("5", Span(5, 6)), (" -1:2 ", Span(-1, 2))])
def test_spans_are_half_open(text, span) -> None:
    assert Span.parse(text) == span
    inside = [(span.start is None or v >= span.start) and (span.stop is None or v < span.stop)
              for v in range(-2, 10)]
    assert span.mask(np.arange(-2, 10)).tolist() == inside and any(inside) and not all(inside)


@pytest.mark.parametrize("text, why", [("7:3", "empty"), ("3:3", "empty"), ("a:b", "expected A:B"),
                                       ("1.5:2", "expected A:B"), ("", None)])
def test_bad_spans_say_why(text, why) -> None:
    if why is None:
        assert parse_spans([text]) is None  # no value: no restriction
        return
    with pytest.raises(ValueError, match=why):
        parse_spans([text])


def test_the_command_writes_the_slice(trace_path, tmp_path) -> None:
    out = tmp_path / "small.arrow"
    done = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(out), "--names", "target.*",
                                    "--names", "draft.d2t", "--requests", "r1", "--positions", "4:8",
                                    "--steps", "1", "--depths", "0"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 2 records, 4 rows, {LENGTH} request tokens")
    assert done.stderr == ""
    with td.open_trace(out) as small:
        assert small.names() == ["draft.d2t", "target.layer.0"]


@pytest.mark.parametrize("args, line", [
    (["--positions", "9:3"], "error: --positions: '9:3' is empty: B must be greater than A"),
    (["--positions", "x"], "error: --positions: expected A:B (integers, half-open), got 'x'"),
    (["--steps", "1-3"], "error: --steps: expected A:B (integers, half-open), got '1-3'"),
])
def test_bad_options_are_one_error_line(trace_path, tmp_path, args, line) -> None:
    done = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(tmp_path / "s.h5"), *args])
    assert (done.exit_code, done.stdout, done.stderr) == (2, "", line + "\n")
    assert not (tmp_path / "s.h5").exists()


def test_bad_files_are_one_error_line(trace_path, tmp_path) -> None:
    missing = CliRunner().invoke(app, ["slice", str(tmp_path / "none.h5"), "-o", str(tmp_path / "s.h5")])
    assert (missing.exit_code, missing.stderr) == (2, f"error: {tmp_path / 'none.h5'}: no such file\n")
    before = digest(trace_path)
    same = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(trace_path)])
    assert (same.exit_code, same.stderr) == (2, f"error: {trace_path}: output would overwrite the input\n")
    assert digest(trace_path) == before
    suffix = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(tmp_path / "s.txt")])
    assert suffix.exit_code == 2 and suffix.stderr.startswith(f"error: {tmp_path / 's.txt'}: cannot tell")
    assert suffix.stderr.count("\n") == 1


def test_a_request_id_or_name_with_a_comma_is_taken_whole(tmp_path) -> None:
    path, out = tmp_path / "comma.h5", tmp_path / "small.h5"
    x = np.ones((4, 2), np.float32)
    with td.record(path) as rec:
        rec.log("t.x", x, token_ids=[1, 2, 3, 4], request="chat,42", step=0)
        rec.log("t.x", x * 2, token_ids=[1, 2, 3, 5], request="chat", step=1)
        rec.log("t.x,y", x, token_ids=[1, 2, 3, 4], request="chat,42", step=0)
    done = CliRunner().invoke(app, ["slice", str(path), "-o", str(out), "--requests", "chat,42",
                                    "--names", "t.x,y"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 1 record, 4 rows, 4 request tokens (")  # 1: singular
    with td.open_trace(out) as small:
        assert small.names() == ["t.x,y"] and set(small.rows("t.x,y").request.tolist()) == {"chat,42"}


def test_what_matches_nothing_is_named_even_when_statics_are_kept(trace_path, tmp_path) -> None:
    out = tmp_path / f"s{trace_path.suffix}"
    done = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(out), "--requests", "r9",
                                    "--requests", "r1", "--names", "draft.*", "--names", "nosuch.*"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 19 records, 72 rows, {LENGTH} request tokens")  # d2t, r1's
    hint = "(tracediff show TRACE lists names, requests and steps)"
    assert done.stderr.splitlines() == [
        f"tracediff: note: --names 'nosuch.*' matched nothing in {trace_path} {hint}",
        f"tracediff: note: --requests 'r9' matched nothing in {trace_path} {hint}"]
    result = slice_trace(trace_path, tmp_path / f"t{trace_path.suffix}", Selection(requests=("r9",)))
    assert result.records == 1 and result.unmatched_requests == ["r9"]  # the static d2t alone


def test_an_existing_output_is_never_overwritten(trace_path, tmp_path) -> None:
    out = tmp_path / f"s{trace_path.suffix}"
    out.write_bytes(b"mine")
    done = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(out)])
    assert (done.exit_code, done.stdout) == (2, "")
    assert done.stderr == f"error: {out}: exists: pass --force to replace it (nothing was written)\n"
    assert out.read_bytes() == b"mine"


def test_an_output_that_would_hide_rank_files_is_refused(tmp_path, fmt) -> None:
    for rank in (0, 1):
        write_trace(tmp_path / f"run.{fmt}", rank=rank, world_size=2)
    stem = tmp_path / f"run.{fmt}"
    before = [digest(tmp_path / f"run.rank{r}.{fmt}") for r in (0, 1)]
    # a rank file sliced into the stem of its own ranks: `run` would name the slice, no longer the ranks
    with pytest.raises(InputError, match=rf"is the stem of the rank files run.rank0.{fmt}, run.rank1.{fmt}: "
                                         "a trace written there would hide them"):
        slice_trace(tmp_path / f"run.rank0.{fmt}", stem, Selection(names=("target.*",)))
    assert not stem.exists() and [digest(tmp_path / f"run.rank{r}.{fmt}") for r in (0, 1)] == before
    with td.open_trace(stem) as still:
        assert len(still.files) == 2
    # a trace of rank files sliced next to a file named like the output stem: that file would hide them
    (tmp_path / f"small.{fmt}").write_bytes(b"mine")
    with pytest.raises(InputError, match="exists: it would hide the slice's rank files"):
        slice_trace(stem, tmp_path / f"small.{fmt}", Selection())
    assert not list(tmp_path.glob(f"small.rank*.{fmt}"))
    # a stale rank file beyond the slice's ranks would be read with them as one trace
    (tmp_path / f"other.rank5.{fmt}").write_bytes(b"old")
    with pytest.raises(InputError, match="it would be read as a rank of the slice"):
        slice_trace(stem, tmp_path / f"other.{fmt}", Selection())


def test_positions_take_several_ranges(trace_path, tmp_path) -> None:
    out = tmp_path / f"s{trace_path.suffix}"
    done = CliRunner().invoke(app, ["slice", str(trace_path), "-o", str(out), "--names", "target.*",
                                    "--positions", "1:3,9", "--positions", "5"])
    assert done.exit_code == 0, done.stderr
    with td.open_trace(out) as small:
        rows = small.rows("target.layer.0")
        assert sorted(set(rows.position.tolist())) == [1, 2, 5, 9] and len(rows.position) == 8  # 2 requests


def write_ranks(tmp_path: Path, fmt: str) -> Path:
    """run.rank0 holds request r0 (and its tokens), run.rank1 request r1: the stem ``run``."""
    for rank, request in enumerate(REQUESTS):
        with td.record(tmp_path / f"run.{fmt}", source="serving", rank=rank, world_size=2) as rec:
            at = np.arange(4)
            rec.log("target.layer.0", values(request, at), step=0, request=request, positions=at,
                    token_ids=tokens_of(request)[at])
    return tmp_path / f"run.{fmt}"


def test_a_rank_file_the_selection_keeps_nothing_of_is_not_written(tmp_path, fmt) -> None:
    stem = write_ranks(tmp_path, fmt)
    out = tmp_path / f"small.{fmt}"
    done = CliRunner().invoke(app, ["slice", str(stem), "-o", str(out), "--requests", "r1"])
    assert done.exit_code == 0, done.stderr
    written = tmp_path / f"small.rank1.{fmt}"
    assert done.stdout.startswith(f"wrote {written}: 1 record, 4 rows, 4 request tokens")
    assert done.stderr == f"tracediff: note: not written (the selection keeps nothing of that rank file): " \
                          f"{tmp_path / f'small.rank0.{fmt}'}\n"
    assert sorted(p.name for p in tmp_path.glob("small*")) == [f"small.rank1.{fmt}"]
    with td.open_trace(out) as small:  # the stem reads the rank files written
        assert set(small.rows("target.layer.0").request.tolist()) == {"r1"}
    # nothing kept anywhere: one file still, a valid trace with no rows
    result = slice_trace(stem, tmp_path / f"none.{fmt}", Selection(requests=("r9",)))
    assert [p.name for p in result.paths] == [f"none.rank0.{fmt}"] and result.records == 0
    assert [p.name for p in result.empty] == [f"none.rank1.{fmt}"]


def test_an_output_that_would_join_another_traces_rank_files_is_refused(tmp_path, fmt) -> None:
    stem = write_ranks(tmp_path, fmt)
    single = write_trace(tmp_path / f"single.{fmt}")
    out = tmp_path / f"run.rank2.{fmt}"  # would be read with run.rank0 and run.rank1 as the trace `run`
    done = CliRunner().invoke(app, ["slice", str(single), "-o", str(out)])
    assert (done.exit_code, done.stdout) == (2, "") and not out.exists()
    assert done.stderr == f"error: {out}: would join the rank files run.rank0.{fmt}, run.rank1.{fmt} (read " \
                          "with them as one trace): choose another name\n"
    with td.open_trace(stem) as still:
        assert len(still.files) == 2
    # a name that only looks alike is no rank file; the rank set itself sliced per rank into a new stem
    alike = tmp_path / f"run.rank2x.{fmt}"
    assert CliRunner().invoke(app, ["slice", str(single), "-o", str(alike)]).exit_code == 0 and alike.exists()
    result = slice_trace(stem, tmp_path / f"new.{fmt}", Selection())
    assert [p.name for p in result.paths] == [f"new.rank0.{fmt}", f"new.rank1.{fmt}"]
