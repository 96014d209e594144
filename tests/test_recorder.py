"""Recorder behaviour: filters, sampling, bounded queue, failure isolation, ranks, hooks."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import tracediff as td
from tests.conftest import cli, run_python, step_tensor


def names_and_steps(path) -> list[tuple[str, int]]:
    with td.open_trace(path) as trace:
        return [(trace.index.name[i], int(trace.index.step[i])) for i in trace.select()]


def test_name_globs_exclude_and_every_nth_step(tmp_path, fmt) -> None:
    path = tmp_path / f"f.{fmt}"
    with td.record(path, names=["draft.*", "target.layer.*"], exclude="draft.logits", every=2) as rec:
        for step in range(5):
            for name in ("draft.fc_in", "draft.logits", "target.layer.3", "target.embed"):
                rec.log(name, step_tensor(step, (2, 3)), step=step, token_ids=np.arange(2))
    assert names_and_steps(path) == [(n, s) for s in (0, 2, 4) for n in ("draft.fc_in", "target.layer.3")]


def test_request_filter_keeps_only_those_rows(tmp_path, fmt) -> None:
    path = tmp_path / f"r.{fmt}"
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    with td.record(path, requests={"keep"}) as rec:
        rec.log("h", x, token_ids=np.ones((2, 3), dtype=np.int64), request=["drop", "keep"])
        rec.log("h", x, token_ids=np.ones((2, 3), dtype=np.int64), request=["drop", "drop"])
    with td.open_trace(path) as trace:
        rows = trace.rows("h")
        assert rows.request.tolist() == ["keep"] * 3
        assert rows.data.tolist() == x[1].tolist()
        assert len(trace.index) == 1


def test_byte_budget_stops_recording_and_says_so(tmp_path, fmt) -> None:
    path = tmp_path / f"b.{fmt}"
    one = step_tensor(0).nbytes
    with td.record(path, max_bytes=3 * one) as rec:
        for step in range(10):
            rec.log("h", step_tensor(step), step=step, token_ids=np.arange(16))
    assert not rec.active
    with td.open_trace(path) as trace:
        assert len(trace.index) == 3
        assert "byte budget" in trace.finals[0]["stopped"]


def test_full_queue_drops_and_counts(tmp_path, fmt) -> None:
    path = tmp_path / f"d.{fmt}"
    big = np.ones((256, 1024), np.float32)  # 1 MiB a record, queue of 2 MiB
    with td.record(path, queue_bytes=2 << 20, on_full="drop") as rec:
        for step in range(200):
            rec.log("h", big, step=step, token_ids=np.arange(256))
    dropped = rec.dropped["h"]
    with td.open_trace(path) as trace:
        assert dropped > 0
        assert len(trace.index) + dropped == 200
        assert trace.finals[0]["dropped"] == {"h": dropped}
    assert rec.queued_bytes == 0


def test_full_queue_blocks_when_asked(tmp_path, fmt) -> None:
    path = tmp_path / f"k.{fmt}"
    big = np.ones((256, 1024), np.float32)
    with td.record(path, queue_bytes=2 << 20, on_full="block", block_timeout=30) as rec:
        for step in range(40):
            rec.log("h", big, step=step, token_ids=np.arange(256))
    with td.open_trace(path) as trace:
        assert len(trace.index) == 40 and trace.finals[0]["dropped_records"] == 0


def test_disabled_recorder_writes_nothing(tmp_path) -> None:
    rec = td.record(tmp_path / "off.h5", enabled=False)
    rec.log("h", step_tensor(0), token_ids=np.arange(16))
    rec.close()
    assert rec.writer_thread is None and not (tmp_path / "off.h5").exists()


def test_bad_log_call_warns_once_costs_its_record_and_never_raises(tmp_path, fmt, caplog) -> None:
    """One bad call costs its own record (counted), not the recording: the calls after it are kept."""
    path = tmp_path / f"bad.{fmt}"
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        with td.record(path) as rec:
            rec.log("good", step_tensor(0), token_ids=np.arange(16))
            rec.flush()
            rec.log("bad", step_tensor(1), token_ids=np.arange(5))  # 16 rows, 5 token ids
            rec.log("bad", step_tensor(2), token_ids=np.arange(5))
            rec.log("later", step_tensor(3), token_ids=np.arange(16))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "do not match token_ids" in warnings[0].getMessage()
    with td.open_trace(path) as trace:
        assert trace.names() == ["good", "later"]
        assert trace.finals[0]["stopped"] is None
        assert trace.finals[0]["dropped_reasons"] == {"invalid log call: ValueError": 2}


def fill_disk_under(path) -> None:
    """Point this process's descriptors of ``path`` at /dev/full: the writer's next write fails
    with ENOSPC, as on a disk that filled up between its free-space check and its write."""
    target = os.stat(path)
    with open("/dev/full", "wb") as full:
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                same = os.path.samestat(os.fstat(fd), target)
            except OSError:
                continue
            if same:
                os.dup2(full.fileno(), fd)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_writer_thread_failure_keeps_earlier_records(tmp_path, fmt, caplog) -> None:
    path = tmp_path / f"w.{fmt}"
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        with td.record(path) as rec:
            rec.log("ok", step_tensor(0), token_ids=np.arange(16))
            assert rec.flush()
            fill_disk_under(path)
            rec.log("ok", step_tensor(1), step=1, token_ids=np.arange(16))
            assert not rec.flush()
            rec.log("ok", step_tensor(2), step=2, token_ids=np.arange(16))
    assert not rec.active and "error in writer" in rec.stopped
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    with td.open_trace(path) as trace:
        assert not trace.complete
        assert trace.names() == ["ok"] and np.array_equal(trace.rows("ok").data, step_tensor(0))


def test_tensors_no_trace_can_hold_are_refused_counted_and_recording_goes_on(tmp_path, fmt, caplog) -> None:
    """A 9-D, meta-device, complex or sparse tensor once stopped the writer and cost the trace its
    final metadata: now it is dropped at ``log`` with its reason (one warning), strict mode raises."""
    torch = pytest.importorskip("torch")
    path = tmp_path / f"refused.{fmt}"
    bad = {"nine_dims": torch.zeros((2,) + (1,) * 8), "meta": torch.empty(2, 3, device="meta"),
           "complex": torch.zeros(2, 3, dtype=torch.complex64), "sparse": torch.zeros(2, 3).to_sparse(),
           "numpy_nine_dims": np.zeros((2,) + (1,) * 8, np.float32)}
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        with td.record(path) as rec:
            for step in range(2):
                rec.log("ok", step_tensor(step), step=step, token_ids=np.arange(16))
                for name, x in bad.items():
                    rec.log(name, x, step=step, token_ids=np.arange(2))
            rec.log_static("static_meta", torch.empty(4, device="meta"))
            assert rec.active
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "9 dims (at most 8)" in warnings[0]
    with td.open_trace(path) as trace:
        assert trace.complete and trace.names() == ["ok"] and len(trace.index) == 2
        final = trace.finals[0]
    assert final["stopped"] is None
    assert final["dropped"] == {**{name: 2 for name in bad}, "static_meta": 1}
    assert final["dropped_reasons"] == {"unrecordable: 9 dims (at most 8)": 4,
                                        "unrecordable: meta tensor (no data)": 3,
                                        "unrecordable: dtype torch.complex64": 2,
                                        "unrecordable: layout torch.sparse_coo": 2}
    with td.record(tmp_path / f"strict.{fmt}", strict=True) as rec:
        for name, x in bad.items():
            with pytest.raises(ValueError):
                rec.log(name, x, token_ids=np.arange(2))
        assert rec.active


def test_unwritable_path_never_raises(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        rec = td.record(tmp_path / "no" / "such" / "dir" / "t.h5")
        rec.log("h", step_tensor(0), token_ids=np.arange(16))
        rec.close()
    assert not rec.active and "error in open" in rec.stopped
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_log_after_close_is_ignored(tmp_path) -> None:
    rec = td.record(tmp_path / "c.h5")
    rec.close()
    rec.log("h", step_tensor(0), token_ids=np.arange(16))
    assert rec.stopped is None and not rec.active


class DeviceArray:
    """An array of another library: numpy reads it through ``__array__``, a copy each time (off a
    device, say)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.reads = values, 0

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        self.reads += 1
        return self.values.astype(dtype or self.values.dtype, copy=True)


