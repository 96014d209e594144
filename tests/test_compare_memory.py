"""compare's memory stays bounded whatever the layout: a trace whose tensor is one huge record
(an imported logits record of 600 x 128,256 fp32 is 307 MB, all of one step) is read and
measured in row windows of ~16 MiB, with the same verdict as a compare in small windows."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracediff as td
from tests.conftest import run_python
from tracediff.diff.metrics import engine_for

ROWS, WIDTH = 256, 131072  # 256 rows of 512 KiB: one 128 MiB float32 record a side
MiB = 1 << 20

# compare in a fresh interpreter, its anonymous memory (RssAnon: the page cache and mapped trace
# pages left out) sampled every millisecond; prints the peak over the memory before compare, then
# the report as --json writes it
CHILD = """
import json, re, sys, threading, time
from contextlib import redirect_stdout
from io import StringIO
from tracediff.cli import app

def anon():
    with open("/proc/self/status") as fh:
        return int(re.search(r"RssAnon:\\s+(\\d+)", fh.read()).group(1)) << 10

base, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
sampler = threading.Thread(target=sample)
sampler.start()
out = StringIO()
with redirect_stdout(out):
    try:
        app(["compare", sys.argv[1], sys.argv[2], "--json"], standalone_mode=False)
    except SystemExit:
        pass
done.set()
sampler.join()
print(json.dumps({"anon": peak[0] - base, "report": json.loads(out.getvalue())}))
"""


def _pair(tmp_path, suffix: str, rows: int, width: int, tag: str) -> tuple[str, str, np.ndarray]:
    """Two traces each holding one record of ``rows`` float32 rows; b differs at the last row
    compared (the very last row has no known fed token, so it is not aligned)."""
    x = np.random.default_rng(0).random((rows, width), dtype=np.float32)
    paths = []
    for side in ("a", "b"):
        if side == "b":
            x[-2, 5] += 1.0
        path = tmp_path / f"{tag}_{side}{suffix}"
        with td.record(path, queue_bytes=1 << 30, on_full="block", block_timeout=120) as rec:
            rec.oversized_alone = True
            rec.log("draft.logits", x, token_ids=np.arange(rows))
        paths.append(str(path))
    return paths[0], paths[1], x


def _compare_child(a: str, b: str) -> dict:
    done = run_python(CHILD, a, b)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize("suffix", [".h5", ".arrow"])
def test_one_huge_record_compares_in_bounded_memory(tmp_path, suffix) -> None:
    """Two 128 MiB records held 2 x 128 MiB of read-ahead buffers at once (+267 MiB anonymous over
    a tiny compare; +1.1 GB for 2 x 512 MiB): the record's rows were one read window, since a window
    was a group of whole steps. Now a window holds ~16 MiB a side, so the peak is the read-ahead
    ring's (3 windows x 2 sides x 16 MiB), less than one side's record, and the verdict is the one
    a compare in 1 MiB windows reaches, the diverging row measured as it is alone."""
    tiny = _compare_child(*_pair(tmp_path, suffix, 4, 64, "tiny")[:2])
    a, b, x = _pair(tmp_path, suffix, ROWS, WIDTH, "big")
    big = _compare_child(a, b)
    over = big["anon"] - tiny["anon"]
    assert over < 128 * MiB, f"compare's anonymous memory grew by {over / MiB:.0f} MiB over a tiny compare's"

    (tensor,) = big["report"]["tensors"]
    assert big["report"]["verdict"] == "diverged" and tensor["status"] == "diverged"
    assert tensor["rows"] == ROWS - 1 and tensor["failed"] == 1
    assert tensor["first_bad"]["position"] == ROWS - 2
    y = x.copy()
    y[-2, 5] -= 1.0  # a's row again (``_pair`` bumped the array in place for b)
    engine = engine_for(2 * x.nbytes)  # the engine the compare measured with
    alone = {k: float(v[0]) for k, v in engine.float_metrics(y[-2:-1], x[-2:-1], logits=True).items()}
    assert tensor["first_bad"]["metrics"] == pytest.approx(alone, rel=1e-12, abs=1e-15)

    small = td.compare(a, b, chunk_bytes=MiB, warm=False)
    (reference,) = [t for t in small.tensors if t.name == "draft.logits"]
    assert (reference.status, reference.rows, reference.failed) == ("diverged", ROWS - 1, 1)
    assert reference.worst == tensor["worst"]
    assert reference.first_bad is not None and reference.first_bad.metrics == tensor["first_bad"]["metrics"]


def test_a_step_larger_than_a_window_is_read_a_window_at_a_time(tmp_path) -> None:
    """One record of 64 rows of 4 KiB (one step), planned in chunks of 16 KiB: its 16 chunks were
    one read window of 252 KiB; read in 64 KiB windows now, every window holds at most 64 KiB a
    side, every chunk is read once in plan order, and the comparison equals one in the default
    windows."""
    from tracediff.diff.differ import compare_traces, read_ahead, read_windows
    from tracediff.diff.pair import Pair
    from tracediff.diff.plan import make_plan

    a, b, _ = _pair(tmp_path, ".h5", 64, 1024, "step")
    with td.open_trace(a) as ta, td.open_trace(b) as tb:
        traces = Pair(ta, tb)
        plan = make_plan(traces, chunk_bytes=16 << 10)
        windows = read_windows(plan.chunks, 64 << 10)
        assert len({c.window for c in plan.chunks}) == 1 and len(plan.chunks) == 16 and len(windows) == 4
        assert [i for w in windows.values() for i in w] == list(range(len(plan.chunks)))
        assert all(sum(plan.chunks[i].nbytes.a for i in w) <= 64 << 10 for w in windows.values())
        assert [c for c, _ in read_ahead(traces, plan.chunks, 64 << 10)] == plan.chunks
        small = compare_traces(traces, plan)
        whole = compare_traces(traces, make_plan(traces))
    assert [vars(t) for t in small.tensors] == [vars(t) for t in whole.tensors]
    assert small.first_divergence is not None and small.first_divergence.first_bad.position == 62
