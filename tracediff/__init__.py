"""tracediff: record, replay and diff tensor traces of EAGLE-3 speculative decoding."""

import logging
from typing import Any

from tracediff.errors import InputError, TraceError
from tracediff.record.recorder import Recorder, record
from tracediff.report.text import DataOnly
from tracediff.trace import Record, Trace, open_trace
from tracediff.version import __version__

if not any(isinstance(f, DataOnly) for f in logging.getLogger("tracediff").filters):
    logging.getLogger("tracediff").addFilter(DataOnly())  # names in warnings print as data

# compare and its report load on first use: a recorder inside a training job never imports them.
_LAZY = {"compare": ("tracediff.diff.api", "compare"), "Report": ("tracediff.diff.results", "Report"),
         "explain": ("tracediff.eagle3.explain", "explain"),  # needs torch: it replays the draft
         "Explanation": ("tracediff.eagle3.explanation", "Explanation")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tracediff' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)


__all__ = ["Explanation", "InputError", "Record", "Recorder", "Report", "Trace", "TraceError", "__version__",
           "compare", "explain", "open_trace", "record"]
