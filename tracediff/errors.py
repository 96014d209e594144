"""The one exception type users see: a problem with a file they gave us."""

from __future__ import annotations

from pathlib import Path


class TraceError(Exception):
    """A trace file that cannot be read (missing, truncated, foreign, too new).

    The CLI prints it as one line, ``error: <file>: <what>``, and exits 2.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem
