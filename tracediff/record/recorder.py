"""The recorder: cheap ``log`` calls on the host's thread, all file work on one writer thread.

Rules it keeps for the host (training job or server), whatever the caller logs:

- Memory: what the queue holds, tensors and each record's bookkeeping (objects, row keys), is
  charged against ``queue_bytes``; the writer takes at most ``WRITE_BATCH`` records into one write.
  A full queue drops (counted) or blocks for at most ``block_timeout``.
- Time: ``close`` (and interpreter exit, which calls it) waits at most ``close_timeout`` seconds
  for the writer, then abandons a writer still busy (one warning): it stops at its next write, at
  most ``ABANDON_GRACE`` seconds later, and leaves the trace readable up to its last flush.
- Failures: any failure is logged once, stops recording and never raises into the caller. A tensor
  no trace can hold (an unknown dtype, more than 8 dims, a meta tensor) is refused at ``log``:
  dropped, counted with its reason, one warning; recording goes on.
- Accounting: every record a ``log`` call hands over is written or counted in ``dropped`` (by name)
  and ``dropped_reasons`` (queue full, closed, abandoned, unrecordable), also calls racing
  ``close``. Strict mode (``strict=True`` or ``TRACEDIFF_STRICT=1``), for people writing an
  integration, raises misuse (unrecordable tensors included) in the caller instead.

Every ``log`` call, recorded or filtered out, also teaches the writer its (request, position,
token_id) keys: the trace's token table (``__tokens__`` records) knows every request's tokens.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import platform
import socket
import sys
import threading
import time
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Iterator

import numpy as np

from tracediff.record.filters import RecordFilter
from tracediff.record.host import HostCopy, host_bytes, is_torch_tensor, tag_of_tensor, unrecordable
from tracediff.record.rowkeys import RowContext, RowKeys, resolve_keys, resolve_rows, sequence_keys
from tracediff.record.tokens import TokenBook
from tracediff.trace.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    RESERVED_PREFIX,
    Record,
    dumps_meta,
    tokens_record,
)
from tracediff.trace.writer import TraceWriter, format_for, open_writer

resource: ModuleType | None
try:
    import resource
except ImportError:  # not on Windows
    resource = None

logger = logging.getLogger("tracediff")

MiB = 1 << 20
ROOM_MARGIN = 8 * MiB  # room kept free for the format's own metadata and a clean close
CLOSE_TIMEOUT = 15.0  # seconds close() and interpreter exit wait for a busy writer, by default
ABANDON_GRACE = 2.0  # seconds an abandoned writer has to stop at its next write
EXIT_FENCE = 1.0  # seconds the exit handler waits for a writer's call into its file before it says so
WRITE_BATCH = 1024  # records one write takes at most: bounds its memory and how soon it can stop
# Host memory a queued record holds beside its tensor's bytes, what queue_bytes counts: its objects
# (queue entry, host copy, row keys, their arrays, and once the writer has learned them the keys
# expanded one per row) and, per row, the caller's keys copied (token ids, positions, mask) and
# their expansion (request, position, token). Measured (CPython 3.11, numpy and torch CPU tensors
# of 1 and 16 rows): 1.1-1.9 KB a record, 30-46 bytes a row; these keep a margin above that.
RECORD_OVERHEAD = 2048
ROW_BYTES = 64
LEARN_OVERHEAD = 256  # a call's keys queued for the token book (their arrays counted above)
TOKEN_ROW_BYTES = 24  # per row of those keys: expanded while the book learns them
STRICT_ENV = "TRACEDIFF_STRICT"
QUEUE_FULL, CLOSED, ABANDONED, STOPPED = "queue full", "closed", "abandoned", "stopped"
TOO_LARGE = "larger than queue_bytes"  # one record the queue could never hold within its bound

# Writer threads still running, each with the lock it holds while in a call into its file: the
# exit handler takes these.
_WRITERS: dict[threading.Thread, threading.Lock] = {}
_RECORDERS: weakref.WeakSet[Recorder] = weakref.WeakSet()  # recorders whose writer thread runs, for forks


@dataclass(slots=True)
class _Pending:
    """A logged tensor waiting for the writer thread."""

    name: str
    seq_no: int
    step: int
    depth: int
    data: HostCopy
    nbytes: int  # what it is charged against queue_bytes
    keys: RowKeys | None  # None for a static record
    row_mask: np.ndarray | None


@dataclass(slots=True)
class _Learn:
    """Row keys for the writer's token book (from a log call, or declared by request_tokens)."""

    keys: RowKeys
    declared: bool
    nbytes: int


