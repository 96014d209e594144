"""Arrow writer and reader at the edges of what a file system does: a write(2) that writes less than
asked (any write of 2 GiB or more on Linux, or one near a full disk), a writer killed while it was
closing the file, and a trace's directory that refuses the writer's index scratch file."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tracediff as td
from tests.conftest import REPO
from tracediff.errors import TraceError
from tracediff.trace.arrow import INDEX_HELD, SCHEMA, ArrowWriter, records_to_batch, scratch_file
from tracediff.trace.schema import Record

CAP = 4099  # bytes a capped file writes per call: odd, so no write lands on a buffer boundary
BIG = np.arange(257 * 1021, dtype=np.float32).reshape(257, 1021)  # 1 MiB: 256 capped writes and more


class CappedFile(io.FileIO):
    """A real file whose write() writes at most CAP bytes a call and says so, as write(2) may."""

    cap = CAP

    def write(self, data) -> int:  # type: ignore[override]
        return super().write(memoryview(data).cast("B")[: self.cap])


class CappedWriter(ArrowWriter):
    def _open_raw(self):
        return CappedFile(self.path, "wb")


def big_record(step: int) -> Record:
    return Record(name="logits", data=BIG + step, dtype="float32", step=step, request=np.array(["r"] * 257),
                  position=np.arange(257), token_id=np.arange(257))


# --- 1. short writes --------------------------------------------------------------------------

def test_pyarrow_alone_loses_the_bytes_a_short_write_leaves_out(tmp_path) -> None:
    """Why the writer wraps its file: pyarrow ignores the count write() returns."""
    path = tmp_path / "raw.arrows"
    with CappedFile(path, "wb") as raw, pa.ipc.new_stream(raw, SCHEMA) as stream:
        stream.write_batch(records_to_batch([big_record(0)]))
    assert path.stat().st_size < BIG.nbytes
    with pytest.raises((pa.ArrowInvalid, OSError)):
        pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_records_larger_than_one_write_round_trip(tmp_path, compression) -> None:
    path = tmp_path / "capped.arrow"
    writer = CappedWriter(path, {"source": "test"}, compression=compression)
    writer.write([big_record(0), big_record(1)])
    writer.write([big_record(2)])
    writer.close({"records": 3})
    with td.open_trace(path) as trace:
        assert trace.complete and len(trace.index) == 3
        for i in range(3):
            record = trace.read(i)
            assert record.step == i and np.array_equal(record.data, BIG + i)
            assert record.token_id.tolist() == list(range(257))


def test_a_file_that_takes_no_bytes_is_an_error_not_a_spin(tmp_path) -> None:
    class Stuck(CappedWriter):
        def _open_raw(self):
            raw = CappedFile(self.path, "wb")
            raw.cap = 0
            return raw

    with pytest.raises(OSError, match="wrote none"):
        Stuck(tmp_path / "stuck.arrow", {"source": "test"})


# --- 2. killed while closing ------------------------------------------------------------------

@pytest.fixture(scope="module")
def closed_trace(tmp_path_factory) -> tuple[Path, list[tuple[str, int, bytes]]]:
    """A closed trace of 3 flushes, and (name, step, bytes) of each of its records."""
    path = tmp_path_factory.mktemp("closed") / "t.arrow"
    with td.record(path, source="training") as rec:
        for step in range(3):
            rec.log("h", np.full((2, 12), step, np.float32), step=step, token_ids=np.arange(2), request="r")
            rec.flush()
    with td.open_trace(path) as trace:
        records = [(r.name, r.step, r.data.tobytes()) for r in map(trace.read, range(len(trace.index)))]
    return path, records


CUTS = ("before the end-of-stream marker", "before the footer", "inside the footer",
        "before the footer's end marker", "inside the end marker")


def cut_points(path: Path) -> dict[str, int]:
    """Where a kill during close() can leave the file: the closing batch written, then the
    end-of-stream marker, then part or all of the footer, then part of its end marker."""
    data = path.read_bytes()
    assert data.endswith(b"ARROW1")
    footer = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
    return dict(zip(CUTS, (footer - 8, footer, (footer + len(data) - 10) // 2, len(data) - 6, len(data) - 3)))


@pytest.mark.parametrize("where", CUTS)
def test_a_trace_killed_while_closing_reads_as_a_killed_one(closed_trace, tmp_path, where) -> None:
    """Every batch is intact: every record reads. The closing batch's __final__ and __index__ are
    not used (the close they belong to never ended), so the trace is incomplete, like any killed one."""
    original, records = closed_trace
    path = tmp_path / "cut.arrow"
    path.write_bytes(original.read_bytes()[: cut_points(original)[where]])
    with td.open_trace(path) as trace:
        assert not trace.complete
        read = [trace.read(i) for i in range(len(trace.index))]
        assert [(r.name, r.step, r.data.tobytes()) for r in read] == records
        assert trace.request_tokens().requests() == ["r"]


def test_a_whole_but_unreadable_footer_is_still_refused(closed_trace, tmp_path) -> None:
    """The footer's end marker is there, so the close ended: a footer that does not read is damage."""
    data = bytearray(closed_trace[0].read_bytes())
    data[-10:-6] = b"\xff\xff\xff\x7f"
    path = tmp_path / "damaged.arrow"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="footer is unreadable"):
        td.open_trace(path)


