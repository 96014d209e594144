"""A partial trace from the real producers never passes as a match (issue 23): SGLang's real model
code with a target class whose forward breaks the capture (the integration stops, the server goes
on), SpecForge 0.2.0's real training step under a queue too small (and the same blocking), a
recording killed before it closed, and ``tracediff record`` saying what it dropped at exit."""

from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import tracediff as td  # noqa: E402
from testbed import sglang_cpu  # noqa: E402
from testbed.held import held_writes  # noqa: E402
from testbed.sglang_cpu import serve_sample, train_sample  # noqa: E402
from tests.conftest import cli, run_python  # noqa: E402

SERVED = dict(num_steps=3, requests=2, new_tokens=8)  # a few seconds through SGLang's real code


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return serve_sample(tmp_path_factory.mktemp("healthy"), **SERVED)


@pytest.mark.slow
def test_a_serving_trace_whose_sglang_capture_stopped_is_incomplete(healthy, tmp_path, monkeypatch) -> None:
    """The target's text body is a class whose forward names its batch argument ``batch`` (SGLang
    passes it by position, so it serves as before): the integration cannot find the forward batch,
    logs once, stops and detaches; the server finishes its requests. Its trace holds the vocab map
    alone, which matches the healthy server's: once a ``match`` with exit 0, now incomplete."""
    import sglang.srt.models.llama as llama

    sglang_cpu.rename_batch_argument(monkeypatch, "target", llama.LlamaModel)
    broken = serve_sample(tmp_path, **SERVED)
    assert broken.chains == healthy.chains and broken.texts == healthy.texts  # the server went on
    with td.open_trace(broken.trace) as trace:
        assert trace.names() == ["draft.d2t"]
        (producer,) = trace.finals[0]["producers"].items()
        assert producer[0] == "sglang" and "forward_batch" in producer[1]["stopped"]
    for a, b, side in ((healthy.trace, broken.trace, "b"), (broken.trace, healthy.trace, "a")):
        out = cli("compare", str(a), str(b))
        assert out.returncode == 3, out.stdout
        said = (f"incomplete: {side} stopped recording: sglang stopped (target forward: ValueError: "
                "'forward_batch' is not in list; see the producer's warning")
        assert out.stdout.startswith(said), out.stdout


@pytest.mark.slow
def test_specforge_under_a_queue_too_small_is_incomplete_and_blocking_matches(healthy, tmp_path) -> None:
    """One real SpecForge training step recorded through its integration into a 256 KiB queue while
    the writer is held (a busy disk): with the default ``drop`` most of its draft tensors are
    dropped and counted; with ``on_full="block"`` the trainer waits and loses nothing."""
    full = train_sample(tmp_path / "full", healthy.texts)
    with held_writes():  # until the recorder closes: whatever the load, the trainer logs into a full queue
        dropped = train_sample(tmp_path / "drop", healthy.texts, queue_bytes=256 << 10)
    with held_writes(0.5):
        blocked = train_sample(tmp_path / "block", healthy.texts, queue_bytes=256 << 10, on_full="block",
                               block_timeout=30)
    out = cli("compare", str(full), str(dropped))
    assert out.returncode == 3, out.stdout
    first = out.stdout.splitlines()[0]
    assert first.startswith("incomplete: b dropped ") and first.endswith(
        'records (queue full at 256 KiB; raise queue_bytes or use on_full="block") '
        f"({first.split(' (')[-1]}"), first
    report = td.compare(full, dropped)
    assert report.b.gaps and all(g.kind == "dropped" and g.count > 0 for g in report.b.gaps)
    out = cli("compare", str(full), str(blocked))
    assert out.returncode == 0 and out.stdout.startswith("match"), out.stdout


KILLED = """
import os, signal, sys
import numpy as np
import tracediff as td

rec = td.record(sys.argv[1], source="serving")
for step in range(4):
    rec.log("h", np.full((2, 8), step, np.float32), step=step, token_ids=[step, step + 1], request="r")
rec.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.subprocess
def test_a_recording_killed_before_it_closed_is_incomplete(tmp_path) -> None:
    with td.record(tmp_path / "whole.h5", source="training") as rec:
        for step in range(4):
            rec.log("h", np.full((2, 8), step, np.float32), step=step, token_ids=[step, step + 1],
                    request="r")
    done = run_python(KILLED, str(tmp_path / "killed.h5"))
    assert done.returncode == -signal.SIGKILL
    out = cli("compare", str(tmp_path / "whole.h5"), str(tmp_path / "killed.h5"))
    assert out.returncode == 3, out.stdout
    assert out.stdout.startswith("incomplete: serving was never closed by its writer (killed, or still "
                                 "recording): rows after its last flush are missing; let the recording "
                                 "process end normally, or close() the recorder"), out.stdout


FLOOD = """
import sys

import numpy as np
import probe
from testbed.held import held_writes

rec = probe.factory(source="probe")
with held_writes(float(sys.argv[1]) or None):  # blocking, a record waits at most block_timeout (1 s)
    for step in range(40):
        rec.log("draft.fc_in", np.zeros((64, 4096), np.float32), step=step, token_ids=np.arange(64) + step,
                request=f"r{step}")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_tracediff_record_says_at_exit_what_each_file_dropped(tmp_path) -> None:
    from tests.test_record_launch import host, probe_env, record

    program = host(tmp_path, FLOOD)
    for on_full, says, held in (("drop", True, "0"), ("block", False, "0.3")):  # 0: held until the close
        out = tmp_path / f"{on_full}.h5"
        done = record("--out", str(out), "--queue-bytes", "2MiB", "--on-full", on_full, "--plugin", "probe",
                      "--", sys.executable, program, held, env=probe_env(tmp_path))
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("tracediff: wrote")]
        assert len(lines) == 1 and ("; incomplete: the trace dropped " in lines[0]) == says, done.stderr
        if says:
            assert lines[0].endswith('draft.fc_in records (queue full at 2 MiB; raise queue_bytes or use '
                                     'on_full="block")'), lines[0]
        assert done.stderr.count("incomplete") == int(says), done.stderr  # said once: by the launcher
    bad = record("--out", str(tmp_path / "x.h5"), "--queue-bytes", "lots", "--", sys.executable, program)
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "error: --queue-bytes: expected a size such as 256MiB or 1GB, got 'lots'", bad.stderr
