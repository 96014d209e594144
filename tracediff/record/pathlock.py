"""One writer per trace: an OS lock (flock) on a hidden file beside the trace, held while recording.

A second recorder on the same path, in this process or another, finds it held and is refused; the
lock dies with the process that holds it, so a killed recorder never blocks the next one (its lock
file may stay behind, empty, and is reused).
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Windows: no lock is taken
    fcntl = None  # type: ignore[assignment]


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


class TraceLock:
    """The lock for one trace path: ``acquire`` (False when another writer holds it), ``release``."""

    def __init__(self, path: Path) -> None:
        self.path = lock_path(path)
        self.fd: int | None = None

    def acquire(self) -> bool:
        if fcntl is None:
            return True
        for _ in range(3):  # the holder may unlink the file between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except OSError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)
        return False

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)

    def forked(self) -> None:
        """In a forked child: let go of this process's copy; the parent keeps the lock and its file."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


__all__ = ["TraceLock", "lock_path"]
