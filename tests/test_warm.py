"""The page-cache warmer: reads files front to back within its budget, leaves none of them in
the process's memory, and ends quietly on files it cannot read."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from tracediff.trace import warm
from tracediff.trace.warm import Warmer

STEP = 4 << 20  # the warmer's read size in these tests
SIZE = 8 * STEP


def resident(path, start: int = 0, stop: int | None = None) -> float:
    """The share of a file's pages in [start, stop) that are in the page cache (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    stop = size if stop is None else stop
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            address = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            flags = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), flags) == 0
        finally:
            mapped.close()
    seen = np.frombuffer(flags, dtype=np.uint8)[start // mmap.PAGESIZE : -(-stop // mmap.PAGESIZE)] & 1
    return float(seen.mean())


def rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS"))


@pytest.fixture
def cold_files(tmp_path, monkeypatch):
    """Two files of random bytes, out of the page cache (skips where it cannot be dropped)."""
    monkeypatch.setattr(warm, "STEP", STEP)
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    rng = np.random.default_rng(0)
    for path in paths:
        path.write_bytes(rng.integers(0, 255, SIZE, dtype=np.uint8).tobytes())
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if any(resident(p) > 0.1 for p in paths):
        pytest.skip("the page cache of these files cannot be dropped here (tmpfs?)")
    return paths


def test_warming_reads_both_files_front_first_within_its_budget(cold_files) -> None:
    warmer = Warmer(cold_files, budget=2 * STEP)
    warmer.join()
    for path in cold_files:  # one step of each, in turn; the kernel may read a little further
        assert resident(path, 0, STEP) == 1.0
        assert resident(path) < 0.75
    before, peak = rss(), 0
    warmer = Warmer(cold_files)
    while warmer.running:
        peak = max(peak, rss())
    assert all(resident(path) == 1.0 for path in cold_files)
    assert peak - before < 2 * STEP  # what was read stays in the page cache, not in our memory


def test_warming_stops_when_told(cold_files) -> None:
    warmer = Warmer(cold_files, budget=0)
    warmer.join()
    assert all(resident(path) == 0.0 for path in cold_files)
    warmer = Warmer(cold_files)
    warmer.stop()
    warmer.join()
    assert sum(resident(path) for path in cold_files) < 2.0


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_unreadable_files_end_the_warming_quietly(tmp_path, cold_files) -> None:
    Warmer([tmp_path / "missing.h5", *cold_files]).join()
    assert all(resident(path) == 0.0 for path in cold_files)  # the first failure ends it
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    Warmer([empty, tmp_path]).join()


def test_missing_names_the_runs_of_pages_the_page_cache_lacks(cold_files) -> None:
    from tracediff.trace.fileio import missing

    path = cold_files[0]
    with open(path, "rb") as fh:
        os.pread(fh.fileno(), 2 * STEP, STEP)  # the second and third steps into the page cache
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        assert missing(mapped, STEP, 2 * STEP) == []
        assert missing(mapped, 0, 4 * STEP) == [(0, STEP), (3 * STEP, STEP)]
        assert missing(mapped, 3 * STEP, 100) == [(3 * STEP, 100)]  # a range ending mid-page
        assert missing(mapped, 0, 0) == []
    finally:
        mapped.close()


def test_warming_reads_only_what_the_page_cache_lacks(cold_files, monkeypatch) -> None:
    """Files already in the page cache cost the warmer no reads: mapping their pages again would
    only take a core from the compare it runs beside."""
    path = cold_files[0]
    with open(path, "rb") as fh:
        os.pread(fh.fileno(), 2 * STEP, 0)  # the kernel may read ahead a little further
    reads: list[tuple[int, int]] = []
    advise = warm.advise
    monkeypatch.setattr(warm, "advise", lambda m, start, length, how: (
        reads.append((start, length)) if how == warm.MADV_POPULATE_READ else None,
        advise(m, start, length, how))[1])
    Warmer([path]).join()
    assert reads and all(start >= 2 * STEP for start, _ in reads)
    assert sum(length for _, length in reads) <= 6 * STEP
    assert resident(path) == 1.0