def test_an_array_of_another_library_is_read_once_a_call(tmp_path, fmt) -> None:
    """Each check of a call converted it again (unrecordable, byte count, host bytes, the copy): 4
    reads for log_static, and log stopped recording (no ``shape``). Now one read a call; what numpy
    makes no array of is refused and counted, and recording goes on."""
    x = DeviceArray(np.arange(12, dtype=np.float32).reshape(3, 4))
    w = DeviceArray(np.arange(5, dtype=np.int64))
    path = tmp_path / f"device.{fmt}"
    with td.record(path) as rec:
        rec.log("x", x, token_ids=np.arange(3))
        rec.log_static("w", w)
        rec.log("ragged", [[1.0, 2.0], [3.0]], token_ids=np.arange(2))
        rec.log("x", x, step=1, token_ids=np.arange(3))
    assert (x.reads, w.reads) == (2, 1) and rec.stopped is None
    assert dict(rec.dropped_reasons) == {"unrecordable: not an array (list)": 1}
    with td.open_trace(path) as trace:
        assert trace.rows("x").data.tolist() == x.values.tolist() * 2
        assert trace.read(trace.select(name="w")[0]).data.tolist() == list(range(5))


# A recorder's process killed at once: before the writer's first flush.
KILLED_AT_OPEN = """
import os, signal, sys
import tracediff as td
rec = td.record(sys.argv[1], source="serving")
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.subprocess
def test_a_trace_killed_before_its_first_write_says_who_started_it(tmp_path, fmt) -> None:
    """An Arrow writer wrote nothing before its first batch: a 0-byte file, refused as "empty file,
    not a trace". Now it writes the file's header (schema, run metadata) at open, as the HDF5 writer
    does: the file reads as a trace that was never closed and holds no records."""
    path = tmp_path / f"killed.{fmt}"
    assert run_python(KILLED_AT_OPEN, str(path)).returncode == -9
    shown = cli("show", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "incomplete: the writer never closed" in shown.stdout and "source serving" in shown.stdout
    with td.open_trace(path) as trace:
        assert not trace.complete and len(trace.index) == 0 and trace.meta["source"] == "serving"


H5_KILLED_IN_OPEN = """
import os, signal, sys
import h5py
f = h5py.File(sys.argv[1], "w", libver="latest")  # what the HDF5 writer's open does first
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.subprocess
def test_a_file_killed_before_it_held_a_trace_is_one_error_line(tmp_path) -> None:
    """A file claimed but never written (the launcher claims a path before its recorder opens it) is
    0 bytes; an HDF5 writer killed inside its open leaves HDF5's superblock alone (48 bytes), which
    was "unreadable HDF5 (truncated or corrupt): truncated file: eof = 48, sblock->base_addr = 0,
    stored_eof = 2048"."""
    claimed = tmp_path / "claimed.arrow"
    claimed.touch()
    superblock = tmp_path / "superblock.h5"
    assert run_python(H5_KILLED_IN_OPEN, str(superblock)).returncode == -9
    for path, words in ((claimed, "empty file"), (superblock, "killed before its first write")):
        shown = cli("show", str(path))
        assert shown.returncode == 2 and shown.stdout == ""
        assert shown.stderr.startswith(f"error: {path}: ") and shown.stderr.count("\n") == 1, shown.stderr
        assert words in shown.stderr


