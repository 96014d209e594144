"""A trace writer held out of its file for a while, as a busy disk or writer under load holds it:
so that a recorder's queue fills, deterministically, while the host goes on logging."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held_writes(seconds: float | None = None) -> Iterator[None]:
    """Every HDF5 and Arrow writer's ``write`` waits, then writes as usual: until ``seconds`` have
    passed since entering (a host that blocks on a full queue gets room then), or with None until
    a recorder's ``close`` begins (whatever the machine's load, everything logged before it met the
    held writer). Put back on leaving."""
    from tracediff.record.recorder import Recorder
    from tracediff.trace import arrow, h5

    released = threading.Event()
    classes = (h5.H5Writer, arrow.ArrowWriter)
    originals = [cls.write for cls in classes]
    close = Recorder.close

    def held(original):
        def write(self, records):
            released.wait(60)
            return original(self, records)
        return write

    def closing(self, *args, **kwargs):
        released.set()
        return close(self, *args, **kwargs)

    for cls, original in zip(classes, originals):
        cls.write = held(original)  # type: ignore[method-assign]
    if seconds is None:
        Recorder.close = closing  # type: ignore[method-assign]
    timer = threading.Timer(seconds if seconds is not None else 60.0, released.set)
    timer.start()
    try:
        yield
    finally:
        released.set()
        timer.cancel()
        Recorder.close = close  # type: ignore[method-assign]
        for cls, original in zip(classes, originals):
            cls.write = original  # type: ignore[method-assign]
