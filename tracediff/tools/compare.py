"""``tracediff.compare``: everything the ``compare`` command does, as one library call that returns
a typed ``Report`` (warm the page cache, read keys, plan, compare, diagnose, judge)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

from tracediff.diff.differ import Progress, compare_traces
from tracediff.diff.pair import Pair
from tracediff.diff.plan import CHUNK_BYTES, make_plan, tensor_keys
from tracediff.diff.results import Report
from tracediff.diff.tolerance import Tolerances
from tracediff.diff.verdict import MIN_COVERAGE, build_report
from tracediff.trace.reader import Trace, open_trace
from tracediff.trace.warm import warming

TraceLike = str | Path | Trace


def compare(a: TraceLike, b: TraceLike, *, tol: Tolerances | Iterable[str] | None = None,
            rename: dict[str, str] | None = None, align: str = "prefix", stop_at_first: bool = False,
            min_coverage: float = MIN_COVERAGE, chunk_bytes: int = CHUNK_BYTES,
            progress: Progress | None = None, warm: bool = True, same_target: bool = False,
            verify: bool = True) -> Report:
    """Compare trace ``b`` against baseline ``a`` (paths or open traces).

    ``tol``: a ``Tolerances`` or ``--tol`` strings; ``rename``: name in b -> name in a; ``align``:
    ``prefix`` (rows by token content) or ``step`` (same producer); ``min_coverage``: the share of
    comparable rows every tensor must align for a ``match``; ``progress(done, total)`` hears bytes
    compared; ``warm`` reads the files into the page cache meanwhile (not when stopping early);
    ``same_target``: the targets are the same model whatever target facts the contracts state
    (the report still lists them, marked declared); ``verify`` false reads without checking checksums.
    Raises ``InputError`` for unreadable traces, ValueError for bad options."""
    from tracediff.diff.diagnose import diagnose

    if isinstance(min_coverage, bool) or not isinstance(min_coverage, (int, float)) \
            or not 0 <= min_coverage <= 1:
        raise ValueError(f"min_coverage must be a number within 0..1, got {min_coverage!r}")
    if rename is not None and not isinstance(rename, dict):
        raise ValueError(f"rename must be a dict of name in b -> name in a, got {type(rename).__name__}")
    specs = [tol] if isinstance(tol, str) else tol
    tolerances = specs if isinstance(specs, Tolerances) else Tolerances.parse(list(specs or []))
    with ExitStack() as stack:  # the disk starts reading before the traces are opened and planned
        stack.enter_context(warming([a, b], enabled=warm and not stop_at_first))
        traces = Pair(*(t if isinstance(t, Trace) else stack.enter_context(open_trace(t, verify=verify))
                        for t in (a, b)))
        keys = traces.map(tensor_keys)  # small reads, done before the disk gets busy with tensor data
        plan = make_plan(traces, rename, align, chunk_bytes, keys)  # once, from key columns only
        comparison = compare_traces(traces, plan, tolerances, stop_at_first, progress)
        return build_report(comparison, diagnose(comparison, traces), traces, align, min_coverage,
                            same_target=same_target, renamed=rename, same_file=same_files(traces))


def same_files(traces: Pair[Trace]) -> bool:
    """Whether both sides read the same files, told by device and inode: another path to a file, or
    a hard link, is the same file."""
    try:
        files = traces.map(lambda t: {(s.st_dev, s.st_ino) for s in map(os.stat, t.paths)})
    except OSError:  # a file gone since it was read: not known to be the same
        return False
    return files.a == files.b