RANK_WRITER = """
import sys, numpy as np, tracediff as td
with td.record(sys.argv[1], source="serving") as rec:
    for step in range(3):
        rec.log("h", np.full((2, 4), float(rec.rank), np.float32), step=step, token_ids=np.arange(2))
"""


@pytest.mark.subprocess
def test_ranks_write_one_file_each_and_open_as_one(tmp_path, fmt) -> None:
    path = tmp_path / f"t.{fmt}"
    for rank in (0, 1):
        done = run_python(RANK_WRITER, str(path), env={"RANK": str(rank), "WORLD_SIZE": "2"})
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"t.rank0.{fmt}", f"t.rank1.{fmt}"]
    with td.open_trace(path) as trace:
        rows = trace.rows("h")
        assert rows.rank.tolist() == [0] * 6 + [1] * 6
        assert rows.data[:, 0].tolist() == [0.0] * 6 + [1.0] * 6
        assert trace.meta["world_size"] == 2


def test_hooks_on_a_tiny_llama_and_show(tmp_path, fmt) -> None:
    torch = pytest.importorskip("torch")
    from tests.conftest import tiny_llama

    model = tiny_llama(layers=3)
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    path = tmp_path / f"llama.{fmt}"
    with td.record(path, source="training", meta={"target": "tiny-llama"}) as rec:
        rec.watch(model.model.embed_tokens, "target.embed")
        rec.watch_modules(model, "model.layers.*", "target.layer.{*}")
        rec.watch(model.lm_head, "target.logits")
        with torch.no_grad():
            for step in range(2):
                with rec.context(step=step, token_ids=ids, request=["r0", "r1"]):
                    out = model(ids, output_hidden_states=True)
    with td.open_trace(path) as trace:
        assert trace.names() == ["target.embed", "target.layer.0", "target.layer.1", "target.layer.2",
                                 "target.logits"]
        layer1 = trace.rows("target.layer.1", step=1)
        assert layer1.data.shape == (14, 64)
        assert np.array_equal(layer1.data, out.hidden_states[2].reshape(14, 64).numpy())
        assert layer1.token_id.tolist() == ids.reshape(-1).tolist()
        assert layer1.position.tolist() == list(range(7)) * 2
    shown = cli("show", str(path))
    assert shown.returncode == 0, shown.stderr
    for expected in ("target.layer.2", "(64,)", "(512,)", "tiny-llama", "training"):
        assert expected in shown.stdout
    stats = cli("show", str(path), "--name", "target.logits", "--step", "0", "--request", "r1")
    assert stats.returncode == 0 and "float32 (7, 512)" in stats.stdout and "NaN 0" in stats.stdout