class Recorder:
    """Records tensors into one trace file (one per rank). Use ``tracediff.record(...)``."""

    def __init__(
        self,
        path: str | Path,
        *,
        source: str = "unknown",
        meta: dict | None = None,
        format: str | None = None,
        compression: str | None = None,
        names: Iterable[str] | str | None = None,
        exclude: Iterable[str] | str | None = None,
        every: int = 1,
        requests: Iterable[str] | None = None,
        max_bytes: int | None = None,
        queue_bytes: int = 256 * MiB,
        on_full: str = "drop",
        block_timeout: float = 1.0,
        close_timeout: float = CLOSE_TIMEOUT,
        flush_interval: float = 1.0,
        flush_bytes: int = 64 * MiB,
        rank: int | None = None,
        world_size: int | None = None,
        enabled: bool = True,
        strict: bool | None = None,
    ) -> None:
        if on_full not in ("drop", "block"):
            raise ValueError(f"on_full must be 'drop' or 'block', got {on_full!r}")
        self.filter = RecordFilter.build(names, exclude, every, requests)
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.path = _rank_path(Path(path), self.rank, per_rank=rank is not None or self.world_size > 1)
        self.max_bytes = max_bytes
        self.queue_bytes = queue_bytes
        self.on_full = on_full
        self.block_timeout = block_timeout
        self.close_timeout = close_timeout
        self.flush_interval = flush_interval
        self.flush_bytes = min(flush_bytes, max(1, queue_bytes // 2))
        self.strict = _strict_from_env() if strict is None else bool(strict)
        self.dropped: Counter[str] = Counter()  # records not written, by name
        self.dropped_reasons: Counter[str] = Counter()  # the same records, by reason
        self.stopped: str | None = None
        self.records_written = 0
        self.bytes_written = 0
        self._contract_updates: dict = {}
        self._ctx = RowContext()
        self._seq = itertools.count()
        self._admitted = 0
        self._queued = 0
        self._queue: deque[_Pending | _Learn] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._sealed = False  # the writer takes nothing more from the queue: log counts what comes
        self._abandoned = False  # close gave up waiting: the writer stops at its next write
        self._warned_refused = False
        self._flush_requests = 0  # flush() asks the writer to write now without waiting for the interval
        self._flush_done = 0  # the last request the writer has honoured
        self._active = False
        self._static_once: set[str] = set()
        self._book = TokenBook()
        self._token_queued = 0  # bytes of row keys queued for the book (bounded apart from tensors)
        self._token_limit = queue_bytes // 16
        self._record_limit = queue_bytes - self._token_limit
        self.token_calls_dropped = 0  # calls whose keys were not learned: the book's queue was full
        self._last_learned: tuple | None = None  # (token_ids, positions, request, mask, step) last learned
        self._strict_layouts: dict[str, tuple] = {}  # host side, strict mode only
        self._layouts: dict[str, tuple] = {}  # writer side: (static, dtype, row shape) first seen per name
        self._mixed: set[str] = set()
        self._thread: threading.Thread | None = None
        self._writer: TraceWriter | None = None
        self._io = threading.Lock()  # held by the writer thread inside each call into the file
        if not enabled:
            return
        try:
            format_for(self.path, format)
            if not self.path.parent.is_dir():
                raise FileNotFoundError(f"output directory {self.path.parent} does not exist")
            run_meta = _run_meta(source, self._storable(meta or {}), self.rank, self.world_size, self.filter)
            dumps_meta(run_meta)
            self._writer = open_writer(self.path, run_meta, format, compression)
        except Exception as exc:  # a recorder that cannot start must not stop the host
            if self.strict:
                raise
            self._fail("open", exc)
            return
        self._active = True
        thread = threading.Thread(target=self._write_loop, name="tracediff-writer", daemon=True)
        _WRITERS[thread] = self._io
        try:
            thread.start()
        except Exception as exc:  # no thread to be had (limits, shutdown): a trace that says why
            del _WRITERS[thread]
            self._fail("start", exc)
            self._finish()
            if self.strict:
                raise
            return
        self._thread = thread
        _RECORDERS.add(self)
        atexit.register(self.close)

    # ---- the host-facing API -------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while records are being written (False once disabled, failed, stopped or closed)."""
        return self._active

    def log(self, name: str, tensor: Any, *, step: int | None = None, request: Any = None,
            positions: Any = None, token_ids: Any = None, depth: int | None = None,
            attention_mask: Any = None) -> None:
        """Record a per-token tensor. Omitted keys come from the current context; ``attention_mask``
        (shaped like token_ids, 0 = padding) gives padded rows position -1."""
        if not self._active:
            if self._closing and self.stopped is None and self._thread is not None:
                self._drop(name, CLOSED)  # a call racing close(), or after it
            return
        try:
            self._log(name, tensor, step, request, positions, token_ids, depth, attention_mask)
        except Exception as exc:
            if self.strict:
                raise
            self._fail(f"log({name!r})", exc)

    def log_static(self, name: str, tensor: Any, *, step: int | None = None, once: bool = False) -> None:
        """Record a tensor without a token axis (a weight, d2t, a config tensor); with ``once``, only
        the first call for a name records (for callers that run every step)."""
        if not self._active or (once and name in self._static_once):
            if not self._active and self._closing and self.stopped is None and self._thread is not None:
                self._drop(name, CLOSED)
            return
        try:
            if once:
                self._static_once.add(name)
            _check_name(name)
            if self.filter.keep_name(name) and (tensor := self._array(name, tensor)) is not None:
                if self.strict:
                    self._check_layout(name, (True, tag_of_tensor(tensor), None))
                self._submit(name, tensor, self._ctx.step if step is None else step, 0, None, None)
        except Exception as exc:
            if self.strict:
                raise
            self._fail(f"log_static({name!r})", exc)

    def request_tokens(self, request: Any, token_ids: Any, start: int = 0) -> None:
        """Declare a request's tokens (prompt + generated ids), whole or in pieces: ``token_ids[0]``
        sits at position ``start``. Compare then knows the request's full sequence even where no
        tensor of it was recorded."""
        if not self._active:
            return
        try:
            self._learn(sequence_keys(request, token_ids, start), None, declared=True)
        except Exception as exc:
            if self.strict:
                raise
            self._fail(f"request_tokens({request!r})", exc)

    def set_context(self, **fields: Any) -> None:
        """Set row keys (step, depth, request, positions, token_ids, attention_mask) for hooks and
        later logs. New token_ids drop the positions and mask of the old ones unless given too."""
        self._ctx = replace(self._ctx, **_context_fields(fields))

    @contextmanager
    def context(self, **fields: Any) -> Iterator[None]:
        """Row keys for the duration of a block (e.g. one forward pass), then the old ones."""
        saved = self._ctx
        self._ctx = replace(saved, **_context_fields(fields))
        try:
            yield
        finally:
            self._ctx = saved

    def update_contract(self, **values: Any) -> None:
        """Add contract metadata learned during the run (e.g. resolved aux ids); written at close.
        Arrays and tensors become lists; a value JSON cannot hold (NaN, an object) is left out with
        a warning (raised in strict mode), so that it cannot cost the trace its final metadata."""
        self._contract_updates.update(self._storable(values))

    def _storable(self, values: dict) -> dict:
        """The contract values JSON can hold (arrays and tensors as lists); the others are left out
        with a warning, or raise in strict mode."""
        out = {}
        for key, value in values.items():
            try:
                plain = json_ready(value)
                dumps_meta({key: plain})
            except (TypeError, ValueError) as exc:
                if self.strict:
                    raise ValueError(f"contract value {key!r} cannot be stored as JSON: {exc}") from None
                logger.warning("tracediff: contract value %r left out of %s: %s", key, self.path, exc)
                continue
            out[key] = plain
        return out

    def watch(self, module: Any, output: str | None = None, *, input: str | None = None) -> Any:
        """Record a torch module's output (and/or first input) on every forward."""
        from tracediff.record.hooks import watch

        return watch(self, module, output=output, input=input)

    def watch_modules(self, root: Any, pattern: str, template: str) -> list[Any]:
        """Watch every submodule whose dotted name matches ``pattern`` (``*`` = one part)."""
        from tracediff.record.hooks import watch_modules

        return watch_modules(self, root, pattern, template)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything logged so far is written (token table included); False on timeout
        or when not active."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._flush_requests += 1
            target = self._flush_requests
            self._cv.notify_all()
            while self._active and self._flush_done < target and time.monotonic() < deadline:
                self._cv.wait(0.01)
            return self._active and self._flush_done >= target

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then the end-of-run metadata; returns within ``timeout`` (default
        ``close_timeout``) + ``ABANDON_GRACE`` seconds. A writer still busy at ``timeout`` is
        abandoned: what it had not written is dropped (counted), the file left as last flushed,
        without final metadata. Returns at once when a close is already under way."""
        timeout = self.close_timeout if timeout is None else timeout
        atexit.unregister(self.close)
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._active = False
            self._cv.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if not thread.is_alive():
            return
        with self._cv:
            self._abandoned = True
            if self.stopped is None:
                self.stopped = f"writer abandoned: still busy {timeout:.1f}s after close"
            self._cv.notify_all()
        thread.join(ABANDON_GRACE)
        lost = "" if thread.is_alive() else f", {self.dropped_reasons[ABANDONED]} records not written"
        logger.warning("tracediff: writer for %s still busy %.1fs after close: abandoned%s; the trace "
                       "is readable up to its last flush", self.path, timeout, lost)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _log(self, name: str, tensor: Any, step: int | None, request: Any, positions: Any, token_ids: Any,
             depth: int | None, attention_mask: Any) -> None:
        ctx = self._ctx
        _check_name(name)
        if depth is not None and depth < 0:
            raise ValueError(f"depth must be >= 0 (0: rows fed by the target), got {depth}")
        step = ctx.step if step is None else step
        if token_ids is None:  # keys from the context (hooks)
            token_ids = ctx.token_ids
            positions = ctx.positions if positions is None else positions
            attention_mask = ctx.attention_mask if attention_mask is None else attention_mask
        request = ctx.request if request is None else request
        keep = self.filter.keep_name(name) and self.filter.keep_step(step)
        seen = (token_ids, positions, request, attention_mask, step)
        learned = _same_keys(seen, self._last_learned)
        if not keep:  # filtered out: its keys still teach the token table
            if not learned and token_ids is not None:
                self._learn(resolve_keys(step, token_ids, positions, request, attention_mask), seen)
            return
        tensor = self._array(name, tensor)
        if tensor is None:
            return
        keys = resolve_rows(tuple(tensor.shape), step, token_ids, positions, request, attention_mask)
        if self.strict:
            self._check_layout(name, (False, tag_of_tensor(tensor), tuple(tensor.shape[keys.lead_ndim:])))
        if not learned:
            self._learn(keys, seen)
        mask = None if self.filter.requests is None else self.filter.row_mask(keys.requests())
        if mask is not None and not mask.any():
            return
        self._submit(name, tensor, step, ctx.depth if depth is None else depth, keys, mask)

    def _learn(self, keys: RowKeys, seen: tuple | None, declared: bool = False) -> None:
        """Hand row keys to the token book: queued for the writer thread, or at once in strict mode
        (where a conflict must raise in the caller)."""
        if self.strict:
            self._book.learn(*keys.expand(), declared=declared, strict=True)
        else:
            nbytes = LEARN_OVERHEAD + keys.n_rows * TOKEN_ROW_BYTES
            with self._cv:
                full = self._token_queued + nbytes > self._token_limit  # one call too: never past it
                if self._sealed or full:
                    self.token_calls_dropped += 1
                    return
                self._token_queued += nbytes
                self._queued += nbytes
                self._queue.append(_Learn(keys, declared, nbytes))
                if self._token_queued > self._token_limit // 2:  # else they wait for the next wake-up
                    self._cv.notify_all()
        if seen is not None:
            self._last_learned = seen

    def _check_layout(self, name: str, layout: tuple) -> None:
        """Strict mode: a name keeps one dtype and row shape (compare cannot align mixed records)."""
        known = self._strict_layouts.setdefault(name, layout)
        if known != layout:
            raise ValueError(f"{name}: {_describe(layout)} differs from its earlier records "
                             f"({_describe(known)})")

    def _array(self, name: str, tensor: Any) -> Any:
        """A torch tensor or numpy array as given; anything else (a list, a scalar, another
        library's array, whose every conversion may copy it off a device) made a numpy array once,
        here, so that no check after converts it again. None when numpy makes no array of it: the
        record is refused and counted, like a tensor no trace can hold."""
        if isinstance(tensor, np.ndarray) or is_torch_tensor(tensor):
            return tensor
        try:
            return np.asarray(tensor)
        except (TypeError, ValueError) as exc:
            if self.strict:
                raise ValueError(f"{name}: not an array ({type(tensor).__name__}): {exc}") from None
            self._refuse(name, f"not an array ({type(tensor).__name__})")
            return None

    def _submit(self, name: str, tensor: Any, step: int, depth: int, keys: RowKeys | None,
                mask: np.ndarray | None) -> None:
        refused = unrecordable(tensor)
        if refused is not None:
            if self.strict:
                raise ValueError(f"{name}: a trace cannot hold this tensor: {refused}")
            self._refuse(name, refused)
            return
        nbytes = int(tensor.nbytes) if isinstance(tensor, np.ndarray) \
            else int(tensor.nelement() * tensor.element_size())
        if self.max_bytes is not None and self._admitted + nbytes > self.max_bytes:
            self._stop(f"byte budget of {self.max_bytes} reached")
            return
        cost = host_bytes(tensor) + RECORD_OVERHEAD + (0 if keys is None else keys.n_rows * ROW_BYTES)
        refused = self._reserve(cost)
        if refused is not None:
            self._drop(name, refused)
            return
        item = _Pending(name, next(self._seq), int(step), int(depth), HostCopy(tensor), cost, keys, mask)
        with self._cv:
            if self._sealed:  # close() began and the writer took its last items meanwhile
                self._queued -= cost
                self._drop(name, CLOSED)
                return
            self._admitted += nbytes
            self._queue.append(item)
            if self._queued - self._token_queued >= self.flush_bytes:  # else it waits for the interval:
                self._cv.notify_all()  # waking the writer for each record costs the host its GIL

    def _reserve(self, nbytes: int) -> str | None:
        """Room in the bounded queue for nbytes, waiting up to block_timeout if so configured;
        None when admitted, else why not."""
        if nbytes > self._record_limit:  # never fits: waiting for room would only stall the host
            return TOO_LARGE
        with self._cv:
            full = self._record_limit + self._token_queued  # the book's share is kept apart
            if self._queued + nbytes > full and self.on_full == "block":
                deadline = time.monotonic() + self.block_timeout
                self._cv.notify_all()  # the writer may be waiting for its interval
                while self._queued + nbytes > full and not self._sealed and self.stopped is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                    full = self._record_limit + self._token_queued
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

    def _refuse(self, name: str, why: str) -> None:
        """A tensor no trace can hold: dropped and counted; the first one is warned about."""
        self._drop(name, f"unrecordable: {why}")
        if not self._warned_refused:
            self._warned_refused = True
            logger.warning("tracediff: %s not recorded to %s: a trace cannot hold a tensor with %s "
                           "(counted in dropped; recording goes on)", name, self.path, why)

    def _forked(self) -> None:
        """In a forked child, which has none of its parent's threads: this recorder's writer stayed
        in the parent. Here it records nothing (a log call returns at once, instead of filling a
        queue no thread empties, then blocking on it), closes nothing at exit, and nothing this
        process does reaches the file the parent writes."""
        self._cv = threading.Condition()  # the parent's may be held by a thread that did not come along
        self._active, self._sealed, self._thread = False, True, None
        self._queue = deque()
        self.stopped = self.stopped or "forked: this recorder records in the parent process"
        atexit.unregister(self.close)
        if self._writer is not None:
            try:
                self._writer.forked()
            except Exception as exc:
                logger.warning("tracediff: could not detach %s from this forked process (%s: %s)", self.path,
                               type(exc).__name__, exc)

    def _stop(self, reason: str, level: int = logging.INFO) -> None:
        with self._cv:
            if self.stopped is None:
                self.stopped = reason
                logger.log(level, "tracediff: recording to %s stopped: %s", self.path, reason)
            self._active = False
            self._cv.notify_all()

    def _fail(self, where: str, exc: BaseException) -> None:
        with self._cv:
            if self.stopped is not None:
                return
            self.stopped = f"error in {where}: {type(exc).__name__}: {exc}"
            self._active = False
            self._cv.notify_all()
        logger.warning("tracediff: recording to %s stopped (%s); the host keeps running", self.path,
                       self.stopped)

    def _write_loop(self) -> None:
        backlog: deque[_Pending] = deque()  # taken from the queue, not yet written
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
                held += self._take(items, backlog)
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
            self._discard(backlog)
            self._finish()
            _WRITERS.pop(threading.current_thread(), None)
            _RECORDERS.discard(self)

    def _take(self, items: list[_Pending | _Learn], backlog: deque[_Pending]) -> int:
        """Teach the book queued keys (their queue bytes are then free) and move queued tensors to
        the backlog; returns the queue bytes those hold."""
        held, learn = 0, []
        for item in items:
            if isinstance(item, _Learn):
                learn.append(item)
            else:
                held += item.nbytes
                backlog.append(item)
        if learn:
            self._learn_all(learn)
            self._release(sum(item.nbytes for item in learn), tokens=True)
        return held

    def _learn_all(self, items: list[_Learn]) -> None:
        """One book update per run of declared / logged items (in order: first seen wins), not one
        per item: a wake-up may bring hundreds of small ones."""
        start = 0
        for end in range(1, len(items) + 1):
            if end == len(items) or items[end].declared != items[start].declared:
                keys = [item.keys.expand() for item in items[start:end]]
                request, position, token_id = (np.concatenate(column) for column in zip(*keys))
                self._book.learn(request, position, token_id, declared=items[start].declared)
                start = end

    def _write_backlog(self, backlog: deque[_Pending]) -> int:
        """Write the backlog, then the token table's new entries, in writes of at most WRITE_BATCH
        records and flush_bytes: a write's memory stays bounded, and an abandoned writer stops at
        the next one. Returns the queue bytes written."""
        written = 0
        while not self._abandoned:
            chunk: list[_Pending] = []
            cost = 0
            while backlog and len(chunk) < WRITE_BATCH and (not chunk or cost + backlog[0].nbytes
                                                             <= self.flush_bytes):
                chunk.append(backlog.popleft())
                cost += chunk[-1].nbytes
            if not chunk and not self._book.has_new():
                break
            if not self._room_for(cost):
                self._stop(f"disk nearly full: less than {cost + ROOM_MARGIN} bytes left", logging.WARNING)
                backlog.extendleft(reversed(chunk))
                break
            self._write([self._materialize(item) for item in chunk], tokens=not backlog)
            self._release(cost)
            written += cost
            if not backlog:
                break
        return written

    def _write(self, records: list[Record], tokens: bool) -> None:
        """Write tensors, then (with ``tokens``) the token table's new entries as one ``__tokens__``
        record."""
        new = self._book.take_new() if tokens else None
        if new is not None:
            records = [*records, tokens_record(*new, rank=self.rank)]
        if records:
            assert self._writer is not None  # the writer thread starts only once the file is open
            with self._io:
                self._writer.write(records)
        written = records if new is None else records[:-1]
        self.records_written += len(written)
        self.bytes_written += sum(r.nbytes for r in written)

    def _room_for(self, nbytes: int) -> bool:
        """Whether the disk and the process's file size limit leave room for nbytes and a margin.

        Checked before every write: HDF5 cannot survive a failed write, so we stop cleanly first.
        """
        needed = nbytes + ROOM_MARGIN
        stat = os.statvfs(self.path.parent)
        if stat.f_bavail * stat.f_frsize < needed:
            return False
        if resource is not None:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY and limit - os.path.getsize(self.path) < needed:
                return False
        return True

    def _discard(self, backlog: deque[_Pending]) -> None:
        """Count what will never be written (the writer stopped, failed or was abandoned) as dropped,
        and free its queue bytes; nothing queued later is taken (``_sealed``)."""
        with self._cv:
            self._sealed = True
            items = [*backlog, *self._queue]
            backlog.clear()
            self._queue.clear()
        reason = ABANDONED if self._abandoned else STOPPED if self.stopped else CLOSED
        learn = [item for item in items if isinstance(item, _Learn)]
        names = Counter(item.name for item in items if isinstance(item, _Pending))
        with self._cv:
            self.token_calls_dropped += len(learn)
            self.dropped.update(names)
            if names:
                self.dropped_reasons[reason] += sum(names.values())
        self._release(sum(item.nbytes for item in learn), tokens=True)
        self._release(sum(item.nbytes for item in items if isinstance(item, _Pending)))

    def _release(self, nbytes: int, tokens: bool = False) -> None:
        with self._cv:
            self._queued -= nbytes
            if tokens:
                self._token_queued -= nbytes
            self._cv.notify_all()

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
        final = {
            "closed": True,
            "records": self.records_written,
            "bytes": self.bytes_written,
            "dropped_records": sum(dropped.values()),
            "dropped": dropped,
            "dropped_reasons": reasons,
            "stopped": self.stopped,
            "contract": self._contract_updates,
            "tokens": self._book.written,
            "token_conflicts": self._book.conflicts,
            "token_calls_dropped": self.token_calls_dropped,
            "token_positions_ignored": self._book.out_of_range,
            "mixed_records": sorted(self._mixed),
        }
        try:
            with self._io:
                self._writer.close(final)
        except Exception as exc:
            self._fail("close", exc)

    def _materialize(self, item: _Pending) -> Record:
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


def _fence_writers_at_exit() -> None:
    """The last exit handler (registered on import, before any recorder's close). The shutdown that
    follows freezes a writer thread still running wherever it is: frozen inside h5py, it would hold
    h5py's lock, and the shutdown's own cleanup of h5py objects would wait on it forever. A writer
    makes every call into its file holding its recorder's I/O lock; this takes the lock of each
    writer still running and keeps it: at once when the writer is between two calls, else when its
    current call (one write: at most WRITE_BATCH records and flush_bytes) ends. The writer then
    waits on it, inside no library. Our own locks, not h5py's: nothing here depends on h5py's
    internals, and Arrow writers end on a whole batch too. (A forked child's copies of its parent's
    writer threads are not running: the fork handler forgets them.) A writer counts as running until
    it removes itself, never by ``Thread.is_alive``: a Ctrl-C that interrupts ``join`` leaves
    CPython 3.11 reporting a running thread as ended, and skipping it hung exit."""
    locks = list(_WRITERS.values())
    deadline = time.monotonic() + EXIT_FENCE
    for lock in locks:
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            logger.warning("tracediff: waiting for a trace writer's current write to end before exit")
            lock.acquire()  # without the GIL, for that one call


atexit.register(_fence_writers_at_exit)


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: the parent's recorders stay the parent's."""
    _WRITERS.clear()
    for rec in list(_RECORDERS):
        rec._forked()
    _RECORDERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def json_ready(value: Any) -> Any:
    """Arrays, tensors and numpy scalars in metadata as the lists and numbers JSON holds."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray) or isinstance(value, np.generic) or is_torch_tensor(value):
        return value.tolist()
    return value


def _check_name(name: str) -> None:
    """Names starting with ``__`` belong to the trace format (its token table, index, final
    metadata): a tensor under one would corrupt the trace. A NUL character could never be selected
    again (numpy strings drop trailing NULs): readers refuse such names."""
    if not isinstance(name, str) or not name or name.startswith(RESERVED_PREFIX):
        raise ValueError(f"tensor name {name!r} is reserved or empty (names starting with "
                         f"{RESERVED_PREFIX!r} belong to the trace format)")
    if "\x00" in name:
        raise ValueError(f"tensor name {name!r} holds a NUL character")


def record(path: str | Path, **options: Any) -> Recorder:
    """Start recording to ``path`` (.h5 or .arrow). Options: see ``Recorder``."""
    return Recorder(path, **options)


def _strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _context_fields(fields: dict) -> dict:
    """Positions and attention mask describe one set of token ids: new ids come without the old ones'."""
    if "token_ids" in fields:
        return {"positions": None, "attention_mask": None, **fields}
    return fields


def _same_keys(seen: tuple, last: tuple | None) -> bool:
    """The very same key objects (and step) as the last learned call: hooks of one forward share
    the context's, so their keys are learned once."""
    return last is not None and seen[4] == last[4] and all(a is b for a, b in zip(seen[:4], last[:4]))


def _describe(layout: tuple) -> str:
    static, dtype, row_shape = layout
    return f"static {dtype}" if static else f"{dtype} rows of shape {row_shape}"


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and not (dist.is_available() and dist.is_initialized()):
        dist = None  # imported but not initialized: the environment says
    if rank is None:
        rank = dist.get_rank() if dist is not None else int(env_rank or 0)
    if world_size is None:
        world_size = dist.get_world_size() if dist is not None else int(env_world or 1)
    return rank, world_size


def _rank_path(path: Path, rank: int, per_rank: bool) -> Path:
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}") if per_rank else path


def _run_meta(source: str, contract: dict, rank: int, world_size: int, filt: RecordFilter) -> dict:
    from tracediff import __version__

    torch_info = None
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = torch.cuda.is_available()
        torch_info = {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
        }
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "source": source,
        "producer": "tracediff",
        "producer_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"hostname": socket.gethostname(), "pid": os.getpid(), "python": platform.python_version(),
                 "platform": platform.platform()},
        "torch": torch_info,
        "versions": {name: str(getattr(sys.modules[name], "__version__", "")) for name in
                     ("numpy", "transformers", "sglang", "specforge") if name in sys.modules},
        "rank": rank,
        "world_size": world_size,
        "filters": {"names": list(filt.names), "exclude": list(filt.exclude), "every": filt.every,
                    "requests": sorted(filt.requests) if filt.requests is not None else None},
        "contract": contract,
    }
