"""The recorder's bounded queue and its drop accounting: what the host hands the writer thread.

What the queue holds, tensors and each record's bookkeeping, is charged against ``queue_bytes``
(the token book's row keys against a share of their own); every record not written is counted in
``dropped`` (by name) and ``dropped_reasons``. ``QueueAccounting`` is the Recorder's part that keeps it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from tracediff.record.copies import HostCopy
from tracediff.record.rowkeys import LogRowKeys

# Host memory a queued record holds beside its tensor's bytes, what queue_bytes counts: its objects
# (queue entry, host copy, row keys, their arrays, and once the writer has learned them the keys
# expanded one per row) and, per row, the caller's keys copied (token ids, positions, mask) and
# their expansion (request, position, token). Measured (CPython 3.11, numpy and torch CPU tensors
# of 1 and 16 rows): 1.1-1.9 KB a record, 30-46 bytes a row; these keep a margin above that.
RECORD_OVERHEAD = 2048
ROW_BYTES = 64
LEARN_OVERHEAD = 256  # a call's keys queued for the token book (their arrays counted above)
TOKEN_ROW_BYTES = 24  # per row of those keys: expanded while the book learns them
QUEUE_FULL, CLOSED, ABANDONED, STOPPED = "queue full", "closed", "abandoned", "stopped"
TOO_LARGE = "larger than queue_bytes"  # one record the queue could never hold within its bound


@dataclass(slots=True)
class Pending:
    """A logged tensor waiting for the writer thread."""

    name: str
    seq_no: int
    step: int
    depth: int
    data: HostCopy
    nbytes: int  # what it is charged against queue_bytes
    keys: LogRowKeys | None  # None for a static record
    row_mask: np.ndarray | None


@dataclass(slots=True)
class Learn:
    """Row keys for the writer's token book (from a log call, or declared by request_tokens)."""

    keys: LogRowKeys
    declared: bool
    nbytes: int


class QueueAccounting:
    """The queue, its byte bounds and what was dropped (state set up by ``Recorder.__init__``)."""

    _cv: threading.Condition
    _queue: deque[Pending | Learn]
    _queued: int  # queue bytes held: records and token-book keys
    _token_queued: int  # of those, the token book's
    _token_limit: int
    _record_limit: int
    _sealed: bool  # the writer takes nothing more from the queue: log counts what comes
    _abandoned: bool
    on_full: str
    block_timeout: float
    stopped: str | None
    dropped: Counter[str]
    dropped_reasons: Counter[str]
    dropped_by: Counter[tuple[str, str]]
    token_calls_dropped: int
    # Set by the importers (on_full="block"): a record over the bound waits for an empty queue and
    # is admitted alone, so memory stays within the larger of queue_bytes and the largest record.
    oversized_alone: bool = False

    @property
    def queued_bytes(self) -> int:
        """Host memory the queue holds now (0 once everything logged is written or dropped)."""
        with self._cv:
            return self._queued

    def _queue_keys(self, keys: LogRowKeys, declared: bool) -> bool:
        """Queue row keys for the writer's token book, within the book's share (one call too: never
        past it); False, counted in ``token_calls_dropped``, when they do not fit."""
        nbytes = LEARN_OVERHEAD + keys.n_rows * TOKEN_ROW_BYTES + keys.id_bytes()
        with self._cv:
            if self._sealed or self._token_queued + nbytes > self._token_limit:
                self.token_calls_dropped += 1
                return False
            self._token_queued += nbytes
            self._queued += nbytes
            self._queue.append(Learn(keys, declared, nbytes))
            if self._token_queued > self._token_limit // 2:  # else they wait for the next wake-up
                self._cv.notify_all()
        return True

    def _reserve(self, nbytes: int) -> str | None:
        """Room in the bounded queue for nbytes, waiting up to block_timeout if so configured;
        None when admitted, else why not."""
        too_large = nbytes > self._record_limit
        # never fits: waiting for room would only stall the host (unless it may wait to be alone)
        if too_large and not (self.oversized_alone and self.on_full == "block"):
            return TOO_LARGE
        with self._cv:
            # the book's share is kept apart; an oversized record (oversized_alone) waits to be alone
            full = self._record_limit + self._token_queued
            if too_large:
                full = nbytes + self._token_queued
            if self._queued + nbytes > full and self.on_full == "block":
                deadline = time.monotonic() + self.block_timeout
                self._cv.notify_all()  # the writer may be waiting for its interval
                while self._queued + nbytes > full and not self._sealed and self.stopped is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                    full = (nbytes if too_large else self._record_limit) + self._token_queued
            if self._sealed:
                return CLOSED
            if self._queued + nbytes > full and self._queued > self._token_queued:
                return QUEUE_FULL
            self._queued += nbytes
            return None

    def _drop(self, name: str, reason: str) -> None:
        with self._cv:
            self.dropped[name] += 1
            self.dropped_reasons[reason] += 1
            self.dropped_by[(name, reason)] += 1

    def _dropped_by_name(self) -> dict[str, dict[str, int]]:
        """``dropped_by`` as the trace holds it: name -> reason -> count (call holding ``_cv``)."""
        out: dict[str, dict[str, int]] = {}
        for (name, reason), n in self.dropped_by.items():
            out.setdefault(name, {})[reason] = n
        return out

    def _release(self, nbytes: int, tokens: bool = False) -> None:
        with self._cv:
            self._queued -= nbytes
            if tokens:
                self._token_queued -= nbytes
            self._cv.notify_all()

    def _discard(self, backlog: deque[Pending]) -> None:
        """Count what will never be written (the writer stopped, failed or was abandoned) as dropped,
        and free its queue bytes; nothing queued later is taken (``_sealed``)."""
        with self._cv:
            self._sealed = True
            items = [*backlog, *self._queue]
            backlog.clear()
            self._queue.clear()
        reason = ABANDONED if self._abandoned else STOPPED if self.stopped else CLOSED
        learn = [item for item in items if isinstance(item, Learn)]
        names = Counter(item.name for item in items if isinstance(item, Pending))
        with self._cv:
            self.token_calls_dropped += len(learn)
            self.dropped.update(names)
            self.dropped_by.update({(name, reason): n for name, n in names.items()})
            if names:
                self.dropped_reasons[reason] += sum(names.values())
        self._release(sum(item.nbytes for item in learn), tokens=True)
        self._release(sum(item.nbytes for item in items if isinstance(item, Pending)))


__all__ = ["ABANDONED", "CLOSED", "LEARN_OVERHEAD", "QUEUE_FULL", "RECORD_OVERHEAD", "ROW_BYTES", "STOPPED",
           "TOKEN_ROW_BYTES", "TOO_LARGE", "Learn", "Pending", "QueueAccounting"]
