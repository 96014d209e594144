"""Inside every process ``tracediff record`` runs: start-up, the per-process recorder, forks, signals and
the import watcher.

The launcher puts ``tracediff/record/startup`` first on the child's PYTHONPATH; its ``sitecustomize``
calls ``startup()`` in every Python process of the child tree. ``startup()`` reads ``LaunchConfig``
from ``TRACEDIFF_LAUNCH`` and calls each plugin's ``at_startup(config, recorder)``.

``recorder`` is the per-process factory: the first call opens this process's file, later calls
return the same Recorder, so a process that never records writes nothing. A file is claimed with an
exclusive create, so two processes never clobber each other: the one that would take a path already
taken (two processes of one rank, e.g. a server's helper processes) writes ``NAME.pid{PID}.EXT``
instead, and the launcher lists every file written. Recorders close at interpreter exit, waiting at
most ``CLOSE_TIMEOUT`` seconds for their writer (a Ctrl-C meanwhile does not cut the close short,
nor print a traceback); a multiprocessing child closes in multiprocessing's own exit handlers,
which run before its ``os._exit``; on SIGTERM (where the default action was in place) a recording
process closes its file first, then dies of the signal as it would have. Processes that never
record keep their signal handling untouched.

A forked child starts with no recorder of its own: the parent's (its file, queue and writer thread,
which does not survive a fork) stays the parent's, and the child's descriptors of the parent's file
are pointed at a scratch file, so that nothing the child does, down to HDF5 flushing its metadata
when the library shuts down, can write into the parent's trace. The child's first record opens its
own file. Only a bare ``os.fork()`` child that ends with ``os._exit()`` leaves its file unclosed
(readable up to its last flush; the launcher's summary says so).

Only the standard library is imported here: ``startup()`` runs in every Python process of the tree.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

from tracediff.record.plugin import ENV, LaunchConfig

if TYPE_CHECKING:
    from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")

CLOSE_TIMEOUT = 15.0  # seconds a recorder may take to close at exit or on SIGTERM


class _ProcessRecorder:
    """The per-process recorder factory handed to plugins (see the module docstring)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.rec: Recorder | None = None
        self._lock = threading.Lock()

    def __call__(self, rank: int | None = None, world_size: int | None = None, **options: Any) -> Recorder:
        if self.rec is not None:
            return self.rec
        with self._lock:
            if self.rec is None:
                self.rec = self._open(rank, world_size, options)
        return self.rec

    def _open(self, rank: int | None, world_size: int | None, options: dict) -> Recorder:
        from tracediff.record.meta import rank_and_world
        from tracediff.record.recorder import Recorder

        cfg = self.config
        rank, world = rank_and_world(rank, world_size)
        base = Path(cfg.out)
        per_rank = world > 1
        gate = cfg.requests is not None or cfg.match_prefix is not None  # some requests only
        meta = {"launch_plugins": list(cfg.plugins), **({"request_gate": True} if gate else {}),
                **options.pop("meta", {})}
        queue = {} if cfg.queue_bytes is None else {"queue_bytes": cfg.queue_bytes}
        kwargs = dict(names=list(cfg.names) or None, exclude=list(cfg.exclude) or None, every=cfg.every,
                      rank=rank if per_rank else None, world_size=world, meta=meta,
                      say_gaps=False,  # tracediff record says it of every file it wrote
                      **{"on_full": cfg.on_full, **queue, **options})
        for candidate in (base, base.with_name(f"{base.stem}.pid{os.getpid()}{base.suffix}")):
            path = candidate.with_name(f"{candidate.stem}.rank{rank}{candidate.suffix}") if per_rank \
                else candidate
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                continue
            except OSError as exc:
                logger.warning("tracediff: cannot create %s (%s); this process records nothing", path, exc)
                return Recorder(path, enabled=False)
            try:
                rec = Recorder(candidate, **kwargs)
            except Exception as exc:  # e.g. options a plugin got wrong: never an error in the host
                logger.warning("tracediff: cannot record to %s (%s: %s)", path, type(exc).__name__, exc)
                rec = Recorder(path, enabled=False)
            if not rec.active:  # it could not open the file it claimed: leave no empty file behind
                _unlink_if_empty(path)
            atexit.unregister(rec.close)
            atexit.unregister(self.close_at_exit)  # registered once, also after a fork
            atexit.register(self.close_at_exit)
            # runs just before it (exit handlers run last first): SIGINT ignored by a call with no
            # Python frame of its own, since a Ctrl-C raised on entering close_at_exit skipped it
            from tracediff.record.exit_fence import IGNORE_SIGINT

            atexit.unregister(IGNORE_SIGINT)
            atexit.register(IGNORE_SIGINT)
            _close_before_os_exit(self)
            if _started is self:  # the process's own factory, not one a test or tool made
                _close_on_sigterm(self)
            return rec
        logger.warning("tracediff: %s is taken; this process records nothing", base)
        return Recorder(base, enabled=False)

    def close(self, timeout: float = CLOSE_TIMEOUT, keep_sigint_held: bool = False) -> None:
        """Close this process's file, waiting at most ``timeout`` seconds for its writer, also for a
        close already under way (atexit, then a SIGTERM). A Ctrl-C meanwhile does not cut the close
        short: it is raised once the file is closed (held off for good with ``keep_sigint_held``)."""
        rec = self.rec
        if rec is None:
            return
        deadline = time.monotonic() + timeout
        with _sigint_held(restore=not keep_sigint_held):
            try:
                rec.close(timeout)  # returns at once when a close is already under way: wait for that one
                writer = rec.writer_thread
                if writer is not None and writer is not threading.current_thread():
                    writer.join(max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:  # a SIGINT handler we could not hold off: leave quietly
                pass
            except Exception as exc:
                logger.warning("tracediff: closing %s failed (%s: %s)", rec.path, type(exc).__name__, exc)

    def close_at_exit(self) -> None:
        """``close()`` as an exit handler: SIGINT stays held off after it, since the exit handlers that
        follow (the recorder's writer fence among them) are the process ending."""
        self.close(keep_sigint_held=True)

    def forked(self) -> None:
        """In a forked child (``os.register_at_fork``): leave the parent's recorder to the parent and
        record to a file of this process's own from its first record on."""
        inherited, self.rec = self.rec, None
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        if inherited is None:
            return
        atexit.unregister(inherited.close)
        _inherited.append(inherited)  # never closed here, never collected: that would write its file
        try:
            _shadow_descriptors(inherited.path)
        except Exception as exc:
            logger.warning("tracediff: could not detach %s from this forked process (%s: %s)",
                           inherited.path, type(exc).__name__, exc)


_inherited: list[Recorder] = []


def _shadow_descriptors(path: Path) -> None:
    """Point this process's descriptors of ``path`` at an unlinked scratch file: whatever a writer
    inherited by a fork still does (HDF5 flushes its metadata cache when the library shuts down at
    exit) then reaches no trace."""
    try:
        target = os.stat(path)
        names = os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd")
    except OSError:
        return
    scratch = -1
    try:
        for name in names:
            try:
                fd = int(name)
                info = os.fstat(fd)
            except (ValueError, OSError):
                continue
            if (info.st_dev, info.st_ino) != (target.st_dev, target.st_ino):
                continue
            if scratch < 0:
                scratch, scratch_path = tempfile.mkstemp(prefix="tracediff-inherited-")
                os.unlink(scratch_path)
            os.dup2(scratch, fd, inheritable=False)
    finally:
        if scratch >= 0:
            os.close(scratch)


def _close_before_os_exit(factory: _ProcessRecorder) -> None:
    """multiprocessing ends its children with ``os._exit``, which skips atexit, right after running
    its own exit finalizers: close there too (last, after the child's own children are joined)."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util.Finalize(None, factory.close, exitpriority=-100)


def _unlink_if_empty(path: Path) -> None:
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


_started: _ProcessRecorder | None = None


def startup() -> None:
    """Load the plugins named in TRACEDIFF_LAUNCH; never raises (one warning per failure)."""
    global _started
    text = os.environ.get(ENV)
    if not text or _started is not None:
        return
    try:
        config = LaunchConfig.from_env(text)
    except Exception as exc:
        logger.warning("tracediff: ignoring %s (%s: %s); nothing is recorded", ENV, type(exc).__name__, exc)
        return
    factory = _started = _ProcessRecorder(config)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=factory.forked)
    for name in config.plugins:
        try:
            importlib.import_module(name).at_startup(config, factory)
        except Exception as exc:
            logger.warning("tracediff: plugin %s failed to start (%s: %s); it records nothing", name,
                           type(exc).__name__, exc)


def _close_on_sigterm(factory: _ProcessRecorder) -> None:
    """Under the default SIGTERM action a process dies without running atexit: in a process that
    records (only there), close the trace first, then die of the signal as before. Set from the main
    thread only; a handler the host installs later replaces this one.

    The close runs in a thread of its own: the handler may have interrupted the host inside the
    recorder (holding the lock its writer needs) or inside a close under way, which must go on for
    the writer to finish. A second SIGTERM meanwhile kills at once."""
    try:
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            signal.signal(signum, signal.SIG_DFL)
            threading.Thread(target=_close_then_die, args=(factory, signum), name="tracediff-sigterm",
                             daemon=True).start()

        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass


def _close_then_die(factory: _ProcessRecorder, signum: int) -> None:
    try:
        factory.close()
    finally:
        os.kill(os.getpid(), signum)


@contextmanager
def _sigint_held(restore: bool = True) -> Iterator[None]:
    """In the main thread, a Python-level SIGINT handler (KeyboardInterrupt) is held off for the
    duration: a Ctrl-C must not cut a bounded close short, leaving the file unclosed and a traceback
    printed. With ``restore`` the host's handler is put back after, and a Ctrl-C that came meanwhile
    is delivered to it then (the host still stops as asked, with its trace closed); without it (the
    process is ending) Ctrl-C stays held off."""
    previous: Any = None
    arrived: list[int] = []
    try:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
            else:
                previous = None
    except (ValueError, OSError):
        previous = None
    try:
        yield
    finally:
        if previous is not None and restore:
            signal.signal(signal.SIGINT, previous)
            if arrived:
                signal.raise_signal(signal.SIGINT)


# ---- lazy attachment: run a callback once a module has been imported -------------------------------


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a watched module so that callbacks run right
    after the module executes (a plugin patches classes when their module loads, not before)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _fire(self.callbacks.pop(fullname, []), module)

        try:
            loader.exec_module = exec_module  # type: ignore[method-assign]
        except (AttributeError, TypeError):  # a loader that takes no attributes: leave it alone
            pass
        return spec


_watcher = _ImportWatcher()


def _fire(callbacks: list[Callable[[ModuleType], None]], module: ModuleType) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:
            logger.warning("tracediff: attaching to %s failed (%s: %s); not recorded", module.__name__,
                           type(exc).__name__, exc)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it already is, else right
    after its import finishes. Callback failures are logged, never raised into the importer."""
    module = sys.modules.get(name)
    if module is not None:
        _fire([callback], module)
        return
    _watcher.callbacks.setdefault(name, []).append(callback)
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)


__all__ = ["CLOSE_TIMEOUT", "startup", "when_imported"]
