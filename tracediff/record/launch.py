"""``tracediff record -- CMD``: run a command with recording plugins loaded in each of its Python processes.

The launcher checks the run (``check``), starts CMD with ``tracediff/record/startup`` first on its
PYTHONPATH and the ``LaunchConfig`` in ``TRACEDIFF_LAUNCH`` (``child_env``), forwards signals to it, and
lists every file its processes wrote (``written``). What runs inside each of those processes is
``child.py``; what the three share is ``plugin.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from tracediff.errors import InputError
from tracediff.record.plugin import ENV, LaunchConfig, LaunchPlugin

logger = logging.getLogger("tracediff")

STARTUP_DIR = Path(__file__).resolve().parent / "startup"


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


__all__ = ["LaunchResult", "STARTUP_DIR", "WrittenFile", "check", "child_env", "existing_outputs",
           "nothing_recorded", "plugins_for", "run", "written"]
