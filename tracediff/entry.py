"""The console entry point: the command line, with Ctrl-C at any moment an exit 130 without a traceback.

Kept apart from ``tracediff.cli`` on purpose: the imports at the top of cli.py (typer, rich, numpy
through the producers) take about a second, and a Ctrl-C during them raised ``KeyboardInterrupt``
before ``cli.main`` could handle anything. Here the imports themselves are inside the ``try``.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command it interrupted


def main() -> None:
    try:
        from tracediff.cli import main as cli_main

        cli_main()
    except KeyboardInterrupt:
        _interrupted()


def _interrupted() -> None:
    """Exit 130, quietly, however many more Ctrl-Cs arrive while exiting."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the exit itself is not to be interrupted
    except (ValueError, OSError):  # not the main thread: nothing to mask
        pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    raise SystemExit(INTERRUPTED)


if __name__ == "__main__":
    main()
