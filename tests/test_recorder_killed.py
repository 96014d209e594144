"""A killed or starved host leaves a readable trace; the host itself keeps running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, cli, run_python, step_tensor

KILLED_WRITER = """
import sys, time
import numpy as np
import tracediff as td
sys.path.insert(0, sys.argv[2])
from tests.conftest import step_tensor
rec = td.record(sys.argv[1], source="serving", flush_interval=0.02)
for step in range(100000):
    rec.log("h", step_tensor(step), step=step, token_ids=np.arange(16))
    if step % 10 == 0:
        assert rec.flush()
        print(step, flush=True)
    time.sleep(0.002)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkill_mid_run_leaves_a_readable_trace(tmp_path, fmt) -> None:
    path = tmp_path / f"killed.{fmt}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(REPO)], env=env,
                             stdout=subprocess.PIPE, text=True)
    flushed = -1
    for line in child.stdout:
        flushed = int(line)
        if flushed >= 50:
            break
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert child.returncode == -signal.SIGKILL
    with td.open_trace(path) as trace:
        assert not trace.complete and trace.finals == [None]
        rows = trace.rows("h")
        steps = sorted(set(rows.step.tolist()))
        assert steps == list(range(len(steps))) and len(steps) > flushed
        for step in steps:
            assert rows.data[rows.step == step].tobytes() == step_tensor(step).tobytes()
    shown = cli("show", str(path))
    assert shown.returncode == 0 and "incomplete" in shown.stdout
    report = td.compare(path, path)  # what it holds compares; a trace cut short is never a match
    assert report.verdict == "incomplete" and not report.a.closed and report.exit_code == 3
    assert [g.kind for g in report.a.gaps] == ["not_closed"] == [g.kind for g in report.b.gaps]
    from tracediff.report.compare import to_markdown

    assert "> **Partial trace**: a was never closed by its writer" in to_markdown(report)


DISK_FULL_HOST = """
import logging, resource, signal, sys
import numpy as np
import tracediff as td
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a write past the limit fails with EFBIG
LIMIT = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
rec = td.record(sys.argv[1], source="training", flush_interval=0.01)
total = 0.0
for step in range(400):                                # the host's own work goes on
    x = np.full((64, 256), step, np.float32)
    rec.log("h", x, step=step, token_ids=np.arange(64))
    if step % 20 == 0:
        rec.flush()
    total += float(x.sum())
rec.close()
print("host finished", total, rec.active)
"""


LIMIT = 12 << 20  # 64 KiB a step, 400 steps: the limit is reached about half way


@pytest.mark.subprocess
def test_disk_full_stops_recording_host_keeps_running(tmp_path, fmt) -> None:
    path = tmp_path / f"full.{fmt}"
    done = run_python(DISK_FULL_HOST, str(path), str(LIMIT))
    assert done.returncode == 0, done.stderr
    assert "host finished" in done.stdout and done.stdout.strip().endswith("False")
    # once when it stopped, once at close: what the trace lacks, and how to avoid it
    (stopped, closed) = [line for line in done.stderr.splitlines() if line.startswith("tracediff:")]
    assert "file size limit (RLIMIT_FSIZE" in stopped, done.stderr
    said = (f"tracediff: {path}: incomplete: the trace stopped recording: its recorder stopped (file size "
            "limit (RLIMIT_FSIZE")
    assert closed.startswith(said) and "raise the file size limit (ulimit -f)" in closed, closed
    out = cli("compare", str(path), str(path))
    assert out.returncode == 3, out.stdout
    assert out.stdout.startswith("incomplete: a stopped recording after step "), out.stdout
    with td.open_trace(path) as trace:
        rows = trace.rows("h")
        steps = sorted(set(rows.step.tolist()))
        assert 0 < len(steps) < 400 and steps == list(range(len(steps)))
        assert all((rows.data[rows.step == s] == s).all() for s in steps)
        assert "file size limit" in trace.finals[0]["stopped"]
    assert os.path.getsize(path) <= LIMIT


def test_flush_makes_records_visible_to_a_reader_while_writing(tmp_path, fmt) -> None:
    path = tmp_path / f"live.{fmt}"
    rec = td.record(path, flush_interval=60)
    for step in range(3):
        rec.log("h", step_tensor(step), step=step, token_ids=np.arange(16))
    assert rec.flush()
    with td.open_trace(path) as trace:
        assert not trace.complete and len(trace.index) == 3
        assert np.array_equal(trace.rows("h", step=2).data, step_tensor(2))
    rec.close()
    with td.open_trace(path) as trace:
        assert trace.complete and trace.finals[0]["records"] == 3


def test_hdf5_reader_keeps_only_whole_records(tmp_path) -> None:
    """A writer killed between growing the index and its payload: records whose bytes are not all
    there are left out, the rest read as written."""
    import shutil

    import h5py

    path = tmp_path / "torn.h5"
    with td.record(path) as rec:
        for step in range(4):
            rec.log("h", step_tensor(step), step=step, token_ids=np.arange(16))
            rec.flush()
    torn = tmp_path / "torn_copy.h5"
    shutil.copy(path, torn)
    with td.open_trace(path) as trace:  # token-table records lie between the tensor records
        third = int(trace.index.slot[2])
    with h5py.File(torn, "a") as f:
        end = int(f["records/data_offset"][third])  # the data of records 2 and 3 never made it
        f["data"].resize((end + 10,))
        f["final"].resize((0,))  # and the writer never closed the file: a closed one is read strictly
    with td.open_trace(torn) as trace:
        assert len(trace.index) == 2
        assert trace.rows("h").data.tobytes() == np.concatenate([step_tensor(0), step_tensor(1)]).tobytes()
