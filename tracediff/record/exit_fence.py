"""The exit fence: at interpreter exit, keep every running trace writer out of its file's library.

Writers register the lock they hold inside each call into their file; the fence, an exit handler
run after the recorders' and before h5py's, takes each one and keeps it. A forked child forgets its
parent's writers and recorders.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any

logger = logging.getLogger("tracediff")

EXIT_FENCE = 1.0  # seconds the exit handler waits for a writer's call into its file before it says so


class Writers:
    """Writer threads still running, each with the lock it holds while in a call into its file."""

    def __init__(self) -> None:
        self.locks: dict[threading.Thread, threading.Lock] = {}

    def add(self, thread: threading.Thread, lock: threading.Lock) -> None:
        self.locks[thread] = lock
        _fence_before_h5py()
        # at exit, after the recorder's close (registered next: exit handlers run last first) and
        # before the fence, SIGINT is ignored by a call with no Python frame of its own for a
        # Ctrl-C to be raised in; the fence does the same, should this one meet a pending Ctrl-C
        atexit.unregister(IGNORE_SIGINT)
        atexit.register(IGNORE_SIGINT)

    def remove(self, thread: threading.Thread) -> None:
        self.locks.pop(thread, None)

    def fence(self) -> None:
        """Take and keep the lock of each writer still running: at once when the writer is between
        two calls into its file, else when its current call (one write: at most WRITE_BATCH records
        and flush_bytes) ends. The writer then waits on it, inside no library.

        Why at exit: the shutdown that follows freezes a writer thread still running wherever it is;
        frozen inside h5py, it would hold h5py's lock, and the shutdown's own cleanup of h5py objects
        would wait on it forever. Our own locks, not h5py's: nothing here depends on h5py's
        internals, and Arrow writers end on a whole batch too. A writer counts as running until it
        removes itself, never by ``Thread.is_alive``: a Ctrl-C that interrupts ``join`` leaves
        CPython 3.11 reporting a running thread as ended, and skipping it hung exit. From its start
        on, SIGINT is ignored: however many Ctrl-Cs arrive, the fence is never skipped.

        The same lock keeps a writer off torch: it waits on and frees CUDA copies only holding it
        (other tensors reach it as numpy arrays). A torch tensor freed in a thread as the shutdown
        began ended that thread inside C++ code (CPython's ``pthread_exit``), which aborted the
        process (``terminate called without an active exception``, exit 134)."""
        while True:  # a Ctrl-C (or several) raised here must not skip the fence: it would hang exit
            try:
                if self.locks:
                    _ignore_interrupts()
                break
            except KeyboardInterrupt:
                continue
        locks = list(self.locks.values())
        deadline = time.monotonic() + EXIT_FENCE
        for lock in locks:
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                logger.warning("tracediff: waiting for a trace writer's current write to end before exit")
                lock.acquire()  # without the GIL, for that one call


IGNORE_SIGINT = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
_ORDERED = False  # whether the fence was registered again, after h5py's exit handler


def _fence_before_h5py() -> None:
    """At the first writer's start, import h5py (it registers its own exit handler then) and register
    the fence again, after it: exit handlers run last registered first, so the fence now runs before
    h5py's. That handler calls into HDF5 (it unregisters h5py's type converters), and HDF5 is no
    library two threads may be in at once; h5py imported lazily, on opening an HDF5 trace, after the
    fence's registration on import, it ran first, beside a writer inside an HDF5 write: a host sent one
    Ctrl-C while exiting with a busy writer (close()'s join interrupted) died of SIGSEGV (1 run in 99).
    No recorder's exit handler is registered yet (each is registered after its writer's start), so
    every one still runs before the fence."""
    global _ORDERED
    if _ORDERED:
        return
    _ORDERED = True
    try:
        import h5py  # noqa: F401  (registers its exit handler, once)
    except ImportError:  # pragma: no cover - a dependency; without it no HDF5 writer either
        pass
    atexit.unregister(WRITERS.fence)
    atexit.register(WRITERS.fence)


def _ignore_interrupts() -> None:
    """From here to the end of the process, SIGINT does nothing: the fence and the shutdown after it
    are bounded (one write call, then the interpreter's own cleanup), and a Ctrl-C that interrupted
    the fence left a writer thread inside h5py for the shutdown to deadlock on (Ctrl-C twice at exit:
    the first ends close()'s join, the second the fence). A Ctrl-C already caught but not yet raised
    is then dropped too: CPython skips a pending signal whose handler is SIG_IGN."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (a fence run by hand): its Ctrl-Cs are not raised here
        pass


WRITERS = Writers()  # this process's; fenced by an exit handler (registered on import, again later)
RECORDERS: weakref.WeakSet[Any] = weakref.WeakSet()  # recorders whose writer thread runs, for forks

atexit.register(WRITERS.fence)


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads (their copies are not running): the parent's
    writers and recorders stay the parent's."""
    WRITERS.locks.clear()
    for rec in list(RECORDERS):
        rec.forked()
    RECORDERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["EXIT_FENCE", "IGNORE_SIGINT", "RECORDERS", "WRITERS", "Writers"]
