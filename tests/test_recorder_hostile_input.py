"""What the recorder is given never costs the trace: metadata the reader would refuse is escaped or
left out at the call (one warning), and one bad record costs that record, counted (issue 19)."""

from __future__ import annotations

import numpy as np
import pytest

import tracediff as td
from tests.conftest import cli
from tracediff.trace.metarules import MAX_META_BYTES, MAX_META_VALUES


def nested(levels: int) -> dict:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value  # type: ignore[return-value]


def log_some(rec, n: int = 3) -> None:
    for i in range(n):
        rec.log("x", np.full((2, 4), i, np.float32), token_ids=np.arange(2), request="r", step=i)


@pytest.fixture(params=["h5", "arrow"])
def path(request, tmp_path):
    return tmp_path / f"t.{request.param}"


def reads_whole(path, n: int = 3):
    trace = td.open_trace(path)
    assert len(trace.select(name="x")) == n
    return trace


@pytest.mark.parametrize("options", [
    {"meta": {"deep": nested(40)}},
    {"meta": {"script": "/data/caf\udce9.py"}},
    {"meta": {"k\udce9": 1}},
    {"source": "run\udce9"},
    {"names": ["x", "y\udce9"]},
], ids=["deep", "surrogate-value", "surrogate-key", "surrogate-source", "surrogate-filter"])
def test_run_metadata_the_reader_refuses_is_fixed_at_the_call_and_every_tensor_is_kept(path, options, caplog):
    with td.record(path, **options) as rec:
        log_some(rec)
    trace = reads_whole(path)
    meta = trace.meta
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    if "meta" in options and "deep" in options["meta"]:
        assert "deep" not in meta["contract"]
    if options.get("meta") == {"script": "/data/caf\udce9.py"}:
        assert meta["contract"]["script"] == "/data/caf\\udce9.py"


def test_run_metadata_over_the_readers_limit_is_left_out_not_the_trace(path):
    with td.record(path, meta={"big": "x" * (MAX_META_BYTES + 10)}) as rec:
        log_some(rec)
    reads_whole(path)


def test_metadata_of_more_json_values_than_a_reader_takes_is_left_out_not_the_trace(path, caplog):
    """2 MB of zeros is within the byte limit but over the reader's count of JSON values."""
    many = [0] * (MAX_META_VALUES + 10)
    with td.record(path, meta={"many": many, "aux_layer_ids": [1, 2]}) as rec:
        log_some(rec)
        rec.update_contract(many_more=many, kept=3)
    trace = reads_whole(path)
    assert trace.meta["contract"] == {"aux_layer_ids": [1, 2]} and trace.contract["kept"] == 3
    assert "many_more" not in trace.contract
    assert sum("JSON values" in r.getMessage() for r in caplog.records) == 2
    assert cli("show", str(path)).returncode == 0


@pytest.mark.parametrize("meta", [{"aux_layer_ids": [1, 15, 28], 2: "b"}, ["a"]],
                         ids=["mixed-keys", "a-list"])
def test_metadata_of_the_wrong_shape_never_costs_the_trace(path, meta, caplog):
    """Top-level keys of mixed types stopped the recorder at open (TypeError from sorting them), and
    metadata that is not a dict too: no file at all."""
    with td.record(path, meta=meta) as rec:
        log_some(rec)
    trace = reads_whole(path)
    if isinstance(meta, dict):
        assert trace.meta["contract"] == {"aux_layer_ids": [1, 15, 28], "2": "b"}
    else:
        assert trace.meta["contract"] == {} and "a dict of contract values" in caplog.text


