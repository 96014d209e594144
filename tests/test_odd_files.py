"""Files that are not what a trace path usually names: FIFOs, devices, and what a killed writer leaves.

A FIFO (or device) named as a trace or a mapping file is refused at once with one error line (it
used to block the command forever, waiting for a writer), and the hidden compaction copy a writer
killed at close leaves beside its trace is removed at the next open or write of that trace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tracediff as td
from tests.conftest import REPO
from tests.test_fuzz import fixed_trace
from tracediff.trace.h5 import STRANDED_AGE
from tracediff.trace.writer import open_writer

HANG = 60  # seconds: a command still running then is taken to hang (a detector, not a speed claim)


def tracediff(*args: str) -> subprocess.CompletedProcess:
    code = "from tracediff.entry import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=HANG)


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "f.h5"
    os.mkfifo(path)
    return path


@pytest.mark.subprocess
@pytest.mark.parametrize("where", ["show", "show B", "compare A", "compare B", "map file"])
def test_a_fifo_given_as_a_trace_or_mapping_file_is_one_error_line(tmp_path, fifo, where) -> None:
    trace = str(fixed_trace(tmp_path / "t.h5"))
    argv = {"show": ["show", str(fifo)], "show B": ["show", trace, str(fifo), "--name", "h"],
            "compare A": ["compare", str(fifo), trace], "compare B": ["compare", trace, str(fifo)],
            "map file": ["compare", trace, trace, "--map-file", str(fifo)]}[where]
    done = tracediff(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {fifo}: not a regular file") and done.stderr.count("\n") == 1, \
        done.stderr


def test_a_device_is_not_a_trace() -> None:
    with pytest.raises(td.TraceError, match="not a regular file"):
        td.open_trace("/dev/null")


def stranded(trace: Path, middle: str, age: float = 0.0) -> Path:
    copy = trace.parent / f".{trace.name}.{middle}.compact"
    copy.write_bytes(b"\0" * 4096)
    if age:
        then = time.time() - age
        os.utime(copy, (then, then))
    return copy


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the system reuses it, which takes a while)


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["open", "write"])
def test_a_compaction_copy_a_killed_writer_left_is_removed_at_the_next_open_or_write(tmp_path, how) -> None:
    """A SIGKILL during the compaction at close left ``.NAME.XXXX.compact`` (10-12 MB) beside the
    trace for good. Now the next open or write of that trace removes copies whose process is gone,
    and old unnamed ones; a live writer's copy, and a recent unnamed one, stay."""
    trace = fixed_trace(tmp_path / "t.h5")
    dead = stranded(trace, f"{dead_pid()}.abcd1234")
    old_unnamed = stranded(trace, "k2j4h5g6", age=STRANDED_AGE + 60)
    new_unnamed = stranded(trace, "z9y8x7w6")
    live = stranded(trace, f"{os.getpid()}.qwer5678")
    other = stranded(tmp_path / "t.h5.x.h5", f"{dead_pid()}.abcd1234")  # another trace's
    if how == "open":
        with td.open_trace(trace) as opened:
            assert opened.complete
    else:
        open_writer(trace, {"format": "tracediff"}).close({"closed": True})
    assert not dead.exists() and not old_unnamed.exists()
    assert new_unnamed.exists() and live.exists() and other.exists()
