"""The exceptions users see: a problem with a file they gave us (one line, exit 2 in the CLI); and
the did-you-mean such a line offers for a mistyped name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

CLOSEST = 3  # names a did-you-mean offers at most
CUTOFF = 0.6  # difflib's: a name less like the mistyped one is no guess
NEAR = 0.1  # offered beside the closest name: those about as close


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


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """"did you mean 'x', 'y' or 'z'?": the names closest to a mistyped ``name`` (difflib's ratio,
    closest first: at least ``CUTOFF``, and within ``NEAR`` of the closest, so that names sharing only
    a prefix with it are not offered beside the one it misspells), or '' when none is close."""
    scores = {n: difflib.SequenceMatcher(None, name, n).ratio() for n in set(names)}
    floor = max(CUTOFF, max(scores.values(), default=0.0) - NEAR)
    close = sorted((n for n, score in scores.items() if score >= floor), key=lambda n: (-scores[n], n))
    quoted = [repr(n) for n in close[:CLOSEST]]
    if not quoted:
        return ""
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"did you mean {listed}?"
