"""The recorder never hangs its host and stays inside its memory bound (issue 11).

Each scenario runs in its own interpreter, as a host would: exit, peak memory and a writer thread
the interpreter's shutdown meets are properties of a whole process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO
from tracediff.record.exit_fence import EXIT_FENCE, Writers
from tracediff.record.recorder import ABANDON_GRACE

MiB = 1 << 20
CLOSE_TIMEOUT = 0.3  # what the busy-writer scripts give close()


def start_python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str, str]:
    """(exit code, or None if it had to be killed; stdout; stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err


# A host that leaves its writer a large backlog of tiny records (the case: ~750k of them),
# then ends: by calling close(), or by returning and letting interpreter exit close the trace. It
# prints when it starts to close, and (from an exit handler that runs after tracediff's) when
# tracediff's part of the exit is over; what is left is the interpreter's own shutdown.
BACKLOG = """
import atexit, sys, time
atexit.register(lambda: print("handlers done", time.time(), flush=True))
import numpy as np
import tracediff as td
path, how, n, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
options = dict(queue_bytes=1 << 30, flush_interval=3600, flush_bytes=1 << 30)  # all of it at close
if how == "exit":
    options["close_timeout"] = timeout
rec = td.record(path, **options)
x, ids = np.zeros((1, 4), np.float32), np.arange(1)
for step in range(n):
    rec.log("h", x, step=step, token_ids=ids, request="r")
    if step == 99:
        assert rec.flush()
time.sleep(0.5)  # whatever the writer does between flushes, it has done
print("closing", time.time(), flush=True)
if how == "close":
    rec.close(timeout)
    print("closed", time.time(), flush=True)
"""


N = 60_000  # records in the backlog: seconds of work for either writer


def stamps(out: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in out.splitlines()}


@pytest.mark.slow
@pytest.mark.subprocess
def test_host_exits_within_the_bound_with_a_busy_writer(tmp_path) -> None:
    """close() times out with the writer busy: the writer is abandoned, close() returns within
    timeout + ABANDON_GRACE, exit adds at most EXIT_FENCE, and the process ends, leaving a readable
    trace of what it had flushed. (Before: the HDF5 writer, frozen by the shutdown inside h5py,
    held h5py's lock, and the exit deadlocked on it.)"""
    cases = [(fmt, how) for fmt in ("h5", "arrow") for how in ("close", "exit")]
    procs = {(fmt, how): start_python(BACKLOG, str(tmp_path / f"{how}.{fmt}"), how, str(N),
                                      str(CLOSE_TIMEOUT))
             for fmt, how in cases}
    slack = 1.0  # this VM's scheduling
    for (fmt, how), proc in procs.items():
        code, out, err = finish(proc, timeout=90)
        assert code == 0, f"{fmt}/{how}: {'hung at exit' if code is None else err}"
        at = stamps(out)
        if how == "close":
            assert at["closed"] - at["closing"] < CLOSE_TIMEOUT + ABANDON_GRACE + slack, (fmt, at)
        bound = CLOSE_TIMEOUT + ABANDON_GRACE + EXIT_FENCE + slack
        assert at["handlers done"] - at["closing"] < bound, (fmt, how, at)
        assert err.count("abandoned") == 1 and "readable up to its last flush" in err, err
        with td.open_trace(tmp_path / f"{how}.{fmt}") as trace:
            steps = trace.index.step.tolist()
            assert not trace.complete and steps == list(range(len(steps))) and 100 <= len(steps) < N


# A host whose writer is inside one long HDF5 call (a large gzip-compressed record) when it exits:
# after close() gave up on it, or with no close at all (its exit handler unregistered, as
# `tracediff record` does before closing the recorder its own way); with an h5py whose lock is not
# where the exit fence used to look for it (an h5py release may move it).
LONG_WRITE = """
import atexit, sys, time
import numpy as np
import h5py._objects
if sys.argv[3] == "moved":
    del h5py._objects.phil
import tracediff as td
rec = td.record(sys.argv[1], compression="gzip")
x = np.random.default_rng(0).integers(0, 1 << 62, (16, 1 << 20), dtype=np.int64)  # 128 MiB
rec.log("big", x, token_ids=np.arange(16))
rec.flush(timeout=0.2)  # the writer is in its write
if sys.argv[2] == "close":
    rec.close(0.5)
else:
    atexit.unregister(rec.close)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_host_exits_while_its_writer_is_inside_a_long_hdf5_write(tmp_path) -> None:
    """A writer inside one HDF5 call at exit: the exit handler waits for that call to end, then
    holds the writer's own I/O lock, so the shutdown never meets a writer frozen inside h5py,
    holding h5py's lock. (Before: the process hung for good; then, with a fence on h5py's private
    ``h5py._objects.phil``, it still hung where h5py had no such attribute.)"""
    cases = [(how, lock) for how in ("close", "unclosed") for lock in ("phil", "moved")]
    procs = {(how, lock): start_python(LONG_WRITE, str(tmp_path / f"{how}_{lock}.h5"), how, lock)
             for how, lock in cases}
    for (how, lock), proc in procs.items():
        code, _, err = finish(proc, timeout=90)
        assert code == 0, f"{how}/{lock}: {'hung at exit' if code is None else err}"
        with td.open_trace(tmp_path / f"{how}_{lock}.h5") as trace:
            assert not trace.complete


def test_a_recorder_that_gets_no_writer_thread_never_raises_and_says_why(tmp_path, fmt, caplog) -> None:
    """No thread to be had (a process at its thread limit, or out of address space for a stack):
    ``Thread.start`` raised into the host from ``td.record``. Now recording stops with one warning,
    and the trace is closed saying why."""
    path = tmp_path / f"nothread.{fmt}"
    old = threading.stack_size(1 << 60)  # a stack no address space holds: start() fails
    try:
        with caplog.at_level(logging.WARNING, logger="tracediff"):
            rec = td.record(path)
    finally:
        threading.stack_size(old)
    assert not rec.active and "error in start" in rec.stopped and "thread" in rec.stopped
    rec.log("h", np.zeros((1, 4), np.float32), token_ids=[0])
    rec.close()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    with td.open_trace(path) as trace:
        assert trace.complete and len(trace.index) == 0 and "error in start" in trace.finals[0]["stopped"]


# A recording host forks (a bare fork, a fork-started worker); the child logs on the recorder it
# inherited, whose writer thread stayed in the parent, and reports what it saw as JSON.
FORKED = """
import json, os, sys, time
import numpy as np
import tracediff as td
path = sys.argv[1]
rec = td.record(path, on_full="block", block_timeout=1.0, queue_bytes=1 << 20)
x = np.zeros((64, 1024), np.float32)  # 256 KiB: the queue holds 4
rec.log("h", x, step=0, token_ids=np.arange(64))
assert rec.flush()
pid = os.fork()
if pid == 0:
    start = time.monotonic()
    for step in range(10):
        rec.log("child", x, step=step, token_ids=np.arange(64))
    seconds = time.monotonic() - start
    links = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    fds = [link for link in links if os.path.exists(link) and os.path.samestat(os.stat(link), os.stat(path))]
    print(json.dumps({"seconds": seconds, "active": rec.active, "trace_fds": len(fds)}), flush=True)
    sys.exit(0)  # exit handlers and library shutdown run, HDF5's included
