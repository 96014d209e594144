"""Trace writers: a small trace weighs about what it holds, a flood of tiny records costs one HDF5
append per dataset a write (not one call per record), and the Arrow writer's index of what it
wrote stays in bounded memory over any run (issue 11)."""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import stat
import sys

import numpy as np
import pyarrow as pa
import pytest

import tracediff as td
from tracediff.trace.arrow import INDEX_HELD
from tracediff.trace.h5 import COMPACT_BELOW, DATASETS, DIRECT_BYTES
from tracediff.trace.schema import Record
from tracediff.trace.writer import open_writer

META = {"source": "test"}
FINAL = {"closed": True}


def small_trace(path):
    """10 KB of tensors: ten 1 KB records, one flush each."""
    with td.record(path, source="training") as rec:
        for step in range(10):
            rec.log("h", np.full((4, 64), step, np.float32), step=step, token_ids=np.arange(4), request="r")
            rec.flush()
    return path


def test_a_small_trace_weighs_about_what_it_holds(tmp_path, fmt) -> None:
    """HDF5 allocates a whole chunk for a chunk's first byte: a 10 KB trace was 1.39 MB as .h5 (its
    1 MiB data chunk and the first chunks of 19 index datasets), 35 KB as .arrow (an __index__ of
    one batch per flush). Now 33 KB and 29 KB, about half of it the schema, metadata and layout."""
    path = small_trace(tmp_path / f"small.{fmt}")
    assert path.stat().st_size < {"h5": 48_000, "arrow": 32_000}[fmt]
    with td.open_trace(path) as trace:
        assert trace.complete and len(trace.index) == 10
        assert trace.rows("h").data.tolist() == [[float(s)] * 64 for s in range(10) for _ in range(4)]
    assert os.listdir(tmp_path) == [path.name]  # no scratch file left beside it


