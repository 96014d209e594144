"""The recorder: cheap ``log`` calls on the host's thread, all file work on one writer thread.

Rules it keeps for the host (training job or server): memory is bounded by ``queue_bytes``;
a full queue drops (and counts) or blocks for at most ``block_timeout``; any failure is logged
once, stops recording and never raises into the caller. Strict mode (``strict=True`` or
``TRACEDIFF_STRICT=1``), for people writing an integration, raises misuse in the caller instead.

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
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Iterator

import numpy as np

from tracediff.record.filters import RecordFilter
from tracediff.record.host import HostCopy, is_torch_tensor, tag_of_tensor
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
TOKEN_ROW_BYTES = 24  # what one row's keys cost while queued for the token book
STRICT_ENV = "TRACEDIFF_STRICT"


@dataclass
class _Pending:
    """A logged tensor waiting for the writer thread."""

    name: str
    seq_no: int
    step: int
    depth: int
    data: HostCopy
    nbytes: int
    keys: RowKeys | None  # None for a static record
    row_mask: np.ndarray | None


@dataclass
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
        self.flush_interval = flush_interval
        self.flush_bytes = min(flush_bytes, max(1, queue_bytes // 2))
        self.strict = _strict_from_env() if strict is None else bool(strict)
        self.dropped: Counter[str] = Counter()
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
        self._flush_requests = 0  # flush() asks the writer to write now without waiting for the interval
        self._flush_done = 0  # the last request the writer has honoured
        self._active = False
        self._static_once: set[str] = set()
        self._book = TokenBook()
        self._token_queued = 0  # bytes of row keys queued for the book (bounded apart from tensors)
        self._token_limit = max(MiB, queue_bytes // 16)
        self.token_calls_dropped = 0  # calls whose keys were not learned: the book's queue was full
        self._last_learned: tuple | None = None  # (token_ids, positions, request, mask, step) last learned
        self._strict_layouts: dict[str, tuple] = {}  # host side, strict mode only
        self._layouts: dict[str, tuple] = {}  # writer side: (static, dtype, row shape) first seen per name
        self._mixed: set[str] = set()
        self._thread: threading.Thread | None = None
        self._writer: TraceWriter | None = None
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
        self._thread = threading.Thread(target=self._write_loop, name="tracediff-writer", daemon=True)
        self._thread.start()
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
            return
        try:
            if once:
                self._static_once.add(name)
            _check_name(name)
            if self.filter.keep_name(name):
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

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, then the end-of-run metadata. Safe to call twice."""
        atexit.unregister(self.close)
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("tracediff: writer for %s did not finish within %.0fs", self.path, timeout)
        self._active = False

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
            nbytes = keys.n_rows * TOKEN_ROW_BYTES
            with self._cv:
                if self._token_queued + nbytes > self._token_limit and self._token_queued > 0:
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

    def _submit(self, name: str, tensor: Any, step: int, depth: int, keys: RowKeys | None,
                mask: np.ndarray | None) -> None:
        nbytes = int(tensor.nelement() * tensor.element_size()) if hasattr(tensor, "nelement") \
            else int(np.asarray(tensor).nbytes)
        if self.max_bytes is not None and self._admitted + nbytes > self.max_bytes:
            self._stop(f"byte budget of {self.max_bytes} reached")
            return
        if not self._reserve(nbytes):
            self.dropped[name] += 1
            return
        item = _Pending(name, next(self._seq), int(step), int(depth), HostCopy(tensor), nbytes, keys, mask)
        with self._cv:
            self._queue.append(item)
            self._cv.notify_all()

    def _reserve(self, nbytes: int) -> bool:
        """Room in the bounded queue for nbytes, waiting up to block_timeout if so configured."""
        with self._cv:
            if self._queued + nbytes > self.queue_bytes and self.on_full == "block":
                deadline = time.monotonic() + self.block_timeout
                while self._queued + nbytes > self.queue_bytes and self._active:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
            if self._queued + nbytes > self.queue_bytes and self._queued > 0:
                return False
            self._queued += nbytes
            self._admitted += nbytes
            return True

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
        pending: list[Record] = []
        pending_bytes = 0  # queue bytes held by what was taken and is not yet written
        deadline = time.monotonic() + self.flush_interval
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
                done = self._closing or self.stopped is not None
                flush_to = self._flush_requests
            try:
                pending_bytes += self._take(items, pending)
                now = time.monotonic()
                due = (done or flush_to > self._flush_done or now >= deadline
                       or pending_bytes >= self.flush_bytes)
                if due and (pending or pending_bytes or self._book.has_new()):
                    if not self._room_for(pending_bytes):
                        self._stop(f"disk nearly full: less than {pending_bytes + ROOM_MARGIN} bytes left",
                                   logging.WARNING)
                        self._release(pending_bytes + sum(i.nbytes for i in self._drain()))
                        pending, pending_bytes = [], 0
                        break
                    self._write(pending)
                    self._release(pending_bytes)
                    pending, pending_bytes = [], 0
                with self._cv:
                    self._flush_done = max(self._flush_done, flush_to)
                    self._cv.notify_all()
                if now >= deadline:
                    deadline = now + self.flush_interval
            except Exception as exc:
                self._fail("writer", exc)
                self._release(pending_bytes + sum(i.nbytes for i in self._drain()))
                pending, pending_bytes, done = [], 0, True
            if done:
                break
        self._finish()

    def _take(self, items: list[_Pending | _Learn], pending: list[Record]) -> int:
        """Materialize queued tensors into ``pending`` and teach the book queued keys; returns the
        queue bytes they held."""
        held, learn = 0, []
        for item in items:
            held += item.nbytes
            if isinstance(item, _Learn):
                learn.append(item)
            else:
                pending.append(self._materialize(item))
        if learn:
            self._learn_all(learn)
            with self._cv:
                self._token_queued -= sum(item.nbytes for item in learn)
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

    def _write(self, pending: list[Record]) -> None:
        """Write tensors, then the token table's new entries as one ``__tokens__`` record."""
        tokens = self._book.take_new()
        records = pending if tokens is None else [*pending, tokens_record(*tokens, rank=self.rank)]
        if records:
            assert self._writer is not None  # the writer thread starts only once the file is open
            self._writer.write(records)
        self.records_written += len(pending)
        self.bytes_written += sum(r.nbytes for r in pending)

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

    def _drain(self) -> list[_Pending | _Learn]:
        with self._cv:
            items = list(self._queue)
            self._queue.clear()
            return items

    def _release(self, nbytes: int) -> None:
        with self._cv:
            self._queued -= nbytes
            self._cv.notify_all()

    def _finish(self) -> None:
        """Close the file with the end-of-run metadata; after a write error, leave it as flushed."""
        if self._writer is None:
            return
        if (self.stopped or "").startswith("error in writer"):
            self._writer.abort()
            return
        final = {
            "closed": True,
            "records": self.records_written,
            "bytes": self.bytes_written,
            "dropped_records": sum(self.dropped.values()),
            "dropped": dict(self.dropped),
            "stopped": self.stopped,
            "contract": self._contract_updates,
            "tokens": self._book.written,
            "token_conflicts": self._book.conflicts,
            "token_calls_dropped": self.token_calls_dropped,
            "token_positions_ignored": self._book.out_of_range,
            "mixed_records": sorted(self._mixed),
        }
        try:
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
    metadata): a tensor under one would corrupt the trace."""
    if not isinstance(name, str) or not name or name.startswith(RESERVED_PREFIX):
        raise ValueError(f"tensor name {name!r} is reserved or empty (names starting with "
                         f"{RESERVED_PREFIX!r} belong to the trace format)")


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
        "rank": rank,
        "world_size": world_size,
        "filters": {"names": list(filt.names), "exclude": list(filt.exclude), "every": filt.every,
                    "requests": sorted(filt.requests) if filt.requests is not None else None},
        "contract": contract,
    }