os.waitpid(pid, 0)
for step in range(1, 4):
    rec.log("h", x, step=step, token_ids=np.arange(64))
rec.close()
"""


@pytest.mark.subprocess
def test_a_forked_child_neither_waits_on_nor_writes_its_parents_recorder(tmp_path, fmt) -> None:
    """The child's copy of the recorder believed it recorded: its queue filled (no writer thread
    came along with the fork), then each on_full="block" call waited out block_timeout (10 calls,
    7 s). Now it is inactive in the child, and an HDF5 writer's descriptor there points at a scratch
    file (HDF5 flushes open files at exit, into the parent's trace). The parent's trace is whole."""
    path = tmp_path / f"forked.{fmt}"
    code, out, err = finish(start_python(FORKED, str(path)), timeout=90)
    assert code == 0, err
    child = json.loads(out)
    assert child["seconds"] < 0.5 and not child["active"]
    if fmt == "h5":
        assert child["trace_fds"] == 0
    with td.open_trace(path) as trace:
        assert trace.complete and trace.names() == ["h"] and trace.index.step.tolist() == [0, 1, 2, 3]


# Peak memory while a host floods the recorder with tiny tensors faster than the writer writes.
FLOOD = """
import json, sys
import numpy as np, torch
import tracediff as td

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))

path, queue_bytes, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rec = td.record(path, queue_bytes=queue_bytes)
x, ids = torch.zeros(1, 4), np.arange(1)  # 16 bytes a tensor
for step in range(2000):  # the writer's own structures exist before the baseline
    rec.log("h", x, step=step, token_ids=ids, request="r")
rec.flush()
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # peak RSS := current RSS
base = status("VmRSS")
for step in range(n):
    rec.log("h", x, step=step, token_ids=ids, request="r")
peak = status("VmHWM")
rec.close()
print(json.dumps({"growth": peak - base, "dropped": sum(rec.dropped.values()),
                  "reasons": dict(rec.dropped_reasons), "written": rec.records_written}))