def test_attention_mask_marks_padding_and_numbers_real_rows(tmp_path, fmt) -> None:
    path = tmp_path / f"pad.{fmt}"
    ids = np.array([[0, 0, 5, 6, 7], [8, 9, 10, 0, 0]])  # left padding, then right padding
    mask = (np.arange(5) >= 2)[None].repeat(2, 0)
    mask[1] = np.arange(5) < 3
    x = np.arange(40, dtype=np.float32).reshape(2, 5, 4)
    with td.record(path) as rec:
        rec.log("explicit", x, token_ids=ids, attention_mask=mask, request=["l", "r"])
        rec.set_context(step=1, token_ids=ids, attention_mask=mask.astype(np.int64), request=["l", "r"])
        rec.log("from_context", x)
        with rec.context(step=2, token_ids=ids[0], positions=np.array([-1, -1, 0, 1, 2]), request="l"):
            rec.log("given_positions", x[0])  # -1 in positions marks padding too
    with td.open_trace(path) as trace:
        for name in ("explicit", "from_context"):
            rows = trace.rows(name)
            assert rows.position.tolist() == [-1, -1, 0, 1, 2, 0, 1, 2, -1, -1], name
            assert np.array_equal(rows.data, x.reshape(10, 4))
            assert rows.token_id.tolist() == ids.ravel().tolist()
        assert trace.rows("given_positions").position.tolist() == [-1, -1, 0, 1, 2]
        table = trace.request_tokens()  # padded rows are not learned
    assert sorted(zip(table.request, table.position.tolist(), table.token_id.tolist())) == [
        ("l", 0, 5), ("l", 1, 6), ("l", 2, 7), ("r", 0, 8), ("r", 1, 9), ("r", 2, 10)]


