"""The recorder: cheap ``log`` calls on the host's thread, all file work on one writer thread.

Rules it keeps for the host (training job or server): memory is bounded by ``queue_bytes``;
a full queue drops (and counts) or blocks for at most ``block_timeout``; any failure is logged
once, stops recording and never raises into the caller.
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
from typing import Any, Iterable, Iterator

import numpy as np

try:
    import resource
except ImportError:  # not on Windows
    resource = None

from tracediff.record.filters import RecordFilter
from tracediff.record.host import HostCopy
from tracediff.record.rowkeys import RowContext, RowKeys, resolve_rows
from tracediff.trace.schema import FORMAT_NAME, FORMAT_VERSION, Record, dumps_meta
from tracediff.trace.writer import TraceWriter, format_for, open_writer

logger = logging.getLogger("tracediff")

MiB = 1 << 20
ROOM_MARGIN = 8 * MiB  # room kept free for the format's own metadata and a clean close


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
        self.dropped: Counter[str] = Counter()
        self.stopped: str | None = None
        self.records_written = 0
        self.bytes_written = 0
        self._contract_updates: dict = {}
        self._ctx = RowContext()
        self._seq = itertools.count()
        self._admitted = 0
        self._queued = 0
        self._queue: deque[_Pending] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._flush_now = False  # set by flush(): write what is pending without waiting for the interval
        self._active = False
        self._static_once: set[str] = set()
        self._thread: threading.Thread | None = None
        self._writer: TraceWriter | None = None
        if not enabled:
            return
        try:
            format_for(self.path, format)
            run_meta = _run_meta(source, meta or {}, self.rank, self.world_size, self.filter)
            dumps_meta(run_meta)
            self._writer = open_writer(self.path, run_meta, format, compression)
        except Exception as exc:  # a recorder that cannot start must not stop the host
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
            positions: Any = None, token_ids: Any = None, depth: int | None = None) -> None:
        """Record a per-token tensor. Omitted keys come from the current context."""
        if not self._active:
            return
        try:
            ctx = self._ctx
            step = ctx.step if step is None else step
            if not (self.filter.keep_name(name) and self.filter.keep_step(step)):
                return
            keys = resolve_rows(
                tuple(tensor.shape), step,
                ctx.token_ids if token_ids is None else token_ids,
                ctx.positions if positions is None and token_ids is None else positions,
                ctx.request if request is None else request,
            )
            mask = None if self.filter.requests is None else self.filter.row_mask(keys.requests())
            if mask is not None and not mask.any():
                return
            self._submit(name, tensor, step, ctx.depth if depth is None else depth, keys, mask)
        except Exception as exc:
            self._fail(f"log({name!r})", exc)

    def log_static(self, name: str, tensor: Any, *, step: int | None = None, once: bool = False) -> None:
        """Record a tensor without a token axis (a weight, d2t, a config tensor); with ``once``, only
        the first call for a name records (for callers that run every step)."""
        if not self._active or (once and name in self._static_once):
            return
        try:
            if once:
                self._static_once.add(name)
            if self.filter.keep_name(name):
                self._submit(name, tensor, self._ctx.step if step is None else step, 0, None, None)
        except Exception as exc:
            self._fail(f"log_static({name!r})", exc)

    def set_context(self, **fields: Any) -> None:
        """Set row keys (step, depth, request, positions, token_ids) for hooks and later logs."""
        self._ctx = replace(self._ctx, **fields)

    @contextmanager
    def context(self, **fields: Any) -> Iterator[None]:
        """Row keys for the duration of a block (e.g. one forward pass), then the old ones."""
        saved = self._ctx
        self._ctx = replace(saved, **fields)
        try:
            yield
        finally:
            self._ctx = saved

    def update_contract(self, **values: Any) -> None:
        """Add contract metadata learned during the run (e.g. resolved aux ids); written at close."""
        self._contract_updates.update(values)

    def watch(self, module: Any, output: str | None = None, *, input: str | None = None) -> Any:
        """Record a torch module's output (and/or first input) on every forward."""
        from tracediff.record.hooks import watch

        return watch(self, module, output=output, input=input)

    def watch_modules(self, root: Any, pattern: str, template: str) -> list[Any]:
        """Watch every submodule whose dotted name matches ``pattern`` (``*`` = one part)."""
        from tracediff.record.hooks import watch_modules

        return watch_modules(self, root, pattern, template)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything logged so far is written; False on timeout or when not active."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._flush_now = True
            self._cv.notify_all()
            while self._active and self._queued and time.monotonic() < deadline:
                self._cv.wait(0.01)
            return self._active and not self._queued

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
        pending_bytes = 0
        deadline = time.monotonic() + self.flush_interval
        while True:
            with self._cv:
                while not (self._queue or self._closing or self._flush_now or self.stopped):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                items = list(self._queue)
                self._queue.clear()
                done = self._closing or self.stopped is not None
                flush_now, self._flush_now = self._flush_now, False
            try:
                for item in items:
                    pending.append(self._materialize(item))
                    pending_bytes += item.nbytes
                now = time.monotonic()
                if pending and (done or flush_now or now >= deadline or pending_bytes >= self.flush_bytes):
                    if not self._room_for(pending_bytes):
                        self._stop(f"disk nearly full: less than {pending_bytes + ROOM_MARGIN} bytes left",
                                   logging.WARNING)
                        self._release(pending_bytes + sum(i.nbytes for i in self._drain()))
                        pending, pending_bytes = [], 0
                        break
                    self._writer.write(pending)
                    self.records_written += len(pending)
                    self.bytes_written += sum(r.nbytes for r in pending)
                    self._release(pending_bytes)
                    pending, pending_bytes = [], 0
                if now >= deadline:
                    deadline = now + self.flush_interval
            except Exception as exc:
                self._fail("writer", exc)
                self._release(pending_bytes + sum(i.nbytes for i in self._drain()))
                pending, pending_bytes, done = [], 0, True
            if done:
                break
        self._finish()

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

    def _drain(self) -> list[_Pending]:
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
        }
        try:
            self._writer.close(final)
        except Exception as exc:
            self._fail("close", exc)

    def _materialize(self, item: _Pending) -> Record:
        data = item.data.numpy()
        if item.keys is None:
            return Record(name=item.name, data=data, dtype=item.data.tag, seq_no=item.seq_no,
                          step=item.step, rank=self.rank, depth=item.depth, static=True)
        keys = item.keys
        data = data.reshape((keys.n_rows, *data.shape[keys.lead_ndim:]))
        position, token_id, request = keys.positions(), keys.token_ids(), keys.requests()
        if item.row_mask is not None:
            data, request = data[item.row_mask], request[item.row_mask]
            position, token_id = position[item.row_mask], token_id[item.row_mask]
        return Record(name=item.name, data=data, dtype=item.data.tag, seq_no=item.seq_no, step=item.step,
                      rank=self.rank, depth=item.depth, request=request, position=position,
                      token_id=token_id)


def record(path: str | Path, **options: Any) -> Recorder:
    """Start recording to ``path`` (.h5 or .arrow). Options: see ``Recorder``."""
    return Recorder(path, **options)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    dist = sys.modules.get("torch.distributed")
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else int(env_rank or 0)
    if world_size is None:
        world_size = dist.get_world_size() if initialized else int(env_world or 1)
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
