"""Reading raw bytes at a file offset straight into a caller's buffer (no mmap page faults)."""

from __future__ import annotations

import os

import numpy as np


def pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` (contiguous uint8) with the file's bytes at ``offset``; EOFError if the file ends."""
    view = memoryview(out).cast("B")
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