"""
# Beyond queue_bytes: one write batch in flight, Arrow's memory pool and allocator slack (the
# writers' own memory no longer grows with the trace: tests/test_writer_size.py). Measured here:
# h5 4-8 MiB, arrow 15-22 MiB, over 62k to 480k records.
CONSTANT = 24 * MiB


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak RSS reset")
def test_peak_memory_stays_within_queue_bytes_under_a_flood_of_tiny_tensors(tmp_path) -> None:
    """queue_bytes counts what a queued record holds, not only its tensor's 16 bytes (before:
    a 16 MiB queue let 400k such records grow the host by 450 MiB, none dropped; here, 60k records
    into 8 MiB grew it by 94 MiB (h5) and 46 MiB (arrow))."""
    pytest.importorskip("torch")
    queue_bytes, n = 8 * MiB, 60_000
    procs = {fmt: start_python(FLOOD, str(tmp_path / f"flood.{fmt}"), str(queue_bytes), str(n))
             for fmt in ("h5", "arrow")}
    for fmt, proc in procs.items():
        code, out, err = finish(proc, timeout=120)
        assert code == 0, err
        result = json.loads(out)
        assert result["growth"] < queue_bytes + CONSTANT, f"{fmt}: grew {result['growth'] / MiB:.0f} MiB"
        assert result["dropped"] + result["written"] == n + 2000
        assert result["dropped"] == 0 or result["reasons"] == {"queue full": result["dropped"]}


def test_log_calls_racing_close_are_written_or_counted(tmp_path, fmt) -> None:
    """Threads logging while close() runs, and on after it: every call's record is in the trace or
    counted as dropped, reason "closed" (before: calls that came after the writer's last take were
    lost without a trace)."""
    path = tmp_path / f"race.{fmt}"
    rec = td.record(path)
    calls = [0] * 4
    stop = threading.Event()

    def host(i: int) -> None:
        x = np.full((1, 4), i, np.float32)
        while not stop.is_set():
            rec.log(f"t{i}", x, step=calls[i], token_ids=[0], request="r")
            calls[i] += 1

    threads = [threading.Thread(target=host, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    while min(calls) < 300:
        time.sleep(0.001)
    rec.close()
    after = sum(calls)
    while sum(calls) < after + 400:
        time.sleep(0.001)
    stop.set()
    for thread in threads:
        thread.join()
    with td.open_trace(path) as trace:
        written = len(trace.index)
        final = trace.finals[0]
    assert written + sum(rec.dropped.values()) == sum(calls)
    assert set(rec.dropped_reasons) == {"closed"} and rec.dropped_reasons["closed"] >= 400
    assert final["dropped_records"] <= sum(rec.dropped.values()) and final["records"] == written


@pytest.mark.parametrize("on_full", ["drop", "block"])
def test_a_record_larger_than_queue_bytes_is_refused_not_queued(tmp_path, on_full) -> None:
    """The queue's bound holds for a single record too (an empty queue once took a 4 MiB log under a
    1 MiB bound), and a block-mode host does not wait for room that can never come."""
    path = tmp_path / "t.h5"
    with td.record(path, queue_bytes=1 << 20, on_full=on_full, block_timeout=3600) as rec:
        rec.log("big", np.zeros((1, 1 << 20), np.float32), token_ids=[1])
        rec.log("small", np.zeros((1, 4), np.float32), token_ids=[1])
    with td.open_trace(path) as trace:
        assert trace.names() == ["small"]
        assert trace.finals[0]["dropped_reasons"] == {"larger than queue_bytes": 1}


def test_the_run_metadata_names_the_versions_of_the_libraries_loaded(tmp_path) -> None:
    import transformers

    with td.record(tmp_path / "t.h5") as rec:
        rec.log("h", np.zeros((1, 4), np.float32), token_ids=[1])
    with td.open_trace(tmp_path / "t.h5") as trace:
        versions = trace.meta["versions"]
    assert versions["numpy"] == np.__version__ and versions["transformers"] == transformers.__version__


def test_the_exit_fence_takes_a_writers_lock_even_when_its_thread_looks_ended() -> None:
    """A Ctrl-C that interrupts close()'s join leaves CPython 3.11 reporting the busy writer thread as
    ended; the fence skipped such threads, and interpreter exit hung on h5py's lock (9 runs in 10
    of a host pressing Ctrl-C while close() drained 1 GiB). A thread never started reports the same."""
    lock = threading.Lock()
    lock.acquire()  # the writer is inside a call into its file
    writer = threading.Thread(target=lambda: None)
    assert not writer.is_alive()
    writers = Writers()
    writers.add(writer, lock)
    fence = threading.Thread(target=writers.fence, daemon=True)
    fence.start()
    fence.join(EXIT_FENCE + 0.5)
    assert fence.is_alive()  # waits for the writer's call to end
    lock.release()
    fence.join(10)
    assert not fence.is_alive() and lock.locked()  # and keeps the lock: the writer stays out of h5py


def test_a_call_with_more_row_keys_than_the_token_share_is_not_queued_past_the_bound(tmp_path) -> None:
    """One log of 12M rows of 0 elements: the tensor was refused as larger than queue_bytes, but its
    keys went to the token book's queue past its share (+1.5 GB of host memory)."""
    from tracediff.record.queue import LEARN_OVERHEAD, TOKEN_ROW_BYTES

    with td.record(tmp_path / "t.h5", queue_bytes=16 << 20) as rec:
        rows = (16 << 20) // 16 // TOKEN_ROW_BYTES + 1  # its keys alone exceed the book's share
        assert LEARN_OVERHEAD + rows * TOKEN_ROW_BYTES > (16 << 20) // 16
        rec.log("h", np.zeros((rows, 0), np.float32), token_ids=np.arange(rows) % 100, request="r")
        assert rec.token_calls_dropped == 1