def test_attention_mask_with_positions_forces_padding(tmp_path) -> None:
    with td.record(tmp_path / "p.h5") as rec:
        rec.log("h", np.zeros((3, 2), np.float32), token_ids=np.array([4, 5, 0]),
                positions=np.array([7, 8, 9]), attention_mask=np.array([1, 1, 0]), request="q")
    with td.open_trace(tmp_path / "p.h5") as trace:
        assert trace.rows("h").position.tolist() == [7, 8, -1]
        assert trace.request_tokens().position.tolist() == [7, 8]


def strict_misuse(rec, torch, skip: tuple[int, ...] = ()) -> list[str]:
    """Every kind of misuse strict mode raises; returns what each call raised (or 'ok'), but for
    the calls in ``skip``."""
    calls = [
        lambda: rec.log("h", np.zeros((4, 2), np.float32), token_ids=np.arange(3)),  # 4 rows, 3 ids
        lambda: rec.log("h", np.zeros((3, 2), np.float16), token_ids=np.arange(3), request="r"),  # dtype
        lambda: rec.log("h", np.zeros((3, 5), np.float32), token_ids=np.arange(3), request="r"),  # row shape
        lambda: rec.log("h", np.zeros((3, 2), np.float32), token_ids=np.array([1, 2, 99]), request="d"),
        lambda: rec.request_tokens("r", [0, 1, 7]),  # position 2 was logged as token 2
        lambda: rec.log_static("w", np.zeros(3, np.int32)),  # w was int64
        lambda: rec.request_tokens("r", [[1, 2]]),  # not a 1-D token list
        lambda: rec.log("h", torch.zeros(3, 2, dtype=torch.bfloat16), token_ids=np.arange(3)),  # dtype
    ]
    rec.log("h", np.zeros((3, 2), np.float32), token_ids=np.arange(3), request="r")
    rec.request_tokens("d", [1, 2, 3])
    rec.log_static("w", np.zeros(3, np.int64))
    raised = []
    for call in (c for i, c in enumerate(calls) if i not in skip):
        try:
            call()
            raised.append("ok")
        except ValueError as exc:
            raised.append(type(exc).__name__)
    rec.log("h", np.ones((3, 2), np.float32), step=1, token_ids=np.arange(3), request="r")  # still recording
    return raised


@pytest.mark.parametrize("how", ["argument", "env"])
def test_strict_mode_raises_misuse_in_the_caller(tmp_path, fmt, monkeypatch, how) -> None:
    torch = pytest.importorskip("torch")
    if how == "env":
        monkeypatch.setenv("TRACEDIFF_STRICT", "1")
    options = {"strict": True} if how == "argument" else {}
    path = tmp_path / f"strict.{fmt}"
    with td.record(path, **options) as rec:
        assert rec.strict
        raised = strict_misuse(rec, torch)
        assert rec.active
        rec.log("h", np.zeros((3, 2), np.float32), token_ids=np.array([0, 1, 5]), request="r", step=2)
    assert raised == ["ValueError"] * 3 + ["TokenConflict"] * 2 + ["ValueError"] * 3
    with td.open_trace(path) as trace:  # logged vs logged conflicts are counted, not raised
        assert trace.rows("h").step.tolist() == [0] * 3 + [1] * 3 + [2] * 3
        assert trace.finals[0]["stopped"] is None
        assert trace.finals[0]["token_conflicts"] == 1
    with pytest.raises(FileNotFoundError, match="output directory .* does not exist"):
        td.record(tmp_path / "missing" / f"t.{fmt}", **options)


def test_default_mode_never_raises_the_same_misuse(tmp_path, fmt, monkeypatch, caplog) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("TRACEDIFF_STRICT", raising=False)
    path = tmp_path / f"lenient.{fmt}"
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        with td.record(path) as rec:
            assert not rec.strict
            # but for the row-count mismatch (it costs its record, tested above) all is accepted
            raised = strict_misuse(rec, torch, skip=(0,))
        assert raised == ["ok"] * 7
        assert rec.stopped is None  # the 2-D token list: warned once, that call dropped (counted)
        assert rec.token_calls_dropped == 1
        missing = td.record(tmp_path / "missing" / f"t.{fmt}")
    assert not missing.active and "output directory" in missing.stopped
    assert "does not exist" in missing.stopped
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    with td.open_trace(path) as trace:
        assert trace.finals[0]["token_conflicts"] == 2  # d: 99 vs declared 3; r: 7 vs logged 2
        assert trace.finals[0]["mixed_records"] == ["h", "w"]