# --- 3. a directory that refuses the index scratch file ---------------------------------------

def test_the_scratch_file_falls_back_to_the_temp_dir(tmp_path) -> None:
    with scratch_file(tmp_path / "gone") as scratch:
        where = os.readlink(f"/proc/self/fd/{scratch.fileno()}")
    assert os.path.dirname(where) == os.path.realpath(tempfile.gettempdir())  # "/tmp/#123 (deleted)"


def test_the_scratch_file_fails_only_when_both_refuse(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-temp"))
    with pytest.raises(FileNotFoundError):
        scratch_file(tmp_path / "gone")


READ_ONLY_DIR_WRITER = f"""
import sys, tempfile
import numpy as np
from tracediff.trace.arrow import ArrowWriter
from tracediff.trace.schema import Record
path = sys.argv[1]
try:
    tempfile.TemporaryFile(dir=sys.argv[2])
    sys.exit("the directory took a new file: nothing is tested")
except PermissionError:
    pass
writer = ArrowWriter(path, {{"source": "test"}})
for b in range({INDEX_HELD // 1000 + 2}):
    writer.write([Record(name="tiny", data=np.full((1, 2), b * 1000 + i, np.float32), dtype="float32",
                         step=b * 1000 + i, request=np.array(["r"]), position=np.array([i]),
                         token_id=np.array([i])) for i in range(1000)])
writer.close({{"records": {(INDEX_HELD // 1000 + 2) * 1000}}})
"""


@pytest.mark.subprocess
def test_a_trace_in_a_directory_that_refuses_new_files_is_written_whole(tmp_path) -> None:
    """The trace file was made beforehand, its directory is read-only: the index spill (past
    INDEX_HELD entries) goes to the temp dir, and the trace closes whole."""
    prefix: list[str] = []
    if os.geteuid() == 0:  # root writes anywhere: run the writer without that capability
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no directory refuses")
        prefix = ["setpriv", "--bounding-set", "-dac_override", "--inh-caps", "-dac_override", "--"]
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "t.arrow"
    path.touch(mode=0o666)
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", READ_ONLY_DIR_WRITER, str(path), str(folder)],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=120)
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr
    n = (INDEX_HELD // 1000 + 2) * 1000
    with td.open_trace(path) as trace:
        assert trace.complete and len(trace.index) == n
        last = trace.read(n - 1)
        assert last.step == n - 1 and last.data.tolist() == [[n - 1] * 2]
    assert os.listdir(folder) == ["t.arrow"]
