"""What every importer shares: its Recorder is a tool's, not a host's (no disk room held back; it
writes until the disk refuses), and a recording that stopped short is one error line naming the
user's output path (never the hidden staging file), with the system's reason for a failed write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracediff.errors import InputError
from tracediff.trace.output import reason

RECORDER_OPTIONS: dict[str, Any] = dict(importer=True, on_full="block", block_timeout=600)


def check_written(rec: Any, target: Path) -> None:
    """Refuse a trace the recorder ``rec`` did not write whole, as an error about ``target``: a write
    the system refused (a full disk, the file size limit) gives its reason, as other writers say it."""
    failure = rec.failure
    if isinstance(failure, OSError) or (failure is not None and "errno" in str(failure)):
        raise InputError(target, f"cannot write: {reason(failure)}")
    if rec.stopped or sum(rec.dropped.values()):
        raise InputError(target, f"the trace was not written whole: {rec.stopped or dict(rec.dropped)}")
