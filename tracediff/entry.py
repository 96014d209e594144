"""The console entry point: the command line, with Ctrl-C at any moment an exit 130 without a traceback.

Kept apart from ``tracediff.cli`` on purpose: the imports at the top of cli.py (typer, rich, numpy
through the producers) take about a second, and a Ctrl-C during them raised ``KeyboardInterrupt``
before ``cli.main`` could handle anything. Here the imports themselves are inside the ``try``.
"""

from __future__ import annotations

import signal
import sys

from tracediff import interrupts  # a few lines, no imports of its own beyond the package

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command it interrupted


def main() -> None:
    interrupts.install()  # before anything slow: signals from here on are remembered
    try:
        try:
            from tracediff.cli import main as cli_main

            cli_main()
        finally:
            interrupts.check()  # one swallowed where Python could not raise it still ends in its code
    except KeyboardInterrupt:
        _interrupted(interrupts.exit_code())


def _interrupted(code: int = INTERRUPTED) -> None:
    """Exit 128 + the signal, quietly, however many more signals arrive while exiting."""
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # the exit itself is not to be interrupted
    except (ValueError, OSError):  # not the main thread: nothing to mask
        pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    raise SystemExit(code)


if __name__ == "__main__":
    main()
