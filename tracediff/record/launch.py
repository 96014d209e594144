"""``tracediff record -- CMD``: run a command with recording plugins loaded in each of its Python processes.

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
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

from tracediff.errors import InputError
from tracediff.jsonio import from_plain, to_plain
from tracediff.record.plugin import LaunchPlugin

if TYPE_CHECKING:
    from tracediff.record.recorder import Recorder

logger = logging.getLogger("tracediff")

ENV = "TRACEDIFF_LAUNCH"
STARTUP_DIR = Path(__file__).resolve().parent / "startup"
CLOSE_TIMEOUT = 15.0  # seconds a recorder may take to close at exit or on SIGTERM

RecorderFactory = Callable[..., "Recorder"]


@dataclass(frozen=True)
class LaunchConfig:
    """What ``tracediff record`` asks every process of the child tree to record."""

    out: str  # the --out path
    plugins: tuple[str, ...]  # modules with at_startup(config, recorder)
    watch: tuple[str, ...] = ()  # --watch module globs
    names: tuple[str, ...] = ()  # --names / --exclude globs, --every N: passed to the Recorder
    exclude: tuple[str, ...] = ()
    every: int = 1
    requests: int | None = None  # --requests N: record only the first N requests seen
    match_prefix: tuple[int, ...] | None = None  # --match-prefix 1,2,3: only requests whose tokens start so
    eager_only: bool = False  # --eager-only: a trace of the eager forwards alone is what is wanted
    queue_bytes: int | None = None  # --queue-bytes: each recorder's queue (None: the Recorder's default)
    on_full: str = "drop"  # --on-full: what a recorder does when its queue is full (drop or block)

    def to_env(self) -> str:
        return json.dumps(to_plain(self))

    @classmethod
    def from_env(cls, text: str) -> LaunchConfig:
        """The config ``to_env`` wrote (the same tracediff runs on both sides): ValueError for any other."""
        return from_plain(cls, json.loads(text))


@dataclass
class RequestGate:
    """--requests N and --match-prefix for plugins: admits the first N requests seen whose tokens
    start with the prefix; a request's answer never changes once given."""

    limit: int | None
    prefix: tuple[int, ...] | None
    admitted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    count: int = 0  # requests admitted so far (finished ones forgotten included)

    @classmethod
    def of(cls, config: LaunchConfig) -> RequestGate:
        return cls(config.requests, config.match_prefix)

    @property
    def active(self) -> bool:
        return self.limit is not None or self.prefix is not None

    def admit(self, request: str, tokens: Sequence[int] | None = None) -> bool:
        """Whether to record ``request``, decided at its first sight from its first tokens."""
        if request in self.admitted:
            return True
        if request in self.refused:
            return False
        ok = self.limit is None or self.count < self.limit
        if ok and self.prefix is not None:
            head = [int(t) for t in list(tokens or [])[: len(self.prefix)]]
            ok = head == list(self.prefix)
        (self.admitted if ok else self.refused).add(request)
        self.count += ok
        return ok

    def forget(self, request: str) -> None:
        """A finished request: its answer is no longer needed (the count of admitted ones stays)."""
        self.admitted.discard(request)
        self.refused.discard(request)


# ---- in the child: startup() and the per-process recorder -----------------------------------------


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


# ---- in the launcher: checks, the child process, what it wrote ---------------------------------------


@dataclass
class WrittenFile:
    path: Path
    records: int
    closed: bool
    row_keys: str | None = None  # the contract's: "step_position" / "mixed" where rows lack token ids
    lacking: str | None = None  # what it lacks of what was logged (completeness.summary); None: whole


@dataclass
class LaunchResult:
    exit_code: int
    files: list[WrittenFile]


