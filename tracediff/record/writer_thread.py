"""The recorder's writer thread: takes the queue, teaches the token book, writes the file.

All file work happens here, in writes of at most ``WRITE_BATCH`` records and ``flush_bytes``, each
checked for disk room first; at the end the file is closed with the end-of-run metadata (or left as
last flushed after a write error or when abandoned). ``WriterThread`` is the Recorder's part that runs it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from tracediff.record.exit_fence import RECORDERS, WRITERS
from tracediff.record.pathlock import TraceLock
from tracediff.record.queue import Learn, Pending
from tracediff.record.tokens import TokenBook
from tracediff.trace.schema import Record, tokens_record
from tracediff.trace.writer import TraceWriter

resource: ModuleType | None
try:
    import resource
except ImportError:  # not on Windows
    resource = None

MiB = 1 << 20
ROOM_MARGIN = 8 * MiB  # room kept free for the format's own metadata and a clean close
WRITE_BATCH = 1024  # records one write takes at most: bounds its memory and how soon it can stop


class WriterThread:
    """The writer thread's loop and its file work (state set up by ``Recorder.__init__``)."""

    _cv: threading.Condition
    _queue: deque[Pending | Learn]
    _closing: bool
    _sealed: bool
    _abandoned: bool
    _flush_requests: int
    _flush_done: int
    _book: TokenBook
    _writer: TraceWriter | None
    _io: threading.Lock  # held by the writer thread inside each call into the file, and wherever it
    # waits on or frees a torch object (a CUDA copy's pinned buffer and event): the exit fence keeps
    # it, and a writer that freed one as the interpreter finalized aborted the host (host.py)
    _lock: TraceLock  # this trace's one-writer lock, released once the file is closed
    _layouts: dict[str, tuple]
    _mixed: set[str]
    _contract_updates: dict
    path: Path
    rank: int
    flush_interval: float
    flush_bytes: int
    stopped: str | None
    records_written: int
    bytes_written: int
    dropped: Counter[str]
    dropped_reasons: Counter[str]
    dropped_by: Counter[tuple[str, str]]
    producers: dict[str, dict]
    queue_bytes: int
    on_full: str
    _final_written: dict | None
    token_calls_dropped: int
    # a tool's recorder (an importer), no host's: it keeps no room free on the disk (it writes until
    # the disk or the file size limit refuses a write) and leaves reporting a stop to its caller
    importer: bool = False
    failure: BaseException | None  # what stopped the writer thread, if an error did

    if TYPE_CHECKING:  # the Recorder's other parts
        def _release(self, nbytes: int, tokens: bool = False) -> None: ...
        def _discard(self, backlog: deque[Pending]) -> None: ...
        def _dropped_by_name(self) -> dict[str, dict[str, int]]: ...
        def _stop(self, reason: str, level: int = logging.INFO) -> None: ...
        def _fail(self, where: str, exc: BaseException) -> None: ...

    def _write_loop(self) -> None:
        backlog: deque[Pending] = deque()  # taken from the queue, not yet written
        held = 0  # queue bytes the backlog holds
        deadline = time.monotonic() + self.flush_interval
        try:
            while True:
                with self._cv:
                    while not (self._queue or self._closing or self._flush_requests > self._flush_done
                               or self.stopped):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
                    items = list(self._queue)
                    self._queue.clear()
                    done = self._sealed = self._closing or self.stopped is not None
                    flush_to = self._flush_requests
                with self._io:  # CUDA copies of row keys are waited on and freed under it
                    held += self._take(items, backlog)
                    items.clear()
                now = time.monotonic()
                if done or flush_to > self._flush_done or now >= deadline or held >= self.flush_bytes:
                    held -= self._write_backlog(backlog)
                with self._cv:
                    self._flush_done = max(self._flush_done, flush_to)
                    self._cv.notify_all()
                if now >= deadline:
                    deadline = now + self.flush_interval
                if done or self.stopped is not None:
                    break
        except Exception as exc:
            self._fail("writer", exc)
        finally:
            with self._io:  # CUDA copies never written are freed under it
                self._discard(backlog)
            try:
                self._finish()
            finally:
                self._lock.release()  # the next recorder on this path may start
            WRITERS.remove(threading.current_thread())
            RECORDERS.discard(self)

    def _take(self, items: list[Pending | Learn], backlog: deque[Pending]) -> int:
        """Teach the book queued keys (their queue bytes are then free) and move queued tensors to
        the backlog; returns the queue bytes those hold."""
        held, learn = 0, []
        for item in items:
            if isinstance(item, Learn):
                learn.append(item)
            else:
                held += item.nbytes
                backlog.append(item)
        if learn:
            self._learn_all(learn)
            self._release(sum(item.nbytes for item in learn), tokens=True)
        return held

    def _learn_all(self, items: list[Learn]) -> None:
        """One book update per run of declared / logged items (in order: first seen wins), not one
        per item: a wake-up may bring hundreds of small ones."""
        start = 0
        for end in range(1, len(items) + 1):
            if end == len(items) or items[end].declared != items[start].declared:
                keys = [item.keys.expand() for item in items[start:end]]
                request, position, token_id = (np.concatenate(column) for column in zip(*keys))
                self._book.learn(request, position, token_id, declared=items[start].declared)
                start = end

    def _write_backlog(self, backlog: deque[Pending]) -> int:
        """Write the backlog, then the token table's new entries, in writes of at most WRITE_BATCH
        records and flush_bytes: a write's memory stays bounded, and an abandoned writer stops at
        the next one. Returns the queue bytes written."""
        written = 0
        while not self._abandoned:
            chunk: list[Pending] = []
            cost = 0
            while backlog and len(chunk) < WRITE_BATCH and (not chunk or cost + backlog[0].nbytes
                                                             <= self.flush_bytes):
                chunk.append(backlog.popleft())
                cost += chunk[-1].nbytes
            if not chunk and not self._book.has_new():
                break
            short = self._short_of_room(cost)
            if short is not None:
                self._stop(short, logging.WARNING)
                backlog.extendleft(reversed(chunk))
                break
            with self._io:  # CUDA copies are waited on, written and freed under it
                self._write([self._materialize(item) for item in chunk], tokens=not backlog)
                chunk.clear()
            self._release(cost)
            written += cost
            if not backlog:
                break
        return written

    def _write(self, records: list[Record], tokens: bool) -> None:
        """Write tensors, then (with ``tokens``) the token table's new entries as one ``__tokens__``
        record; the caller holds ``_io``."""
        new = self._book.take_new() if tokens else None
        if new is not None:
            records = [*records, tokens_record(*new, rank=self.rank)]
        if records:
            assert self._writer is not None  # the writer thread starts only once the file is open
            self._writer.write(records)
        written = records if new is None else records[:-1]
        self.records_written += len(written)
        self.bytes_written += sum(r.nbytes for r in written)

    def _short_of_room(self, nbytes: int) -> str | None:
        """Why the disk or the process's file size limit leaves no room for nbytes and a margin
        (None: they do). Checked before every write of a host's recorder: HDF5 cannot survive a failed
        write, so it stops cleanly first; a tool's recorder (``importer``) keeps no margin.
        """
        if self.importer:
            return None
        needed = nbytes + ROOM_MARGIN
        stat = os.statvfs(self.path.parent)
        if stat.f_bavail * stat.f_frsize < needed:
            return f"disk nearly full: less than {needed} bytes left"
        if resource is not None:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY and limit - os.path.getsize(self.path) < needed:
                return f"file size limit (RLIMIT_FSIZE {limit} bytes) nearly reached: less than {needed} " \
                       "bytes below it"
        return None

    def _finish(self) -> None:
        """Close the file with the end-of-run metadata; after a write error or when abandoned, leave
        it as flushed."""
        if self._writer is None:
            return
        if self._abandoned or (self.stopped or "").startswith("error in writer"):
            with self._io:
                self._writer.abort()
            return
        with self._cv:
            dropped, reasons = dict(self.dropped), dict(self.dropped_reasons)
            dropped_by = self._dropped_by_name()
            producers = {name: dict(said) for name, said in self.producers.items()}
        final = {
            "closed": True,
            "records": self.records_written,
            "bytes": self.bytes_written,
            "dropped_records": sum(dropped.values()),
            "dropped": dropped,
            "dropped_reasons": reasons,
            "dropped_by": dropped_by,
            "stopped": self.stopped,
            "producers": producers,
            "queue": {"bytes": self.queue_bytes, "on_full": self.on_full},
            "contract": self._contract_updates,
            "tokens": self._book.written,
            "token_conflicts": self._book.conflicts,
            "token_calls_dropped": self.token_calls_dropped,
            "token_positions_ignored": self._book.out_of_range,
            "token_rows_dropped": self._book.dropped,
            "mixed_records": sorted(self._mixed),
        }
        try:
            with self._io:
                self._writer.close(final)
            self._final_written = final
        except Exception as exc:
            self._fail("close", exc)

    def _materialize(self, item: Pending) -> Record:
        data = item.data.numpy()
        if item.keys is None:
            self._note_layout(item.name, (True, item.data.tag, None))
            return Record(name=item.name, data=data, dtype=item.data.tag, seq_no=item.seq_no,
                          step=item.step, rank=self.rank, depth=item.depth, static=True)
        keys = item.keys
        data = data.reshape((keys.n_rows, *data.shape[keys.lead_ndim:]))
        self._note_layout(item.name, (False, item.data.tag, data.shape[1:]))
        request, position, token_id = keys.expand()
        if item.row_mask is not None:
            data, request = data[item.row_mask], request[item.row_mask]
            position, token_id = position[item.row_mask], token_id[item.row_mask]
        return Record(name=item.name, data=data, dtype=item.data.tag, seq_no=item.seq_no, step=item.step,
                      rank=self.rank, depth=item.depth, request=request, position=position,
                      token_id=token_id)

    def _note_layout(self, name: str, layout: tuple) -> None:
        """Names whose records differ in dtype or row shape, for the final metadata."""
        if self._layouts.setdefault(name, layout) != layout:
            self._mixed.add(name)


__all__ = ["ROOM_MARGIN", "WRITE_BATCH", "WriterThread"]
