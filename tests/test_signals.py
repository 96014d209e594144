"""Ctrl-C, once or many times, at any moment of a tracediff process: it ends, within a bound.

Each case is a real interpreter sent real SIGINTs, since what is promised (the process exits, the
trace reads, no traceback) is about the whole process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import tracediff as td
from tests.conftest import REPO

HANG = 120  # seconds: a process still running then is taken to hang (a detector, not a speed claim)

# A host whose HDF5 writer has a long backlog at exit: close() (run by the exit handler, with a long
# close_timeout) waits on it, so Ctrl-Cs meet close()'s join, then the exit fence, then the shutdown.
BUSY_AT_EXIT = """
import sys, time
import numpy as np
import tracediff as td
rec = td.record(sys.argv[1], queue_bytes=1 << 30, flush_interval=3600, flush_bytes=1 << 30, close_timeout=60)
x, ids = np.zeros((1, 4), np.float32), np.arange(1)
for step in range(int(sys.argv[2])):
    rec.log("h", x, step=step, token_ids=ids, request="r")
    if step == 99:
        assert rec.flush()
print("exiting", flush=True)
"""


def interrupt(proc: subprocess.Popen, first: float, count: int, every: float) -> None:
    """Send SIGINT ``count`` times, ``every`` seconds apart, the first after ``first`` seconds."""
    time.sleep(first)
    for _ in range(count):
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        time.sleep(every)


def finish(proc: subprocess.Popen) -> tuple[int | None, str]:
    try:
        _, err = proc.communicate(timeout=HANG)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("every", [0.01, 0.05, 0.2])
def test_a_host_sent_ctrl_c_again_and_again_while_exiting_with_a_busy_writer_exits(tmp_path, every) -> None:
    """The first Ctrl-C ends close()'s join, later ones used to interrupt the exit fence, which was
    then skipped: the shutdown froze the writer inside h5py and the host hung for good (10 runs in
    72). Now SIGINT is ignored from the fence on; the host exits and the trace reads."""
    path = tmp_path / "busy.h5"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", BUSY_AT_EXIT, str(path), "60000"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "exiting\n"
    interrupt(proc, first=0.3, count=int(4 / every), every=every)
    code, err = finish(proc)
    assert code is not None, f"hung at exit after Ctrl-Cs every {every}s: {err[-2000:]}"
    with td.open_trace(path) as trace:
        steps = trace.index.step.tolist()
    assert steps == list(range(len(steps))) and len(steps) >= 100


# The console entry point, started by hand so the test knows when its ``try`` runs: a SIGINT before
# that (the interpreter's start-up, the tracediff package's own imports) is out of its reach.
ENTRY = "import sys; from tracediff.entry import main; print('started', flush=True); " \
        "sys.argv[0] = 'tracediff'; main()"


def test_the_console_script_is_the_entry_module() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'tracediff = "tracediff.entry:main"' in text


# The console entry point with two Ctrl-Cs sent to itself the moment one chosen module starts to be
# imported (argv[1]): the moment is the import's, not a delay's (a fast machine ended the command
# before a timed Ctrl-C came).
CTRL_C_IN_AN_IMPORT = """
import importlib.abc, os, signal, sys
MODULE = sys.argv[1]
class Press(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # and a second, as an impatient user does
        return None
sys.meta_path.insert(0, Press())
from tracediff.entry import main
sys.argv = ["tracediff", "show", sys.argv[2]]
main()
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("module", ["typer", "rich.console", "tracediff.cli", "tracediff.report.show"])
def test_ctrl_c_while_the_command_line_imports_is_exit_130_without_a_traceback(tmp_path, module) -> None:
    """A Ctrl-C while cli.py's imports (or the command's own) run printed a KeyboardInterrupt
    traceback from the imports; now it is exit 130 and nothing on stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_AN_IMPORT, module, str(tmp_path / "missing.h5")],
                          env=env, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr == "", done.stderr[-2000:]


# The exit fence run in a process's main thread, as the last exit handler runs it, while a writer is
# inside a call into its file and the user presses Ctrl-C again and again; the call ends after 1 s.
FENCE_UNDER_CTRL_C = """
import os, signal, threading, time
from tracediff.record.exit_fence import Writers
lock = threading.Lock()
lock.acquire()
writers = Writers()
writers.add(threading.Thread(target=lambda: None), lock)
ready = threading.Event()
def press():
    ready.wait()
    time.sleep(0.1)  # the fence is waiting on the lock
    for _ in range(20):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.02)
    time.sleep(0.5)
    lock.release()
threading.Thread(target=press, daemon=True).start()
try:
    ready.set()
    writers.fence()
except KeyboardInterrupt:
    print("fence skipped by a Ctrl-C", flush=True)
else:
    print("fenced" if lock.locked() else "lock not held", flush=True)
"""


@pytest.mark.subprocess
def test_ctrl_c_pressed_again_and_again_never_skips_the_exit_fence() -> None:
    """The fence used to end on the KeyboardInterrupt of a Ctrl-C, leaving the writer free to enter
    h5py during the shutdown; now it ignores SIGINT and takes the lock once the call ends."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", FENCE_UNDER_CTRL_C], env=env, capture_output=True, text=True,
                          timeout=HANG)
    assert done.stdout == "fenced\n", done.stdout + done.stderr[-2000:]


# `tracediff convert` in a real entry point, with a signal arriving at a chosen moment of its write:
# argv[1] is when ("staged": while the output sits staged; "swallowed": a Ctrl-C raised inside a
# weakref callback, where Python prints and drops the exception, during the write).
SIGNAL_DURING_CONVERT = """
import os, signal, sys, weakref
from tracediff.trace import convert as convert_module
when, sig = sys.argv[1], getattr(signal, sys.argv[2])
real = convert_module._copy_part  # runs while the output is staged
def converting(*args, **kwargs):
    done = real(*args, **kwargs)
    if when == "staged":
        os.kill(os.getpid(), sig)
    else:
        class Held: pass
        held = Held()
        ref = weakref.ref(held, lambda _: os.kill(os.getpid(), sig))
        del held
    return done
convert_module._copy_part = converting
from tracediff.entry import main
sys.argv = ["tracediff", "convert"] + sys.argv[3:]
main()
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("when, sig, code", [("staged", "SIGTERM", 143), ("staged", "SIGINT", 130),
                                             ("swallowed", "SIGINT", 130)])
def test_a_signal_while_writing_publishes_nothing_and_leaves_nothing(tmp_path, when, sig, code) -> None:
    """SIGTERM left the hidden staging directory behind (default action: no unwinding), and a Ctrl-C
    that Python swallowed in a callback printed a traceback, then 'wrote ...' and exit 0."""
    out = tmp_path / "out.arrow"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_DURING_CONVERT, when, sig,
                             str(REPO / "traces" / "eagle3" / "training.h5"), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    returncode, err = finish(proc)
    assert returncode == code, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_staging_directory_left_by_a_dead_writer_goes_at_the_next_write(tmp_path) -> None:
    """A SIGKILL leaves `.NAME.PID.X.tracediff-tmp`; the next command writing there removes it, and
    leaves alone one whose process is alive."""
    from tests.conftest import cli

    dead = tmp_path / ".out.h5.999999999.abcd1234.tracediff-tmp"
    live = tmp_path / f".other.h5.{os.getppid()}.efgh5678.tracediff-tmp"
    for staging in (dead, live):
        staging.mkdir()
        (staging / "partial.h5").write_bytes(b"\0" * 1024)
    done = cli("convert", str(REPO / "traces" / "eagle3" / "training.h5"), str(tmp_path / "out.arrow"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "out.arrow"])
