"""Read trace files into the page cache on a background thread while the process starts.

A compare spends its first second importing, opening and planning before it reads a tensor
byte; the disk can deliver gigabytes meanwhile. A ``Warmer`` reads the files front to back, a
``STEP`` of each in turn, through madvise (which lets go of the GIL, so imports and planning go on),
up to a budget of the memory the machine has free, and unmaps what it read at once: the pages
stay in the page cache, none stay in the process's memory. Pages the page cache holds already are
skipped (mapping them would only cost a core the compare needs). Any failure just ends the warming.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tracediff.trace.fileio import MADV_POPULATE_READ, advise, missing

if TYPE_CHECKING:
    from tracediff.trace.reader import Trace

STEP = 64 << 20  # bytes of one file read before the next file's turn (larger reads run faster)
FREE_SHARE = 4  # read at most 1/FREE_SHARE of the memory the machine has available


class Warmer:
    """The background reading of some files; ``stop`` ends it after the step under way."""

    def __init__(self, paths: Sequence[str | Path], budget: int | None = None) -> None:
        """Start reading ``paths``, at most ``budget`` bytes (default: a share of free memory)."""
        self._stop = threading.Event()
        self._budget = available_memory() // FREE_SHARE if budget is None else budget
        self._thread = threading.Thread(target=self._run, args=(list(paths),), daemon=True,
                                        name="tracediff-warm")
        if self._budget > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        """Wait until the warming has ended (read its budget, every file, or was stopped)."""
        if self.running:
            self._thread.join()

    def _run(self, paths: list[str | Path]) -> None:
        maps: list[mmap.mmap] = []
        try:
            for path in paths:
                with open(path, "rb") as fh:
                    if os.fstat(fh.fileno()).st_size:
                        maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
            done = 0
            for start in range(0, max((len(m) for m in maps), default=0), STEP):
                for m in maps:
                    length = min(STEP, len(m) - start)
                    if self._stop.is_set() or done >= self._budget:
                        return
                    for at, size in missing(m, start, length):
                        if not advise(m, at, size, MADV_POPULATE_READ):
                            return  # a kernel before 5.14: no way to read ahead without waiting
                        advise(m, at, size, mmap.MADV_DONTNEED)
                        done += size
        except (OSError, ValueError):
            return  # warming only saves time: the compare reads (and reports) for itself
        finally:
            for m in maps:
                m.close()


def source_files(sources: Sequence[Trace | str | Path]) -> list[Path]:
    """The files behind traces (open ones, or paths not opened yet: a file, or a folder's files),
    for warming and for sizing a compare before anything is opened; paths that cannot be listed
    are left out (opening them reports why)."""
    from tracediff.trace.reader import Trace

    files: list[Path] = []
    for source in sources:
        if isinstance(source, Trace):
            files.extend(source.paths)
            continue
        path = Path(source)
        try:
            files.extend(sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir()
                         else [path] if path.is_file() else [])
        except OSError:
            continue
    return files


@contextmanager
def warming(sources: Sequence[Trace | str | Path], enabled: bool = True) -> Iterator[Warmer]:
    """The files of these traces (open, or paths) read into the page cache while the body runs
    (within a share of the free memory), stopped when it ends: callers say whether, never how."""
    warmer = Warmer(source_files(sources) if enabled else [], budget=None if enabled else 0)
    try:
        yield warmer
    finally:
        warmer.stop()


def available_memory() -> int:
    """MemAvailable in bytes (Linux); 0 where it cannot be read, which turns warming off."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
