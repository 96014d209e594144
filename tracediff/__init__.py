"""tracediff: record, replay and diff tensor traces of EAGLE-3 speculative decoding.

Importing the package costs almost nothing: the recorder, the trace reader (numpy, pyarrow, h5py)
and compare load on first use (``tracediff/lazy.py``), so ``tracediff --help`` pays only for what
it touches."""

import importlib
import logging

from tracediff.errors import InputError, TraceError
from tracediff.lazy import lazy
from tracediff.text import DataOnly
from tracediff.version import __version__

# the subpackage first, then its name unbound: ``tracediff.record`` is the function (``__getattr__``)
importlib.import_module("tracediff.record")
globals().pop("record", None)

if not any(isinstance(f, DataOnly) for f in logging.getLogger("tracediff").filters):
    logging.getLogger("tracediff").addFilter(DataOnly())  # names in warnings print as data

__getattr__ = lazy(__name__, {
    "compare": "tracediff.tools.compare", "Report": "tracediff.diff.results",
    "replay": "tracediff.tools.replay", "ReplayReport": "tracediff.eagle3.replay",
    "doctor": "tracediff.tools.doctor", "DoctorReport": "tracediff.tools.doctor",
    "explain": "tracediff.tools.explain",  # needs torch: it replays the draft
    "Explanation": "tracediff.eagle3.explanation", "Recorder": "tracediff.record.recorder",
    "record": "tracediff.record.recorder", "Record": "tracediff.trace.schema",
    "Trace": "tracediff.trace.reader", "open_trace": "tracediff.trace.reader"})

__all__ = ["DoctorReport", "Explanation", "InputError", "Record", "Recorder", "ReplayReport", "Report",
           "Trace", "TraceError", "__version__", "compare", "doctor", "explain", "open_trace", "record",
           "replay"]
