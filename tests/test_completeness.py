"""A partial trace never passes as a match (issue 23): what a trace lacks of what its run logged
(trace/completeness.py, ``Trace.completeness``) is read from every writer's end-of-run metadata,
also as older traces wrote it, and carried into compare's verdict, show, the reports and the
recorder's close; what the user filtered out, and what the other side lacks too, never counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracediff as td
from testbed.held import held_writes
from tests.conftest import cli
from tracediff.report.compare import to_markdown
from tracediff.report.html import render_html
from tracediff.trace.writer import open_writer

STEPS = 40
FIRST_LINE = ('incomplete: serving dropped {n} of 40 draft.fc_in records (queue full at 2 MiB; raise '
              'queue_bytes or use on_full="block")')


def run(path, source: str, **options) -> td.Recorder:
    """The issue's reproduction: 40 steps of one request each, a 1 MiB fc input and small logits,
    recorded with the recorder ``options``."""
    rec = td.record(path, source=source, **options)
    log_steps(rec)
    rec.close()
    return rec


def log_steps(rec: td.Recorder, names=("draft.fc_in", "draft.logits"), bump: int | None = None) -> None:
    """The 40 steps, each one request of 64 tokens: ``draft.fc_in`` (64 x 4096 float32) and
    ``draft.logits`` (its first 100 columns, + 1 at step ``bump``), those of ``names``."""
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        x = rng.standard_normal((64, 4096)).astype(np.float32)
        ids = np.arange(64) + 7 * step
        if "draft.fc_in" in names:
            rec.log("draft.fc_in", x, step=step, token_ids=ids, request=f"r{step}")
        if "draft.logits" in names:
            rec.log("draft.logits", x[:, :100] + (step == bump), step=step, token_ids=ids, request=f"r{step}")


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "full.h5"
    run(path, "training")
    return path


def flooded(path, on_full: str) -> td.Recorder:
    """40 steps into a 2 MiB queue while the writer is held out of the file (a busy disk or writer
    under load): with ``drop`` most fc inputs cannot be queued (held until the close); ``block``
    waits for room (held a second)."""
    with held_writes(None if on_full == "drop" else 0.5):
        return run(path, "serving", queue_bytes=2 << 20, on_full=on_full, block_timeout=60)


def test_a_flood_with_drop_is_incomplete_with_its_cause_and_remedy_first_either_way(full, tmp_path, capfd):
    capfd.readouterr()
    rec = flooded(tmp_path / "drop.h5", "drop")
    dropped = rec.dropped["draft.fc_in"]
    assert dropped > 0 and rec.dropped_reasons == {"queue full": sum(rec.dropped.values())}
    said = [line for line in capfd.readouterr().err.splitlines() if "incomplete" in line]
    assert said == [f"tracediff: {tmp_path / 'drop.h5'}: incomplete: the trace dropped {dropped} "
                    f'draft.fc_in records (queue full at 2 MiB; raise queue_bytes or use on_full="block")'
                    + (" (and 1 more: tracediff show " + str(tmp_path / "drop.h5") + ")"
                       if rec.dropped["draft.logits"] else "")], said
    for a, b in ((full, tmp_path / "drop.h5"), (tmp_path / "drop.h5", full)):
        out = cli("compare", str(a), str(b))
        assert out.returncode == 3, out.stdout
        assert out.stdout.splitlines()[0].startswith(FIRST_LINE.format(n=dropped)), out.stdout
    report = td.compare(full, tmp_path / "drop.h5")
    assert report.verdict == "incomplete" and not report.a.gaps
    assert [(g.kind, g.tensor, g.count, g.logged, g.by) for g in report.b.gaps][0] == \
        ("dropped", "draft.fc_in", dropped, STEPS, "recorder")
    shown = cli("show", str(tmp_path / "drop.h5"))
    assert f"incomplete: this trace dropped {dropped} of 40 draft.fc_in records" in shown.stdout


def test_the_same_flood_with_block_drops_nothing_matches_and_says_nothing(full, tmp_path, capfd):
    capfd.readouterr()
    rec = flooded(tmp_path / "block.h5", "block")
    assert not rec.dropped and "incomplete" not in capfd.readouterr().err
    with td.open_trace(tmp_path / "block.h5") as trace:
        assert trace.completeness.complete
    out = cli("compare", str(full), str(tmp_path / "block.h5"))
    assert out.returncode == 0 and out.stdout.startswith("match"), out.stdout


def test_a_divergence_in_what_was_compared_is_still_diverged_and_the_gap_is_said_too(full, tmp_path):
    rec = td.record(tmp_path / "d.h5", source="serving", queue_bytes=2 << 20)
    log_steps(rec, names=("draft.logits",), bump=3)
    rec.close()
    report = td.compare(full, tmp_path / "d.h5")
    assert report.verdict == "diverged" and report.first_divergence.name == "draft.logits"
    stopped = rewritten(tmp_path / "d.h5", tmp_path / "stopped.h5", lambda f: {**f, "stopped": "byte budget"})
    report = td.compare(full, stopped)
    assert report.verdict == "diverged" and report.exit_code == 1
    assert report.reasons[0].startswith("serving stopped recording after step 39: its recorder stopped")


def rewritten(src, dst, final=lambda f: f, meta=lambda m: m):
    """``src`` copied whole (its token table too) by a writer given other metadata: ``final`` and
    ``meta`` map the source's end-of-run and run metadata to the copy's (as another writer, or an
    older version of this one, would have written them)."""
    with td.open_trace(src) as trace:
        records = [trace.read(i) for i in range(len(trace.index))]
        tokens = trace.tokens_record(0)
        writer = open_writer(dst, meta(dict(trace.meta)))
        writer.write(records + ([tokens] if tokens is not None else []))
        writer.close(final(dict(trace.finals[0])))
    return dst


def test_names_the_user_filtered_out_stay_informational(full, tmp_path, capfd):
    rec = td.record(tmp_path / "ex.h5", source="serving", exclude=["draft.logits"])
    log_steps(rec)
    capfd.readouterr()
    rec.attach_producer("test", ["draft.fc_in", "draft.logits"])  # meant to, and the user kept it out
    rec.close()
    assert "incomplete" not in capfd.readouterr().err
    report = td.compare(full, tmp_path / "ex.h5")
    assert report.verdict == "match" and report.exit_code == 0
    assert report.b.filtered == ["exclude=draft.logits"]
    out = cli("compare", str(full), str(tmp_path / "ex.h5"))
    assert out.returncode == 0 and "recorded with exclude=draft.logits" in out.stdout, out.stdout


def test_a_name_a_producer_attached_and_never_recorded_is_incomplete(full, tmp_path):
    rec = td.record(tmp_path / "p.h5", source="serving")
    rec.attach_producer("myserver", ["draft.fc_in", "draft.logits", "draft.hidden"])
    log_steps(rec, names=("draft.fc_in",))
    rec.close()
    report = td.compare(full, tmp_path / "p.h5")
    assert report.verdict == "incomplete"
    # draft.hidden: attached, but the other side lacks it too: nothing to count
    assert [(g.kind, g.tensor, g.by) for g in report.b.gaps] == [("unrecorded", "draft.logits", "myserver")]
    assert report.reasons[0] == ("serving recorded no draft.logits although myserver was attached to record "
                                 "it (attached but never recorded; its hooks never ran: see the producer's "
                                 "warnings)")


def test_a_producer_that_stopped_is_incomplete_and_says_who_why_and_when(full, tmp_path):
    rec = td.record(tmp_path / "s.h5", source="serving")
    log_steps(rec)
    rec.stop_producer("myserver", "hook broke", step=12)
    rec.stop_producer("myserver", "a later stop is not the cause")
    rec.close()
    report = td.compare(full, tmp_path / "s.h5")
    assert report.verdict == "incomplete" and report.exit_code == 3
    assert report.reasons[0] == ("serving stopped recording after step 12: myserver stopped (hook broke; see "
                                 "the producer's warning where it stopped; recording of the rest went on)")


def test_a_recording_still_open_or_killed_is_incomplete(full, tmp_path):
    rec = td.record(tmp_path / "live.h5", source="serving")
    log_steps(rec)
    rec.flush()
    try:
        out = cli("compare", str(full), str(tmp_path / "live.h5"))
        assert out.returncode == 3, out.stdout
        assert out.stdout.startswith("incomplete: serving was never closed by its writer"), out.stdout
    finally:
        rec.close()
    assert cli("compare", str(full), str(tmp_path / "live.h5")).returncode == 0


def test_traces_written_before_the_completeness_keys_read_alike(full, tmp_path):
    """Today's older writers held the drop counts by name and by reason, ``stopped``, and SGLang's
    stop flag in the contract: read those too; their complete traces still match."""
    def old(final: dict) -> dict:
        return {k: v for k, v in final.items() if k not in ("dropped_by", "producers", "queue")}

    cases = {
        "clean": (old, "match"),
        "dropped": (lambda f: {**old(f), "dropped_records": 4, "dropped": {"draft.fc_in": 4},
                               "dropped_reasons": {"queue full": 4}}, "incomplete"),
        "stopped": (lambda f: {**old(f), "contract": {**f.get("contract", {}),
                                                      "sglang_recording_stopped": "no residual stream"}},
                    "incomplete"),
    }
    for case, (final, verdict) in cases.items():
        path = rewritten(full, tmp_path / f"{case}.h5", final, lambda m: {**m, "source": "serving"})
        report = td.compare(full, path)
        assert report.verdict == verdict, (case, report.reasons)
    with td.open_trace(tmp_path / "dropped.h5") as trace:
        (gap,) = trace.completeness.gaps
        assert (gap.kind, gap.tensor, gap.count, gap.logged, gap.cause) == \
            ("dropped", "draft.fc_in", 4, 44, "queue full")
    with td.open_trace(tmp_path / "stopped.h5") as trace:
        (gap,) = trace.completeness.gaps
        assert (gap.kind, gap.by, gap.cause, gap.step) == \
            ("stopped", "sglang", "no residual stream", STEPS - 1)


def test_drops_of_a_tensor_the_other_side_lacks_too_are_said_not_counted(full, tmp_path):
    rec = td.record(tmp_path / "o.h5", source="serving", queue_bytes=2 << 20)
    log_steps(rec)
    rec.close()
    dropped = rewritten(tmp_path / "o.h5", tmp_path / "o2.h5", drops({"serving.only": {"queue full": 3}}))
    report = td.compare(full, dropped)
    assert report.verdict == "match" and not report.b.gaps
    assert [(g.tensor, g.count) for g in report.b.gaps_ignored] == [("serving.only", 3)]


def drops(dropped_by: dict):
    """An end-of-run metadata map adding these drops (name -> reason -> count)."""
    counts = {name: sum(r.values()) for name, r in dropped_by.items()}
    return lambda f: {**f, "dropped_by": dropped_by, "dropped": counts,
                      "dropped_records": sum(counts.values())}


def test_the_reports_carry_each_sides_gaps_round_trip_and_show_a_banner(full, tmp_path):
    path = rewritten(full, tmp_path / "r.h5", drops({"draft.fc_in": {"queue full": 5}}))
    report = td.compare(full, path)
    again = td.Report.from_json(report.to_json())
    assert again == report and again.b.gaps[0].count == 5
    assert json.loads(report.to_json())["b"]["gaps"][0]["kind"] == "dropped"
    markdown = to_markdown(report)
    assert "> **Partial trace**: b dropped 5 of 45 draft.fc\\_in records (queue full" in markdown, markdown
    html = render_html(report)
    assert html.index("Partial trace") < html.index('<header class="verdict')


def test_a_slice_keeps_its_sources_gaps_for_what_it_selected_and_none_for_the_rest(full, tmp_path):
    from tracediff.trace.slice import Selection, slice_trace

    path = rewritten(full, tmp_path / "d.h5", drops({"draft.fc_in": {"queue full": 5}}))
    slice_trace(path, tmp_path / "all.h5", Selection())
    slice_trace(path, tmp_path / "logits.h5", Selection(names=("draft.logits",)))
    assert td.compare(full, tmp_path / "all.h5").verdict == "incomplete"
    report = td.compare(full, tmp_path / "logits.h5")  # the slice left draft.fc_in out: not missing
    assert report.verdict == "match" and not report.b.gaps
    assert report.b.filtered == ["slice names=draft.logits"]


def test_a_bundle_of_a_partial_trace_says_so_first_and_its_slices_reproduce_it(full, tmp_path):
    path = rewritten(full, tmp_path / "d.h5", drops({"draft.fc_in": {"queue full": 5}}),
                     lambda m: {**m, "source": "serving"})
    out = cli("bundle", str(full), str(path), "--out", str(tmp_path / "bundle"))
    assert out.returncode == 0 and "the slices reproduce the compare: incomplete" in out.stdout, out.stdout
    report = (tmp_path / "bundle" / "report.md").read_text()
    assert report.startswith("# tracediff bundle: incomplete")
    assert ("- incomplete: `serving dropped 5 of 45 draft.fc_in records (queue full at 256 MiB; raise "
            'queue_bytes or use on_full="block")`') in report, report
    assert "> **Partial trace**" in report


def two_requests(path, source: str, drop: tuple[str, ...] = (), **options) -> td.Recorder:
    """Two requests of three steps; a record of each name in ``drop`` larger than the queue (refused
    whatever the machine's speed) after them."""
    rec = td.record(path, source=source, **options)
    for step in range(3):
        for r in range(2):
            rec.log("draft.fc_in", np.full((4, 8), step + r, np.float32), step=step,
                    token_ids=np.arange(4) + 10 * r, request=f"req{r}")
    for name in drop:
        rec.log(name, np.zeros((1, 1 << 19), np.float32), step=3, token_ids=[99], request="req0")
    rec.close()
    return rec


def test_what_the_user_sampled_or_sliced_out_is_never_missing(tmp_path):
    """every=2, some requests only, a slice of a slice, a slice of one rank file of two: none of what
    they leave out is a gap, though a producer attached it."""
    from tracediff.trace.slice import Selection, slice_trace

    two_requests(tmp_path / "a.h5", "training", drop=())
    rec = td.record(tmp_path / "every.h5", source="serving", every=2)
    rec.attach_producer("p", "draft.*")  # one glob, as names= takes one
    rec.log("draft.fc_in", np.zeros((4, 8), np.float32), step=1, token_ids=np.arange(4), request="req0")
    rec.log("draft.hidden", np.zeros((4, 8), np.float32), step=2, token_ids=np.arange(4), request="req0")
    rec.close()
    with td.open_trace(tmp_path / "every.h5") as trace:
        assert trace.completeness.attached == {"p": ("draft.*",)} and trace.completeness.sampled
    assert not td.compare(tmp_path / "a.h5", tmp_path / "every.h5").b.gaps
    two_requests(tmp_path / "b.h5", "serving", drop=("draft.big",), queue_bytes=1 << 20)
    slice_trace(tmp_path / "b.h5", tmp_path / "s1.h5", Selection(names=("draft.fc_in",)))
    slice_trace(tmp_path / "s1.h5", tmp_path / "s2.h5", Selection(requests=("req0", "req1")))
    with td.open_trace(tmp_path / "s2.h5") as trace:
        assert trace.completeness.filtered_out("draft.big") and trace.completeness.gaps[0].logged == 0
    for r in range(2):
        with td.record(tmp_path / "w.h5", rank=r, world_size=2, source="serving") as rec:
            rec.log("draft.fc_in", np.full((4, 8), r, np.float32), token_ids=np.arange(4) + 10 * r,
                    request=f"req{r}")
    slice_trace(tmp_path / "w.h5", tmp_path / "w0.h5", Selection(requests=("req0",)))
    with td.open_trace(tmp_path / "w0.h5") as trace:
        assert len(trace.paths) == 1 and trace.completeness.complete


def test_a_tensor_both_sides_dropped_whole_is_incomplete_and_the_remedy_fits_the_cause(tmp_path):
    """Both runs logged draft.big and neither holds any of it: nothing of it was compared. A record
    larger than the whole queue needs a larger queue, not blocking."""
    two_requests(tmp_path / "a.h5", "training", drop=("draft.big",), queue_bytes=1 << 20)
    two_requests(tmp_path / "b.h5", "serving", drop=("draft.big",), queue_bytes=1 << 20)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "incomplete" and report.reasons[0] == (
        "training dropped 1 of 1 draft.big record (a record larger than the whole queue (queue_bytes 1 MiB); "
        "raise queue_bytes above the largest record)")


def test_the_close_line_of_a_blocking_recorder_gives_its_own_remedy(tmp_path, capfd):
    capfd.readouterr()
    with held_writes(None):
        run(tmp_path / "b.h5", "serving", queue_bytes=100_000 << 4, on_full="block", block_timeout=0.001)
    (line,) = [line for line in capfd.readouterr().err.splitlines() if "incomplete" in line]
    assert "queue full at 1.53 MiB past block_timeout; raise queue_bytes or block_timeout)" in line, line


def test_recorder_options_out_of_range_are_refused_before_recording(tmp_path):
    for options in ({"queue_bytes": 0}, {"queue_bytes": True}, {"queue_bytes": "1MiB"}, {"max_bytes": -1}):
        with pytest.raises(ValueError, match="must be a number of bytes above 0"):
            td.record(tmp_path / "x.h5", **options)
    assert not (tmp_path / "x.h5").exists()
