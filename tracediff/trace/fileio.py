"""Reading raw bytes at a file offset straight into a caller's buffer (no mmap page faults), and
advice to the kernel about mapped file pages."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_LIBC = ctypes.CDLL(None, use_errno=True)
_madvise = getattr(_LIBC, "madvise", None)
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
_mincore = getattr(_LIBC, "mincore", None)
if _mincore is not None:
    _mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    _mincore.restype = ctypes.c_int


def pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` (contiguous uint8) with the file's bytes at ``offset``; EOFError if the file ends."""
    view = out.data.cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends at {offset + done}, {len(view) - done} bytes short")
        done += n


def prefetch(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading a range now, so that later preads find it in memory."""
    if hasattr(os, "posix_fadvise") and length > 0:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def advise(mapping: mmap.mmap, start: int, length: int, advice: int) -> bool:
    """madvise(2) on bytes [start, start + length) of ``mapping``; False where the kernel refuses
    the advice. Called through ctypes, which lets go of the GIL: ``mmap.madvise`` holds it, so a
    populate that waits for the disk would stall every thread."""
    if _madvise is None:
        try:
            mapping.madvise(advice, start, length)
            return True
        except OSError:
            return False
    address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data  # the view is dropped at once
    return _madvise(address + start, length, advice) == 0


def missing(mapping: mmap.mmap, start: int, length: int) -> list[tuple[int, int]]:
    """(offset, length) of the runs of pages of bytes [start, start + length) of ``mapping``
    (``start`` page-aligned) that are not in the page cache (mincore(2)); the whole range where
    that cannot be told."""
    if length <= 0:
        return []
    if _mincore is None or start % mmap.PAGESIZE:
        return [(start, length)]
    flags = np.zeros(-(-length // mmap.PAGESIZE), dtype=np.uint8)
    address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data  # the view is dropped at once
    if _mincore(address + start, length, flags.ctypes.data) != 0:
        return [(start, length)]
    edges = np.flatnonzero(np.diff(np.r_[1, flags & 1, 1].astype(np.int8)))  # run starts, stops
    stop = start + length
    runs = []
    for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
        first = start + a * mmap.PAGESIZE
        runs.append((first, min(start + b * mmap.PAGESIZE, stop) - first))
    return runs