def test_contract_updates_the_reader_would_refuse_are_fixed_or_left_out(path):
    with td.record(path) as rec:
        log_some(rec)
        rec.update_contract(deep=nested(40), script="caf\udce9", **{"k\udce9": 2})
        rec.update_contract(big="y" * (MAX_META_BYTES // 2))
        rec.update_contract(bigger="z" * (MAX_META_BYTES // 2))
    reads_whole(path)
    assert cli("show", str(path)).returncode == 0


def test_a_lone_surrogate_in_a_name_or_request_costs_that_record_only(path):
    with td.record(path) as rec:
        for i in range(200):
            name = "x\udce9" if i == 76 else "x"
            rec.log(name, np.zeros((2, 4), np.float32), token_ids=np.arange(2), request="r", step=i)
        rec.log("y", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request="r\udce9")
        rec.log("y", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request=["ok", "r\udce9"])
        rec.request_tokens("q\udce9", [1, 2, 3])
        log_some(rec, 0)
    assert rec.stopped is None and rec.records_written == 199
    assert rec.dropped_reasons == {"unrecordable: a name that is not valid Unicode": 1,
                                   "unrecordable: a request id that is not valid Unicode": 2}
    trace = td.open_trace(path)
    assert len(trace.select(name="x")) == 199
    assert trace.finals[0]["dropped_records"] == 3
    shown = cli("show", str(path))
    assert shown.returncode == 0 and "3" in shown.stdout


def test_records_logged_after_recording_stopped_are_counted_as_dropped(path):
    """200 logged, 76 written, 0 dropped: now the 124 after the stop are counted."""
    rec = td.record(path, max_bytes=76 * 32)  # log_some's records are 32 bytes
    log_some(rec, 76)
    assert rec.stopped is None
    log_some(rec, 124)  # the first passes the byte budget: recording stops
    assert rec.stopped is not None
    rec.close()
    assert rec.records_written == 76 and rec.dropped_reasons == {"stopped": 124}
    final = td.open_trace(path).finals[0]
    assert final["records"] == 76 and "byte budget" in final["stopped"]


SECOND_WRITER = """
import sys, numpy as np, tracediff as td
rec = td.record(sys.argv[1])
print("active", rec.active, flush=True)
for i in range(100):
    rec.log("theirs", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request="b", step=i)
rec.close()
print("host still running", flush=True)
"""


@pytest.mark.subprocess
def test_a_second_process_recording_to_the_same_path_is_refused_and_its_host_keeps_running(path):
    from tests.test_recorder_host_safety import finish, start_python

    rec = td.record(path)
    for i in range(100):
        rec.log("x", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request="a", step=i)
    code, out, err = finish(start_python(SECOND_WRITER, str(path)), timeout=120)
    rec.close()
    assert code == 0 and "active False" in out and "host still running" in out
    assert err.count("another recorder is writing") == 1
    trace = td.open_trace(path)
    assert trace.names() == ["x"] and len(trace.select(name="x")) == 100
    assert list(path.parent.iterdir()) == [path]  # the lock file goes with the recorder


def test_the_path_is_free_again_once_the_first_recorder_closed(path):
    with td.record(path) as first:
        log_some(first)
        second = td.record(path)
        assert not second.active and "another recorder" in second.stopped
    with td.record(path) as third:
        assert third.active
        log_some(third)
    reads_whole(path)


KILLED_HOLDER = """
import os, signal, sys, numpy as np, tracediff as td
rec = td.record(sys.argv[1])
rec.log("x", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request="a")
rec.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.subprocess
def test_a_lock_left_by_a_killed_recorder_does_not_block_the_next(path):
    from tests.test_recorder_host_safety import finish, start_python

    code, _, _ = finish(start_python(KILLED_HOLDER, str(path)), timeout=120)
    assert code is not None and code < 0
    with td.record(path) as rec:
        assert rec.active
        log_some(rec)
    reads_whole(path)


def test_a_bytes_request_id_costs_its_record_not_a_wrong_id(path):
    """request=b"x" was recorded as request "120" (the bytes iterated as ints)."""
    with td.record(path) as rec:
        rec.log("x", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request=b"x")
        rec.log("x", np.zeros((2, 4), np.float32), token_ids=np.arange(2), request=[b"a", b"b"])
        log_some(rec)
        assert rec.dropped_reasons == {"invalid log call: TypeError": 2}
    assert set(reads_whole(path).rows("x").request) == {"r"}


def test_record_never_writes_through_a_link_and_says_when_it_replaces_a_file(tmp_path, caplog):
    """td.record('t.h5') with t.h5 a link to notes.txt turned the notes into an HDF5 file, and an
    existing file was replaced without a word."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    link = tmp_path / "t.h5"
    link.symlink_to(notes)
    with td.record(link) as rec:
        log_some(rec)
        assert not rec.active and "symbolic link" in rec.stopped
    assert notes.read_text() == "my notes" and link.is_symlink()
    old = tmp_path / "old.arrow"
    old.write_bytes(b"an older run")
    with td.record(old) as rec:
        log_some(rec)
    assert "exists: the new recording replaces it" in caplog.text
    assert len(reads_whole(old).select(name="x")) == 3


EMPTY_BATCHES = {  # name -> (tensor, keyword arguments of log): zero rows every way a caller may give them
    "no batch rows": (np.zeros((0, 4, 2), np.float32), {"token_ids": np.zeros((0, 4), np.int64)}),
    "no rows, no requests": (np.zeros((0, 2), np.float32),
                             {"token_ids": np.zeros(0, np.int64), "request": []}),
    "no tokens a row": (np.zeros((2, 0, 2), np.float32), {"token_ids": np.zeros((2, 0), np.int64)}),
}


@pytest.mark.parametrize("keyed", [False, True], ids=["per call", "row_keys"])
def test_an_empty_batch_records_nothing_and_recording_goes_on(path, keyed):
    with td.record(path, exclude="skipped") as rec:
        log_some(rec)
        for tensor, given in EMPTY_BATCHES.values():
            for name in ("empty", "skipped"):  # recorded and filtered out alike
                if keyed:
                    rec.log(name, tensor, keys=rec.row_keys(given["token_ids"], request=given.get("request")))
                else:
                    rec.log(name, tensor, **given)
        log_some(rec)
        assert rec.stopped is None, rec.stopped
    with td.open_trace(path) as trace:
        assert trace.complete and len(trace.rows("x").data) == 12
        assert not rec.dropped


def test_steps_and_depths_no_trace_holds_cost_their_record_counted(path):
    bad_calls = [{"step": 2**63}, {"step": -(2**63) - 1}, {"step": 2.0}, {"step": float("nan")},
                 {"depth": np.uint64(2**64 - 1)}, {"depth": -1}, {"depth": 1.5}]
    with td.record(path) as rec:
        log_some(rec)
        for i, bad in enumerate(bad_calls):
            rec.log(f"bad.{i}", np.ones((2, 4), np.float32), token_ids=np.arange(2), **bad)
        rec.log_static("bad.static", np.ones(3), step=2**70)
        log_some(rec)
        assert rec.stopped is None, rec.stopped
    assert sum(rec.dropped.values()) == len(bad_calls) + 1
    with td.open_trace(path) as trace:
        assert trace.complete and trace.names() == ["x"] and len(trace.index) == 6


@pytest.mark.parametrize("call", ["name", "keys", "static name"])
def test_arguments_of_the_wrong_type_cost_their_record_counted_not_the_recording(path, call):
    with td.record(path) as rec:
        if call == "name":
            rec.log(123, np.ones((2, 4), np.float32), token_ids=np.arange(2))  # type: ignore[arg-type]
        elif call == "keys":
            rec.log("x.keys", np.ones((2, 4), np.float32), keys="abc")  # type: ignore[arg-type]
        else:
            rec.log_static(["a"], np.ones(3), once=True)  # type: ignore[arg-type]
        log_some(rec)
        assert rec.stopped is None, rec.stopped
    assert sum(rec.dropped.values()) == 1
    with pytest.raises(TypeError), td.record(path.with_name("strict" + path.suffix), strict=True) as strict:
        strict.log("x", np.ones((2, 4), np.float32), keys=np.arange(2))  # type: ignore[arg-type]


def test_row_keys_never_raise_into_the_caller(path):
    torch = pytest.importorskip("torch")
    with td.record(path) as rec:
        keys = rec.row_keys(torch.empty(3, dtype=torch.int64, device="meta"))  # no data to copy: a failure
        rec.log("x", np.ones((3, 2), np.float32), keys=keys)
    assert rec.stopped is not None and "row_keys" in rec.stopped
    with td.open_trace(path) as trace:
        assert "row_keys" in trace.finals[0]["stopped"]  # the trace says recording stopped, and why


def test_a_buffer_refilled_in_place_between_calls_teaches_the_token_table_again(path):
    ids, positions = np.array([1, 2, 3]), np.array([0, 1, 2])
    with td.record(path, exclude="skipped") as rec:
        rec.log("hidden", np.ones((3, 2), np.float32), token_ids=ids, positions=positions, request="r")
        ids[:], positions[:] = [4, 5, 6], [3, 4, 5]
        rec.log("hidden", np.ones((3, 2), np.float32), token_ids=ids, positions=positions, request="r",
                depth=1)
        ids[:], positions[:] = [7, 8, 9], [6, 7, 8]
        rec.log("skipped", np.ones((3, 2), np.float32), token_ids=ids, positions=positions, request="r")
    with td.open_trace(path) as trace:
        assert trace.request_tokens().sequence("r")[1].tolist() == list(range(1, 10))


def test_the_step_given_to_row_keys_is_their_records_step(path):
    with td.record(path, every=2) as rec:
        for step in range(4):
            keys = rec.row_keys(np.arange(2), step=step)
            rec.log("x", np.ones((2, 4), np.float32), keys=keys)
    with td.open_trace(path) as trace:
        assert sorted(int(trace.index.step[i]) for i in trace.select(name="x")) == [0, 2]


def test_refused_keys_of_a_filtered_out_name_cost_nothing_and_strict_mode_raises_them(path):
    with td.record(path, exclude="skipped") as rec:
        refused = rec.row_keys(np.arange(2), request="x\udc80")
        rec.log("skipped", np.ones((2, 2), np.float32), keys=refused)
    assert not rec.dropped
    with td.open_trace(path) as trace:
        assert trace.complete
    with td.record(path.with_name("strict" + path.suffix), strict=True) as strict, \
            pytest.raises(ValueError, match="refused"):
        strict.log("x", np.ones((2, 2), np.float32), keys=refused)