def test_a_large_trace_keeps_its_records_in_place_for_the_compare(tmp_path) -> None:
    """Above COMPACT_BELOW an HDF5 trace keeps the layout it was written in, whose large data chunks
    lie one after the other: every record can be read in place (``data_offsets``, what the
    compare reads bfloat16 rows through)."""
    rows = np.arange(8 * 65536, dtype=np.int16).reshape(8, 65536)  # 1 MiB a record
    path = tmp_path / "large.h5"
    with td.record(path, flush_interval=0.05) as rec:
        for step in range(COMPACT_BELOW // rows.nbytes + 4):
            rec.log("h.logits", rows, step=step, token_ids=np.arange(8))
    with td.open_trace(path) as trace:
        offsets = trace.files[0].data_offsets()[trace.index.slot]
        assert (offsets >= 0).all() and len(offsets) == COMPACT_BELOW // rows.nbytes + 4
        mapped = trace.mapped()
        assert mapped[offsets[-1] : offsets[-1] + rows.nbytes].tobytes() == rows.tobytes()


def test_a_rewritten_small_trace_keeps_its_mode_and_its_link(tmp_path) -> None:
    """A small closed trace is rewritten compact and renamed into place: with the mode it was created
    with, and never through a symbolic link (the rename would replace the link, not its target). The
    recorder refuses a link as its path; a writer opened on one (open_writer) keeps it."""
    plain = small_trace(tmp_path / "plain.h5")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~umask
    target = tmp_path / "target.h5"
    link = tmp_path / "link.h5"
    link.symlink_to(target)
    with td.record(link) as rec:
        assert not rec.active and "symbolic link" in rec.stopped
    assert not target.exists()
    writer = open_writer(link, META)
    writer.write(tiny_records(10))
    writer.close({"closed": True})
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["link.h5", "plain.h5", "target.h5"]
    with td.open_trace(link) as trace:
        assert trace.complete and len(trace.index) == 10


def tiny_records(n: int, start: int = 0) -> list[Record]:
    x = np.zeros((1, 4), np.float32)
    return [Record("h", x, "float32", seq_no=i, step=i, request=np.array(["r"], dtype=object),
                   position=np.array([i]), token_id=np.array([7])) for i in range(start, start + n)]


def h5py_writes(path, records: list[Record]) -> int:
    """Calls to h5py's ``Dataset.__setitem__`` in one ``write`` of these records."""
    writer = open_writer(path, META)
    profile = cProfile.Profile()
    profile.enable()
    writer.write(records)
    profile.disable()
    writer.close(FINAL)
    calls = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(entry[1] for (file, _, function), entry in calls.items()
               if function == "__setitem__" and file.endswith(os.path.join("h5py", "_hl", "dataset.py")))


def test_an_hdf5_write_appends_once_per_dataset_whatever_the_number_of_records(tmp_path) -> None:
    """The writer made an h5py call per record (~50-150 us each): a flood of tiny records
    outran it. Now each write appends to each dataset once: 1024 tiny records, 19 appends."""
    records = tiny_records(1024)
    assert h5py_writes(tmp_path / "one.h5", records[:1]) == h5py_writes(tmp_path / "many.h5", records) \
        < len(DATASETS)
    with td.open_trace(tmp_path / "many.h5") as trace:
        rows = trace.rows("h")
        assert rows.position.tolist() == list(range(1024)) and rows.step.tolist() == list(range(1024))


def test_an_hdf5_write_of_large_and_small_records_reads_back_bit_identical(tmp_path) -> None:
    """Small records are joined into one write, large ones written from their own buffers; empty
    and static records in between take no bytes."""
    rng = np.random.default_rng(0)
    sizes = [3, DIRECT_BYTES // 4 + 5, 0, 17, DIRECT_BYTES // 2, 1, 2 * DIRECT_BYTES // 4]
    tensors = [rng.integers(0, 1 << 30, (1, n), dtype=np.int32) for n in sizes]
    records = [Record(f"t{i}", x, "int32", seq_no=i, request=np.array(["r"], dtype=object),
                      position=np.array([i]), token_id=np.array([i])) for i, x in enumerate(tensors)]
    records.insert(3, Record("w", np.arange(5, dtype=np.int64), "int64", seq_no=99, static=True))
    path = tmp_path / "mixed.h5"
    writer = open_writer(path, META)
    writer.write(records[:2])
    writer.write(records[2:])
    writer.close(FINAL)
    with td.open_trace(path) as trace:
        for i, x in enumerate(tensors):
            assert trace.rows(f"t{i}").data.tobytes() == x.tobytes(), i
        assert trace.read(trace.select(name="w")[0]).data.tolist() == list(range(5))


def resident() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmRSS"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_writer_stays_flat_in_memory_over_a_long_run(tmp_path, fmt) -> None:
    """Over 150k more tiny records, memory grew with the run: the HDF5 writer by 13 MB (HDF5's
    chunk caches and free lists), the Arrow writer's index of what it wrote by 10 MB (~70 bytes a
    record of Arrow memory). Now the HDF5 datasets have no chunk cache, and the Arrow
    index spills to an unlinked scratch file every INDEX_HELD entries (the closing __index__ is
    that file's stream): resident, Arrow and Python memory stay flat from 50k to 200k records, and
    the trace reads as before, an Arrow one from its index alone."""
    batch = tiny_records(1024)
    path = tmp_path / f"long.{fmt}"
    writer = open_writer(path, META)

    def held() -> tuple[int, int, int]:  # resident, Arrow's and Python's (objects alive: blocks) memory
        gc.collect()
        return resident(), pa.total_allocated_bytes(), sys.getallocatedblocks()

    for _ in range(50):
        writer.write(batch)
    before = held()
    for _ in range(150):
        writer.write(batch)
    after = held()
    grown = [b - a for a, b in zip(before, after)]
    # 150k records: a Python object kept per record would be 150k blocks or more
    assert grown[0] < (6 << 20) and grown[1] < (1 << 20) and grown[2] < 15_000, grown
    assert 150 * 1024 > 9 * INDEX_HELD  # the index spilled again and again
    writer.close(FINAL)
    assert os.listdir(tmp_path) == [path.name]
    with td.open_trace(path) as trace:
        assert len(trace.index) == 200 * 1024 and trace.index.step[:3].tolist() == [0, 1, 2]
        if fmt == "arrow":
            file = trace.files[0]
            assert list(file._batches) == [200]  # opened from the closing batch alone
            assert file._locations[1024 * 150 + 3] == (150, 3)
        assert trace.rows("h", step=5).position.tolist() == [5] * 200


def test_a_file_put_at_the_trace_path_while_recording_is_never_replaced(tmp_path, monkeypatch) -> None:
    """The trace was moved away, or the host changed directory under a relative path: what the path
    names at close is not the file written, so the compacting rename must leave it alone."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run2").mkdir()
    rec = td.record("trace.h5")
    rec.log("h", np.ones((2, 4), np.float32), token_ids=[1, 2])
    rec.flush()
    (tmp_path / "trace.h5").rename(tmp_path / "moved.h5")
    (tmp_path / "trace.h5").write_text("the user's own file")
    monkeypatch.chdir(tmp_path / "run2")
    (tmp_path / "run2" / "trace.h5").write_text("another run's file")
    rec.close()
    assert (tmp_path / "trace.h5").read_text() == "the user's own file"
    assert (tmp_path / "run2" / "trace.h5").read_text() == "another run's file"
    with td.open_trace(tmp_path / "moved.h5") as trace:
        assert trace.complete and trace.rows("h").numpy().tolist() == [[1.0] * 4] * 2