def plugins_for(config: LaunchConfig, command: Sequence[str], extra: Sequence[str],
                producers: Sequence[LaunchPlugin]) -> tuple[str, ...]:
    """The plugins a run needs: those of the producers that claim it, then the --plugin ones."""
    found = [p.plugin for p in producers if p.claims(config, command)]
    return tuple(dict.fromkeys([*found, *extra]))


def check(config: LaunchConfig, command: Sequence[str], producers: Sequence[LaunchPlugin] = (),
          force: bool = False) -> None:
    """Everything that makes a launch pointless, as one InputError, before anything starts. Existing
    outputs (``existing_outputs``) are refused unless ``force``, and even then anything but a regular
    file (a link, dangling or not, a device, a FIFO, a directory)."""
    if not command:
        raise InputError("--", "no command to run: tracediff record --out run.h5 -- CMD ARGS...")
    from tracediff.trace.output import check_directory, check_output
    from tracediff.trace.storage import unwritable_suffix

    out = Path(config.out)
    if problem := unwritable_suffix(out):
        raise InputError(out, problem)
    check_directory(out)
    taken = existing_outputs(out)
    for path in taken:  # a link (dangling too), device, FIFO or directory: never, even with --force
        check_output(path, (), force=True)
    if taken and not force:
        raise InputError(taken[0], "already exists: choose another --out, or pass --force to replace it "
                                   "(a trace is never overwritten unasked)")
    if config.every < 1:
        raise InputError("--every", f"must be >= 1, got {config.every}")
    if any(not glob.strip() for glob in config.watch):
        raise InputError("--watch", "an empty module glob matches nothing: give e.g. 'model.layers.*'")
    if config.requests is not None and config.requests < 1:
        raise InputError("--requests", f"must be >= 1, got {config.requests}")
    for producer in producers:
        if producer.plugin in config.plugins and (refusal := producer.refuse(config, command)):
            raise InputError(command[0], refusal)
    for name in config.plugins:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise InputError(name, "no such plugin module (--plugin takes an importable module name)")
    if not config.plugins:
        known = ", ".join(p.name for p in producers) or "none given"
        raise InputError("--", "nothing would record: add --watch GLOB or --plugin MODULE (producers join "
                         f"by themselves when their command or option is given: {known})")


def existing_outputs(out: Path) -> list[Path]:
    """``out`` and the files a run writing to it would create (per rank, per process)."""
    pattern = re.compile(re.escape(out.stem) + r"(\.pid\d+)?(\.rank\d+)?" + re.escape(out.suffix) + "$")
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if pattern.match(p.name))


