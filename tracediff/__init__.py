"""tracediff: record, replay and diff tensor traces of EAGLE-3 speculative decoding."""

__version__ = "0.1.0"

from tracediff.errors import TraceError  # noqa: E402
from tracediff.record.recorder import Recorder, record  # noqa: E402
from tracediff.trace import Record, Trace, open_trace  # noqa: E402

__all__ = ["Record", "Recorder", "Trace", "TraceError", "__version__", "open_trace", "record"]
