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
  dropped, counted with its reason, one warning; recording goes on. So is a record whose name or
  request id holds a lone surrogate. Metadata (``meta``, ``source``, ``update_contract``) is held
  to the reader's rules (``trace/metarules.py``) at the call: lone surrogates escaped, values too
  deep or too big left out, one warning each: what is written always reads.
- One writer per trace: a second recorder on a path another one (any process) writes is refused.
- Accounting: every record a ``log`` call hands over is written or counted in ``dropped`` (by name)
  and ``dropped_reasons`` (queue full, closed, abandoned, unrecordable), also calls racing
  ``close``. Strict mode (``strict=True`` or ``TRACEDIFF_STRICT=1``), for people writing an
  integration, raises misuse (unrecordable tensors included) in the caller instead.

Every ``log`` call, recorded or filtered out, also teaches the writer its (request, position,
token_id) keys: the trace's token table (``__tokens__`` records) knows every request's tokens.

This module is the host API (``Recorder``, ``record``); its other parts: ``queue.py`` (the bounded
queue, drop accounting), ``writer_thread.py`` (the writer thread), ``exit_fence.py`` (interpreter
exit and forks), ``meta.py`` (run metadata, rank and world size).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from tracediff.record.copies import HostCopy, host_bytes, is_torch_tensor, tag_of_tensor, unrecordable
from tracediff.record.exit_fence import RECORDERS, WRITERS
from tracediff.record.filters import RecordFilter
from tracediff.record.meta import rank_and_world, rank_path, run_meta, storable
from tracediff.record.pathlock import TraceLock
from tracediff.record.queue import (
    ABANDONED,
    CLOSED,
    RECORD_OVERHEAD,
    ROW_BYTES,
    STOPPED,
    Learn,
    Pending,
    QueueAccounting,
)
from tracediff.record.rowkeys import LogRowKeys, RowContext, resolve_keys, resolve_rows, sequence_keys
from tracediff.record.tokens import TokenBook
from tracediff.record.writer_thread import WriterThread
from tracediff.trace.metarules import MAX_META_BYTES, clean_text, clean_tree, valid_text
from tracediff.trace.schema import RESERVED_PREFIX, dumps_meta
from tracediff.trace.writer import TraceWriter, format_for, open_writer

logger = logging.getLogger("tracediff")
# What a call's own arguments raise (a name, keys that do not fit the tensor, a value out of range):
# that call's record is dropped and counted; any other exception is a recorder failure and stops it.
BAD_CALL = (ValueError, TypeError, OverflowError, IndexError, KeyError)

MiB = 1 << 20
_SERIALS = itertools.count(1)
INT64 = (-(1 << 63), (1 << 63) - 1)  # what a record's step and depth columns hold
CLOSE_TIMEOUT = 15.0  # seconds close() and interpreter exit wait for a busy writer, by default
ABANDON_GRACE = 2.0  # seconds an abandoned writer has to stop at its next write
STRICT_ENV = "TRACEDIFF_STRICT"


