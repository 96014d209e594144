"""The trace model and its two physical formats (HDF5, Arrow IPC).

The names below load on first use (``tracediff/lazy.py``): a module that needs one small part (``dtypes``,
``schema``) does not pay for the reader's numpy and pyarrow, nor h5py."""

from tracediff.lazy import lazy

__getattr__ = lazy(__name__, {
    "MixedRecords": ".reader", "TensorRows": ".reader", "TokenTable": ".reader", "Trace": ".reader",
    "open_trace": ".reader", "FORMAT_VERSION": ".schema", "Record": ".schema",
    "RecordIndex": ".schema", "open_writer": ".writer"})

__all__ = ["FORMAT_VERSION", "MixedRecords", "Record", "RecordIndex", "TensorRows",
           "TokenTable", "Trace", "open_trace", "open_writer"]
