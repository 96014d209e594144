"""The exceptions users see: a problem with a file they gave us (one line, exit 2 in the CLI)."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """A file the user gave that cannot be used; the CLI prints ``error: <file>: <what>``, exits 2."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class TraceError(InputError):
    """A trace file that cannot be read (missing, truncated, foreign, too new)."""


class CheckpointError(InputError):
    """A draft checkpoint that cannot be loaded (missing files or keys, wrong shapes)."""
