"""Ctrl-C and SIGTERM in the command line: each becomes an exception where Python can raise one,
and is remembered, so that one raised where Python swallows it (a weakref callback, a __del__)
still stops the command: nothing is published after it and the exit code says so.

``install`` is called by the console entry point only (a library user's process keeps its own
handlers); ``check`` is called before an output is published and at the end of a command.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

received: int | None = None  # the first signal that arrived, once installed


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) as an exception: the same unwinding as Ctrl-C, another exit code."""


def _on_signal(signum: int, frame: Any) -> None:
    global received
    if received is None:
        received = signum
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _unraisable(hook: Any) -> Any:
    def quiet(unraisable: Any) -> None:  # an interrupt swallowed in a callback: remembered, not printed
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        hook(unraisable)

    return quiet


def install() -> None:
    """Handlers for SIGINT, SIGTERM and SIGHUP (the main thread only) and a quiet unraisable hook."""
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _on_signal)
    except (ValueError, OSError):  # not the main thread
        return
    sys.unraisablehook = _unraisable(sys.unraisablehook)


def exit_code() -> int:
    """128 + the signal that arrived (130 for Ctrl-C), as a shell reports it."""
    return 128 + (received if received is not None else signal.SIGINT)


def check() -> None:
    """Raise now if a signal arrived, even one whose exception was swallowed."""
    if received is not None:
        raise KeyboardInterrupt if received == signal.SIGINT else Terminated