def test_reserved_names_and_negative_depths_are_refused(tmp_path) -> None:
    """A tensor named like the format's own records would corrupt the trace, and one holding a NUL
    could never be read back: refused (strict mode raises; by default that record is dropped, counted, and the
    host goes on)."""
    for bad in ({"name": "__tokens__"}, {"name": "h", "depth": -1}, {"name": "h\x00"}):
        with td.record(tmp_path / "x.h5", strict=True) as rec:
            with pytest.raises(ValueError):
                rec.log(bad["name"], np.zeros((2, 3), np.float32), token_ids=[1, 2], depth=bad.get("depth"))
        with td.record(tmp_path / "y.h5") as rec:
            rec.log(bad["name"], np.zeros((2, 3), np.float32), token_ids=[1, 2], depth=bad.get("depth"))
            rec.log("ok", np.zeros((2, 3), np.float32), token_ids=[1, 2])
            assert rec.active and rec.dropped_reasons == {"invalid log call: ValueError": 1}
        with td.open_trace(tmp_path / "y.h5") as trace:
            assert trace.names() == ["ok"]


def test_contract_values_json_cannot_hold_never_cost_the_final_metadata(tmp_path) -> None:
    """Arrays become lists; a NaN or an object is left out with a warning (raised when strict),
    and the trace still closes with its final metadata."""
    with td.record(tmp_path / "c.h5", meta={"aux": np.array([1, 2]), "lr": float("nan")}) as rec:
        rec.log("h", np.zeros((2, 3), np.float32), token_ids=[1, 2])
        rec.update_contract(resolved=np.array([2, 16, 29]), bad=float("nan"), obj=object(), ok=np.int64(3))
    with td.open_trace(tmp_path / "c.h5") as trace:
        assert trace.complete and trace.meta["contract"] == {"aux": [1, 2]}
        assert trace.finals[0]["contract"] == {"resolved": [2, 16, 29], "ok": 3}
    with td.record(tmp_path / "d.h5", strict=True) as rec:
        with pytest.raises(ValueError, match="'bad' cannot be stored as JSON"):
            rec.update_contract(bad=float("nan"))


def test_a_single_request_filter_is_one_request_not_its_characters(tmp_path) -> None:
    with td.record(tmp_path / "r.h5", requests="req0") as rec:
        rec.log("h", np.zeros((2, 1, 3), np.float32), token_ids=[[1], [2]], request=["req0", "req1"])
    with td.open_trace(tmp_path / "r.h5") as trace:
        assert trace.rows("h").request.tolist() == ["req0"]


def test_threads_recording_in_their_own_context_blocks_keep_their_own_keys(tmp_path) -> None:
    """Two threads each in `with rec.context(request=...)`: 40 of 2400 rows carried the other
    thread's request, and with four threads a log ran with no token ids and stopped the recording."""
    import threading

    path = tmp_path / "threads.h5"
    with td.record(path, on_full="block") as rec:
        rec.set_context(request="shared", token_ids=np.arange(4))  # outside any block: every thread's

        def work(k: int) -> None:
            for i in range(200):
                with rec.context(step=i, request=f"t{k}", token_ids=np.arange(4) + k):
                    rec.log("a", np.full((4, 8), float(k), np.float32))
            rec.log("b", np.full((4, 8), float(k), np.float32), step=0)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert rec.stopped is None and not rec.dropped
    with td.open_trace(path) as trace:
        rows = trace.rows("a")
        values = rows.numpy()[:, 0].astype(int)
        assert len(values) == 4 * 200 * 4
        assert [f"t{v}" for v in values] == list(rows.request)
        assert (rows.token_id - values == np.tile(np.arange(4), 800)).all()
        assert set(trace.rows("b").request) == {"shared"}


