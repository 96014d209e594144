"""A progress bar on stderr for long work, only when a person watches (stderr is a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tracediff.diff.differ import Progress


@contextmanager
def progress_bar(what: str, unit: str = "bytes") -> Iterator[Progress | None]:
    """A ``progress(done, total)`` callback drawing the ``unit`` done ("bytes", or a count such as
    "rows") and the ETA on stderr; None when stderr is not a TTY (pipes, CI logs and bug reports get
    no bar)."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    columns = [TextColumn(what), BarColumn(), count] + ([] if unit == "bytes" else [TextColumn(unit)])
    with Bar(*columns, TimeRemainingColumn(),
             console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
