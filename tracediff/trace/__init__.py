"""The trace model and its two physical formats (HDF5, Arrow IPC)."""

from tracediff.trace.reader import MixedRecords, TensorRows, TokenTable, Trace, open_trace
from tracediff.trace.schema import CANONICAL_NAMES, FORMAT_VERSION, Record, RecordIndex
from tracediff.trace.writer import open_writer

__all__ = ["CANONICAL_NAMES", "FORMAT_VERSION", "MixedRecords", "Record", "RecordIndex", "TensorRows",
           "TokenTable", "Trace", "open_trace", "open_writer"]