def test_row_keys_shared_by_several_tensors_record_what_per_call_keys_record(tmp_path, fmt) -> None:
    ids, positions = np.array([7, 8, 9]), np.array([4, 5, 6])
    requests = np.array(["a", "a", "b"], dtype=object)
    tensors = {"draft.fc_in": step_tensor(0, (3, 4)), "draft.hidden": step_tensor(1, (3, 2))}
    per_call, shared = tmp_path / f"per_call.{fmt}", tmp_path / f"shared.{fmt}"
    with td.record(per_call) as rec:
        for name, x in tensors.items():
            rec.log(name, x, step=2, token_ids=ids, positions=positions, request=requests, depth=1)
    with td.record(shared) as rec:
        keys = rec.row_keys(ids, positions=positions, request=requests, step=2)
        for name, x in tensors.items():
            rec.log(name, x, step=2, depth=1, keys=keys)
    with td.open_trace(per_call) as a, td.open_trace(shared) as b:
        for name in tensors:
            ra, rb = a.rows(name), b.rows(name)
            assert rb.request.tolist() == ra.request.tolist() == ["a", "a", "b"]
            assert rb.position.tolist() == ra.position.tolist() == [4, 5, 6]
            assert rb.token_id.tolist() == ra.token_id.tolist() == [7, 8, 9]
            assert np.array_equal(rb.data, ra.data)
        assert b.request_tokens().sequence("b")[1].tolist() == [9]


def test_row_keys_of_filtered_out_tensors_still_teach_the_token_table(tmp_path) -> None:
    path = tmp_path / "filtered.arrow"
    with td.record(path, exclude="*") as rec:
        keys = rec.row_keys(np.array([3, 4]), positions=np.array([0, 1]), request="r")
        rec.log("draft.hidden", step_tensor(0, (2, 2)), keys=keys)
    with td.open_trace(path) as trace:
        assert len(trace.index) == 0
        assert trace.request_tokens().sequence("r")[1].tolist() == [3, 4]


def test_keyed_log_calls_that_do_not_fit_cost_their_record_only(tmp_path, caplog) -> None:
    path = tmp_path / "misfit.arrow"
    with caplog.at_level(logging.WARNING, logger="tracediff"), td.record(path) as rec:
        keys = rec.row_keys(np.arange(3))
        rec.log("rows.wrong", step_tensor(0, (4, 2)), keys=keys)  # 4 rows for 3 keys
        rec.log("keys.twice", step_tensor(0, (3, 2)), keys=keys, token_ids=np.arange(3))
        bad = rec.row_keys(np.arange(2), request="lone\udc80")
        rec.log("request.surrogate", step_tensor(0, (2, 2)), keys=bad)
        rec.log("fits", step_tensor(0, (3, 2)), keys=keys)
    assert rec.dropped == {"rows.wrong": 1, "keys.twice": 1, "request.surrogate": 1}
    assert rec.dropped_reasons["unrecordable: a request id that is not valid Unicode"] == 1
    with td.open_trace(path) as trace:
        assert trace.names() == ["fits"]


def test_strict_mode_raises_keyed_misuse_in_the_caller(tmp_path) -> None:
    with td.record(tmp_path / "strict.arrow", strict=True) as rec:
        with pytest.raises(ValueError, match="not valid Unicode"):
            rec.row_keys(np.arange(2), request="lone\udc80")
        keys = rec.row_keys(np.arange(3))
        with pytest.raises(ValueError, match="do not match its keys' rows"):
            rec.log("rows.wrong", step_tensor(0, (4, 2)), keys=keys)


def test_row_keys_teach_every_recorder_they_are_logged_to(tmp_path) -> None:
    first, second = tmp_path / "first.arrow", tmp_path / "second.arrow"
    with td.record(first) as a, td.record(second) as b:
        keys = a.row_keys(np.array([3, 4]), request="r")
        a.log("h", step_tensor(0, (2, 2)), keys=keys)
        b.log("h", step_tensor(0, (2, 2)), keys=keys)
    for path in (first, second):
        with td.open_trace(path) as trace:
            assert trace.request_tokens().sequence("r")[1].tolist() == [3, 4], path