class Recorder(QueueAccounting, WriterThread):
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
        importer: bool = False,
        say_gaps: bool = True,
    ) -> None:
        if on_full not in ("drop", "block"):
            raise ValueError(f"on_full must be 'drop' or 'block', got {on_full!r}")
        for option, value in (("queue_bytes", queue_bytes), ("max_bytes", max_bytes)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0) and \
                    (value is not None or option == "queue_bytes"):
                raise ValueError(f"{option} must be a number of bytes above 0, got {value!r}")
        self.filter = RecordFilter.build(names, exclude, every, requests)
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.path = rank_path(Path(path), self.rank, per_rank=rank is not None or self.world_size > 1)
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
        self.dropped_by: Counter[tuple[str, str]] = Counter()  # the same records, by (name, reason)
        # producer -> {"names": globs it means to record, "stopped": why or None, "step": int or None}
        self.producers: dict[str, dict] = {}
        self.stopped: str | None = None
        self.importer = importer  # a tool's recorder: no disk room kept free, and its caller reports stops
        self.say_gaps = say_gaps  # False: the caller says what the trace lacks (``tracediff record``)
        self._final_written: dict | None = None  # the end-of-run metadata the writer closed the file with
        self.failure: BaseException | None = None
        self.records_written = 0
        self.bytes_written = 0
        self._contract_updates: dict = {}
        self._shared_ctx = RowContext()  # set_context outside any context block: every thread's
        self._local = threading.local()  # .ctx: a context block's keys, this thread's alone
        self._seq = itertools.count()
        self._admitted = 0
        self._queued = 0
        self._queue: deque[Pending | Learn] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._sealed = False  # the writer takes nothing more from the queue: log counts what comes
        self._abandoned = False  # close gave up waiting: the writer stops at its next write
        self._warned_refused = False
        self._warned_bad_call = False
        self._flush_requests = 0  # flush() asks the writer to write now without waiting for the interval
        self._flush_done = 0  # the last request the writer has honoured
        self._active = False
        self._static_once: set[str] = set()
        self._book = TokenBook(max(1 << 20, queue_bytes // 8))
        self._token_queued = 0  # bytes of row keys queued for the book (bounded apart from tensors)
        self._token_limit = queue_bytes // 16
        self._record_limit = queue_bytes - self._token_limit
        self.token_calls_dropped = 0  # calls whose keys were not learned: the book's queue was full
        self._names_ok: set[str] = set()  # names a keyed log call checked already
        self._serial = next(_SERIALS)  # told apart from every other recorder of the process, ever
        self._last_learned: tuple | None = None  # (token_ids, positions, request, mask, step) last learned
        self._strict_layouts: dict[str, tuple] = {}  # host side, strict mode only
        self._layouts: dict[str, tuple] = {}  # writer side: (static, dtype, row shape) first seen per name
        self._mixed: set[str] = set()
        self._thread: threading.Thread | None = None
        self._writer: TraceWriter | None = None
        self._io = threading.Lock()  # held by the writer thread inside each call into the file
        self._lock = TraceLock(self.path)
        if not enabled:
            return
        try:
            format_for(self.path, format)
            if not self.path.parent.is_dir():
                raise FileNotFoundError(f"output directory {self.path.parent} does not exist")
            contract = storable(meta or {}, self.strict, self.path)
            opening = run_meta(source if isinstance(source, str) else str(source), contract, self.rank,
                               self.world_size, self.filter)
            opening, cleaned = clean_tree(opening)  # source, filters, host names: what a reader takes
            if cleaned:
                logger.warning("tracediff: run metadata for %s holds strings that are not valid Unicode "
                               "(lone surrogates): written with them escaped (\\udcXX)", self.path)
            if len(dumps_meta(opening)) > MAX_META_BYTES:
                logger.warning("tracediff: run metadata for %s is more than a trace may hold: its contract "
                               "is left out", self.path)
                opening["contract"] = {}
            dumps_meta(opening)
            if not self._lock.acquire():
                raise RuntimeError(f"another recorder is writing {self.path}: two writers would corrupt it")
            _check_target(self.path)
            self._writer = open_writer(self.path, opening, format, compression)
        except Exception as exc:  # a recorder that cannot start must not stop the host
            self._lock.release()
            if self.strict:
                raise
            self._fail("open", exc)
            return
        self._active = True
        thread = threading.Thread(target=self._write_loop, name="tracediff-writer", daemon=True)
        WRITERS.add(thread, self._io)
        try:
            thread.start()
        except Exception as exc:  # no thread to be had (limits, shutdown): a trace that says why
            WRITERS.remove(thread)
            self._fail("start", exc)
            self._finish()
            self._lock.release()
            if self.strict:
                raise
            return
        self._thread = thread
        RECORDERS.add(self)
        atexit.register(self.close)

    # ---- the host-facing API -------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while records are being written (False once disabled, failed, stopped or closed)."""
        return self._active

    @property
    def writer_thread(self) -> threading.Thread | None:
        """The thread that writes the file (None when the recorder never started one)."""
        return self._thread

    def log(self, name: str, tensor: Any, *, step: int | None = None, request: Any = None,
            positions: Any = None, token_ids: Any = None, depth: int | None = None,
            attention_mask: Any = None, keys: LogRowKeys | None = None) -> None:
        """Record a per-token tensor. Omitted keys come from the current context; ``attention_mask``
        (shaped like token_ids, 0 = padding) gives padded rows position -1. ``keys`` (from
        ``row_keys``) instead of token_ids / positions / request / attention_mask: rows keyed once
        for every tensor cut along them."""
        if not self._active:
            self._drop_inactive(name)
            return
        try:
            if keys is not None:
                self._log_keyed(name, tensor, step, depth, keys,
                                (request, positions, token_ids, attention_mask))
                return
            self._log(name, tensor, step, request, positions, token_ids, depth, attention_mask)
        except BAD_CALL as exc:
            if self.strict:
                raise
            self._refuse_call(name, "log", exc)
        except Exception as exc:
            if self.strict:
                raise
            self._fail(f"log({name!r})", exc)

    def row_keys(self, token_ids: Any, *, step: int | None = None, request: Any = None,
                 positions: Any = None, attention_mask: Any = None) -> LogRowKeys:
        """Row keys checked once, for several ``log(name, tensor, keys=...)`` calls whose tensors share
        their rows (an integration logging a dozen tensors of one forward): each of those calls then
        costs the host no key work. ``step`` is their records' step where ``log`` gives none. Keys
        that do not check out are returned refused: every record cut along them is dropped and
        counted (strict mode raises here)."""
        try:
            step = self._ctx.step if step is None else _checked_step(step)
            keys = resolve_keys(step, token_ids, positions, request, attention_mask)
        except BAD_CALL as exc:
            if self.strict:
                raise
            self._warn_bad_call("row_keys", exc)
            return _refused_keys(f"invalid row_keys call: {type(exc).__name__}")
        except Exception as exc:  # anything else: a recorder failure, as in log
            if self.strict:
                raise
            self._fail("row_keys", exc)
            return _refused_keys(STOPPED)
        if not _valid_requests(keys):
            if self.strict:
                raise ValueError(f"request id {request!r} is not valid Unicode (a lone surrogate)")
            why = "a request id that is not valid Unicode"
            self._warn_refused("records cut along these row keys", why)
            return replace(keys, step=step, refused=f"unrecordable: {why}")
        return replace(keys, step=step)

    def log_static(self, name: str, tensor: Any, *, step: int | None = None, once: bool = False) -> None:
        """Record a tensor without a token axis (a weight, d2t, a config tensor); with ``once``, only
        the first call for a name records (for callers that run every step)."""
        if not self._active:
            self._drop_inactive(name)
            return
        try:
            _check_name(name)
            if once and name in self._static_once:
                return
            if once:
                self._static_once.add(name)
            if not valid_text(name):
                self._refuse_text(name, "a name")
                return
            step = self._ctx.step if step is None else _checked_step(step)
            if self.filter.keep_name(name) and (tensor := self._array(name, tensor)) is not None:
                if self.strict:
                    self._check_layout(name, (True, tag_of_tensor(tensor), None))
                self._submit(name, tensor, step, 0, None, None)
        except BAD_CALL as exc:
            if self.strict:
                raise
            self._refuse_call(name, "log_static", exc)
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
            keys = sequence_keys(request, token_ids, start)
            if not _valid_requests(keys):
                if self.strict:
                    raise ValueError(f"request id {request!r} is not valid Unicode (a lone surrogate)")
                self.token_calls_dropped += 1
                return
            self._learn(keys, None, declared=True)
        except BAD_CALL as exc:
            if self.strict:
                raise
            self.token_calls_dropped += 1
            self._warn_bad_call("request_tokens", exc)
        except Exception as exc:
            if self.strict:
                raise
            self._fail(f"request_tokens({request!r})", exc)

    def set_context(self, **fields: Any) -> None:
        """Set row keys (step, depth, request, positions, token_ids, attention_mask) for hooks and
        later logs. New token_ids drop the positions and mask of the old ones unless given too."""
        updated = replace(self._ctx, **_context_fields(fields))
        if getattr(self._local, "ctx", None) is not None:  # inside this thread's context block
            self._local.ctx = updated
        else:
            self._shared_ctx = updated

    @contextmanager
    def context(self, **fields: Any) -> Iterator[None]:
        """Row keys for the duration of a block (e.g. one forward pass), then the old ones. A block's
        keys are its thread's: threads recording at once each keep their own."""
        saved = getattr(self._local, "ctx", None)
        self._local.ctx = replace(self._ctx, **_context_fields(fields))
        try:
            yield
        finally:
            self._local.ctx = saved

    @property
    def _ctx(self) -> RowContext:
        """The row keys a log call of this thread takes by default."""
        own = getattr(self._local, "ctx", None)
        return own if own is not None else self._shared_ctx

    def update_contract(self, **values: Any) -> None:
        """Add contract metadata learned during the run (e.g. resolved aux ids); written at close.
        Arrays and tensors become lists; a value JSON cannot hold (NaN, an object) is left out with
        a warning (raised in strict mode), so that it cannot cost the trace its final metadata."""
        self._contract_updates.update(storable(values, self.strict, self.path, taken=self._contract_updates))

    def attach_producer(self, producer: str, names: Iterable[str]) -> None:
        """A producer (an integration) says what it means to record: name globs. A trace that holds
        none of a name it attached, where the other side of a compare has it, is incomplete (written
        at close as ``producers``; docs/FORMAT.md). Never raises."""
        try:
            globs = {clean_text(str(n)) for n in ([names] if isinstance(names, str) else names)}
            with self._cv:
                said = self.producers.setdefault(clean_text(str(producer)), _new_producer())
                said["names"] = sorted({*said["names"], *globs})
        except Exception as exc:  # a producer's bad argument must not cost the host anything
            logger.warning("tracediff: attach_producer(%r) ignored (%s: %s)", producer, type(exc).__name__,
                           exc)

    def stop_producer(self, producer: str, why: str, step: int | None = None) -> None:
        """A producer stopped capturing (it logs its own warning and detaches its hooks; the recorder
        goes on with the rest): written at close, so that compare calls the trace incomplete and says
        who stopped, why and after which step. The first stop of a producer is kept. Never raises."""
        try:
            with self._cv:
                said = self.producers.setdefault(clean_text(str(producer)), _new_producer())
                if said["stopped"] is None:
                    said["stopped"] = clean_text(str(why)) or "stopped"
                    said["step"] = step if isinstance(step, int) and not isinstance(step, bool) else None
        except Exception as exc:
            logger.warning("tracediff: stop_producer(%r) ignored (%s: %s)", producer, type(exc).__name__, exc)

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
            self._say_gaps()
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

    def _say_gaps(self) -> None:
        """One stderr line at close when the trace holds less than the host logged (drops, a stop);
        nothing when it is complete. Never raises."""
        if self.importer or not self.say_gaps:
            return
        try:
            from tracediff.text import safe
            from tracediff.trace.completeness import completeness, summary

            with self._cv:  # the trace as its writer closed it (calls racing the close came later)
                final = self._final_written or {
                    "dropped_by": self._dropped_by_name(), "stopped": self.stopped,
                    "queue": {"bytes": self.queue_bytes, "on_full": self.on_full},
                    "producers": {k: dict(v) for k, v in self.producers.items()}}
            gaps = completeness({}, [final], dict(self._contract_updates), None).gaps
            if gaps:
                print(safe(f"tracediff: {self.path}: {summary(gaps, str(self.path))}"), file=sys.stderr)
        except Exception as exc:
            logger.debug("tracediff: could not say what %s lacks (%s)", self.path, exc)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _log(self, name: str, tensor: Any, step: int | None, request: Any, positions: Any, token_ids: Any,
             depth: int | None, attention_mask: Any) -> None:
        ctx = self._ctx
        _check_name(name)
        if not valid_text(name):
            self._refuse_text(name, "a name")
            return
        depth = _checked_depth(depth)
        step = ctx.step if step is None else _checked_step(step)
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
                keys = resolve_keys(step, token_ids, positions, request, attention_mask)
                if _valid_requests(keys):
                    self._learn(keys, seen)
            return
        tensor = self._array(name, tensor)
        if tensor is None:
            return
        keys = resolve_rows(tuple(tensor.shape), step, token_ids, positions, request, attention_mask)
        if not _valid_requests(keys):
            self._refuse_text(name, "a request id")
            return
        if self.strict:
            self._check_layout(name, (False, tag_of_tensor(tensor), tuple(tensor.shape[keys.lead_ndim:])))
        if not learned:
            self._learn(keys, seen)
        mask = None if self.filter.requests is None else self.filter.row_mask(keys.requests())
        if mask is not None and not mask.any():
            return
        self._submit(name, tensor, step, ctx.depth if depth is None else depth, keys, mask)

    def _log_keyed(self, name: str, tensor: Any, step: int | None, depth: int | None, keys: LogRowKeys,
                   given: tuple) -> None:
        """``log`` with keys from ``row_keys``: only what is this tensor's own is checked."""
        if given != (None, None, None, None):
            raise ValueError("log takes keys= or request / positions / token_ids / attention_mask, not both")
        if not isinstance(keys, LogRowKeys):
            raise TypeError(f"keys= takes what row_keys returns, not {type(keys).__name__}")
        if name not in self._names_ok:  # a name is checked once
            _check_name(name)
            if not valid_text(name):
                self._refuse_text(name, "a name")
                return
            self._names_ok.add(name)
        depth = _checked_depth(depth)
        step = _checked_step(keys.step if step is None and keys.step is not None else
                             self._ctx.step if step is None else step)
        if not (self.filter.keep_name(name) and self.filter.keep_step(step)):
            if keys.refused is None and keys.learned_by != self._serial:  # filtered out: its keys
                self._learn(keys, None)                                   # still teach the token table
            return
        if keys.refused is not None:  # warned about by row_keys
            if self.strict:
                raise ValueError(f"{name}: its row keys were refused ({keys.refused})")
            self._drop(clean_text(name), keys.refused)
            return
        tensor = self._array(name, tensor)
        if tensor is None:
            return
        if tuple(tensor.shape[: keys.lead_ndim]) != keys.lead:
            raise ValueError(f"tensor leading dims {tuple(tensor.shape)} do not match its keys' rows "
                             f"{keys.lead}")
        if self.strict:
            self._check_layout(name, (False, tag_of_tensor(tensor), tuple(tensor.shape[keys.lead_ndim:])))
        if keys.learned_by != self._serial:
            self._learn(keys, None)
        mask = None if self.filter.requests is None else self.filter.row_mask(keys.requests())
        if mask is not None and not mask.any():
            return
        self._submit(name, tensor, step, self._ctx.depth if depth is None else depth, keys, mask)

    def _learn(self, keys: LogRowKeys, seen: tuple | None, declared: bool = False) -> None:
        """Hand row keys to the token book: queued for the writer thread, or at once in strict mode
        (where a conflict must raise in the caller)."""
        if self.strict:
            self._book.learn(*keys.expand(), declared=declared, strict=True)
        elif not self._queue_keys(keys, declared):
            return
        keys.learned_by = self._serial
        if seen is not None:  # what tells a buffer refilled in place, read once per learn
            self._last_learned = (*seen, _contents(*seen[:3]))

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

    def _submit(self, name: str, tensor: Any, step: int, depth: int, keys: LogRowKeys | None,
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
            self._drop(name, STOPPED)  # this record and every later one: counted, never written
            return
        key_bytes = 0 if keys is None else keys.n_rows * ROW_BYTES + keys.id_bytes()
        held = host_bytes(tensor) if getattr(tensor, "is_cuda", False) else nbytes
        cost = held + RECORD_OVERHEAD + key_bytes
        refused = self._reserve(cost)
        if refused is not None:
            self._drop(name, refused)
            return
        item = Pending(name, next(self._seq), int(step), int(depth), HostCopy(tensor), cost, keys, mask)
        with self._cv:
            if self._sealed:  # close() began and the writer took its last items meanwhile
                self._queued -= cost
                self._drop(name, CLOSED)
                return
            self._admitted += nbytes
            self._queue.append(item)
            if self._queued - self._token_queued >= self.flush_bytes:  # else it waits for the interval:
                self._cv.notify_all()  # waking the writer for each record costs the host its GIL

    def _drop_inactive(self, name: str) -> None:
        """A record logged while not recording: counted when recording was under way (a call
        racing close(), or after it; after a failure stopped the writer), not when it never began."""
        if self._thread is None:
            return
        if self._closing and self.stopped is None:
            self._drop(clean_text(str(name)), CLOSED)
        elif self.stopped is not None:  # after any stop (a failure, a full disk, the byte budget)
            self._drop(clean_text(str(name)), STOPPED)

    def _refuse_text(self, name: str, what: str) -> None:
        """A record whose name or request id holds a lone surrogate, which no trace can store."""
        if self.strict:
            raise ValueError(f"{clean_text(name)}: {what} that is not valid Unicode (a lone surrogate)")
        self._refuse(clean_text(name), f"{what} that is not valid Unicode")

    def _refuse_call(self, name: Any, call: str, exc: Exception) -> None:
        """A call whose arguments do not make a record (a bad name, keys that do not fit the tensor, a
        value out of range): that record is dropped and counted, the first such call warned about,
        and recording goes on (one bad value costs one record)."""
        self._drop(clean_text(str(name)), f"invalid {call} call: {type(exc).__name__}")
        self._warn_bad_call(call, exc)

    def _warn_bad_call(self, call: str, exc: Exception) -> None:
        if not self._warned_bad_call:
            self._warned_bad_call = True
            logger.warning("tracediff: a %s call to %s was not recorded (%s: %s); counted in dropped, "
                           "recording goes on", call, self.path, type(exc).__name__, exc)

    def _refuse(self, name: str, why: str) -> None:
        """A tensor no trace can hold: dropped and counted; the first one is warned about."""
        self._drop(name, f"unrecordable: {why}")
        self._warn_refused(name, why)

    def _warn_refused(self, name: str, why: str) -> None:
        if not self._warned_refused:
            self._warned_refused = True
            logger.warning("tracediff: %s not recorded to %s: a trace cannot hold a tensor with %s "
                           "(counted in dropped; recording goes on)", name, self.path, why)

    def forked(self) -> None:
        """In a forked child, which has none of its parent's threads: this recorder's writer stayed
        in the parent. Here it records nothing (a log call returns at once, instead of filling a
        queue no thread empties, then blocking on it), closes nothing at exit, and nothing this
        process does reaches the file the parent writes."""
        self._cv = threading.Condition()  # the parent's may be held by a thread that did not come along
        self._active, self._sealed, self._thread = False, True, None
        self._queue = deque()
        self.stopped = self.stopped or "forked: this recorder records in the parent process"
        atexit.unregister(self.close)
        self._lock.forked()
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
                if not self.importer:
                    logger.log(level, "tracediff: recording to %s stopped: %s", self.path, reason)
            self._active = False
            self._cv.notify_all()

    def _fail(self, where: str, exc: BaseException) -> None:
        with self._cv:
            if self.stopped is not None:
                return
            self.stopped = f"error in {where}: {type(exc).__name__}: {exc}"
            self.failure = exc
            self._active = False
            self._cv.notify_all()
        if not self.importer:
            logger.warning("tracediff: recording to %s stopped (%s); the host keeps running", self.path,
                           self.stopped)


def _new_producer() -> dict:
    return {"names": [], "stopped": None, "step": None}


def _check_target(path: Path) -> None:
    """What ``record(path)`` may write: a new or empty file, or a regular file it replaces (said
    once); never through a symbolic link (dangling or not), nor a device, FIFO or directory
    (InputError)."""
    from tracediff.trace.output import check_output

    check_output(path, (), force=True)  # the writers' rule: only a regular file is ever replaced
    if os.path.lexists(path) and os.path.getsize(path) > 0:  # empty (tracediff record's claim): nothing lost
        logger.warning("tracediff: %s exists: the new recording replaces it", path)


def _check_name(name: str) -> None:
    """Names starting with ``__`` belong to the trace format (its token table, index, final
    metadata): a tensor under one would corrupt the trace. A NUL character could never be selected
    again (numpy strings drop trailing NULs): readers refuse such names."""
    if not isinstance(name, str):
        raise TypeError(f"a tensor name is text (str), not {type(name).__name__}")
    if not name or name.startswith(RESERVED_PREFIX):
        raise ValueError(f"tensor name {name!r} is reserved or empty (names starting with "
                         f"{RESERVED_PREFIX!r} belong to the trace format)")
    if "\x00" in name:
        raise ValueError(f"tensor name {name!r} holds a NUL character")


def _valid_requests(keys: LogRowKeys) -> bool:
    """Whether every request id of a call is valid Unicode (one per call or batch row: cheap)."""
    ids = keys.request_ids
    return all(valid_text(r) for r in (set(ids.tolist()) if len(ids) > 8 else ids))


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


def _checked_step(step: Any) -> int:
    """A record's step: a whole number a trace's step column holds (a float, even 3.0, is refused:
    ``every`` would filter it by its fraction)."""
    whole = isinstance(step, (int, np.integer)) and not isinstance(step, bool)
    if not whole or not INT64[0] <= int(step) <= INT64[1]:
        raise ValueError(f"step must be a whole number within int64, got {step!r}")
    return int(step)


def _checked_depth(depth: Any) -> int | None:
    if depth is None:
        return None
    whole = isinstance(depth, (int, np.integer)) and not isinstance(depth, bool)
    if not whole or not 0 <= int(depth) <= INT64[1]:
        raise ValueError(f"depth must be a whole number >= 0 (0: rows fed by the target), got {depth!r}")
    return int(depth)


def _refused_keys(why: str) -> LogRowKeys:
    """Keys no record may be cut along (``row_keys`` given arguments that do not make keys)."""
    empty = np.zeros(0, dtype=np.int64)
    return LogRowKeys(n_rows=0, lead_ndim=1, batch=1, request_ids=np.zeros(0, dtype=object), position=None,
                      token_id=empty, refused=why)


def _same_keys(seen: tuple, last: tuple | None) -> bool:
    """The very same key objects, holding the same values, and step as the last learned call: hooks
    of one forward share the context's, so their keys are learned once (a buffer refilled in place
    between two calls is learned again)."""
    return last is not None and seen[4] == last[4] and all(a is b for a, b in zip(seen[:4], last[:4])) \
        and _contents(*seen[:3]) == last[5]  # read only where the very same objects come again


def _contents(*keys: Any) -> tuple:
    """What tells a key object refilled in place from itself: a torch tensor's version counter (every
    in-place write bumps it), a small numpy array's bytes (a large one is taken as unchanged)."""
    return tuple(_version(x) if is_torch_tensor(x) else
                 x.tobytes() if isinstance(x, np.ndarray) and x.nbytes <= 1 << 16 else None for x in keys)


def _version(tensor: Any) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor keeps no version counter: taken as unchanged
        return None


def _describe(layout: tuple) -> str:
    static, dtype, row_shape = layout
    return f"static {dtype}" if static else f"{dtype} rows of shape {row_shape}"