def child_env(config: LaunchConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for CMD: our sitecustomize first on PYTHONPATH, the config in TRACEDIFF_LAUNCH."""
    env = dict(os.environ if base is None else base)
    previous = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *([previous] if previous else [])])
    env[ENV] = config.to_env()
    return env


_FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGINT")


def run(config: LaunchConfig, command: Sequence[str], producers: Sequence[LaunchPlugin] = (),
        force: bool = False) -> LaunchResult:
    """Run CMD under ``config``; its exit status (128 + N when killed by signal N) and the trace
    files it wrote. ``--out`` is taken relative to the launcher's directory, whatever CMD's is.
    Signals reach the child once: a terminal's Ctrl-C already reaches it directly. With ``force``,
    the regular files a run would write over (``--out`` and its rank and process files) are removed
    first (the recording writes the trace in place as it runs: it cannot be staged)."""
    config = replace(config, out=os.path.abspath(config.out))
    check(config, command, producers, force)
    if force:
        for path in existing_outputs(Path(config.out)):
            try:
                path.unlink()
            except OSError as exc:
                raise InputError(path, f"cannot replace: {exc.strerror or exc}") from None
    terminals = _terminal_fds()
    try:
        try:
            child = subprocess.Popen(list(command), env=child_env(config))
        except OSError as exc:
            raise InputError(command[0], f"cannot run: {exc.strerror or exc}") from None
        code = _wait_forwarding(child, terminals)
    finally:
        for fd in terminals.opened:
            os.close(fd)
    return LaunchResult(exit_code=128 - code if code < 0 else code, files=written(Path(config.out)))


def _wait_forwarding(child: subprocess.Popen, terminals: _Terminals) -> int:
    """Wait for the child, passing it the signals the launcher gets (SIGINT only where the terminal
    did not already deliver it to the child's process group)."""
    saved = {}

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and terminals.deliver_sigint_to(child.pid):
            return
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for name in _FORWARDED:
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:  # nohup & co stay as set
            saved[signum] = signal.signal(signum, forward)
    try:
        return child.wait()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@dataclass
class _Terminals:
    """Descriptors of the launcher's terminal: fds 0-2 that are terminals and ``/dev/tty`` (the
    controlling terminal even when all three are redirected); ``opened``: the ones to close."""

    fds: list[int]
    opened: list[int]

    def deliver_sigint_to(self, pid: int) -> bool:
        """Whether Ctrl-C in the controlling terminal reaches ``pid``: the terminal sends it to its
        whole foreground process group, so when that is ``pid``'s group, ``pid`` has it already."""
        try:
            group = os.getpgid(pid)
        except OSError:  # gone: nothing to forward to
            return True
        for fd in self.fds:
            try:
                if os.tcgetpgrp(fd) == group:
                    return True
            except OSError:  # not our controlling terminal, or none
                continue
        return False


def _terminal_fds() -> _Terminals:
    fds = [fd for fd in (0, 1, 2) if _isatty(fd)]
    opened = []
    try:
        opened.append(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)))
    except OSError:  # no controlling terminal
        pass
    return _Terminals(fds + opened, opened)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def written(out: Path) -> list[WrittenFile]:
    """The trace files a run wrote, with their record counts."""
    from tracediff.trace.completeness import summary
    from tracediff.trace.reader import Trace

    files = []
    for path in existing_outputs(out):
        if path.stat().st_size == 0:  # claimed, never opened
            path.unlink()
            continue
        try:
            with Trace([path]) as trace:
                keys = trace.contract.get("row_keys")
                gaps = [g for g in trace.completeness.gaps if g.kind != "not_closed"]  # said apart
                files.append(WrittenFile(path, len(trace.index), trace.complete,
                                         keys if isinstance(keys, str) else None,
                                         summary(gaps, str(path)) if gaps else None))
        except Exception:  # unreadable (a writer killed mid-write): listed, never a traceback here
            files.append(WrittenFile(path, 0, False))
    return files


def nothing_recorded(config: LaunchConfig, producers: Sequence[LaunchPlugin] = (),
                     exit_code: int = 0) -> str:
    """Why a run may have written no file, most likely first: the command failed (its exit code), the
    filters it was given (by name), what its producers know to hide tensors."""
    failed = [f"the command failed (exit {exit_code}) before anything was recorded"] if exit_code else []
    filters = [*(f"--names {g}" for g in config.names), *(f"--exclude {g}" for g in config.exclude)]
    if config.requests is not None:
        filters.append(f"--requests {config.requests}")
    if config.match_prefix is not None:
        filters.append("--match-prefix " + ",".join(map(str, config.match_prefix)))
    causes = failed + ([f"{' '.join(filters)} may have left out everything"] if filters else [])
    causes += [p.silent_hint for p in producers if p.plugin in config.plugins and p.silent_hint]
    causes.append("no plugin recorded a tensor, or the command's Python cannot import tracediff or ignores "
                  "PYTHONPATH (-E / -I)")
    return "nothing was recorded: " + "; or ".join(causes)


__all__ = ["CLOSE_TIMEOUT", "ENV", "LaunchConfig", "LaunchPlugin", "LaunchResult", "RecorderFactory",
           "RequestGate", "WrittenFile", "check", "child_env", "nothing_recorded", "plugins_for", "run",
           "startup", "when_imported", "written"]
