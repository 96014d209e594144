"""Arrow IPC physical format: one Arrow row per record, raw tensor bytes in a binary column.

The file is an Arrow IPC *file* (readable by pyarrow, polars, duckdb). Its body is a plain IPC
stream after the 8-byte magic, so a writer killed before the footer leaves a readable stream;
the reader recovers every complete batch from it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from tracediff.errors import TraceError
from tracediff.trace.dtypes import storage_dtype
from tracediff.trace.fileio import pread_into, prefetch
from tracediff.trace.schema import (
    CLOSING_RECORDS,
    FINAL_RECORD,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_RECORD,
    Record,
    RecordIndex,
    check_version,
    dumps_meta,
)

SCHEMA = pa.schema(
    [
        ("name", pa.string()),
        ("seq_no", pa.int64()),
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("depth", pa.int32()),
        ("dtype", pa.string()),
        ("static", pa.bool_()),
        ("shape", pa.list_(pa.int64())),
        ("request", pa.list_(pa.string())),
        ("position", pa.list_(pa.int64())),
        ("token_id", pa.list_(pa.int64())),
        ("data", pa.large_binary()),
    ]
)
KEY_COLUMNS = ("name", "seq_no", "step", "rank", "depth", "dtype", "static", "shape")
# The closing __index__ row: every record's key columns plus the batch and row that hold it.
INDEX_SCHEMA = pa.schema([SCHEMA.field(k) for k in KEY_COLUMNS]
                         + [pa.field("batch", pa.int32()), pa.field("row", pa.int32())])
INDEX_COLUMNS = tuple(INDEX_SCHEMA.names)


def _list_array(parts: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.empty(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


def _binary_array(blobs: Sequence[np.ndarray]) -> pa.Array:
    """One large_binary array over the raw bytes: the blob itself when alone (zero-copy), else one
    concatenating copy (numpy releases the GIL for it)."""
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([b.nbytes for b in blobs], out=offsets[1:])
    if len(blobs) == 1:
        data = np.ascontiguousarray(blobs[0]).reshape(-1).view(np.uint8)
        return pa.Array.from_buffers(pa.large_binary(), 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    for start, blob in zip(offsets[:-1], blobs):
        data[start : start + blob.nbytes] = np.ascontiguousarray(blob).reshape(-1).view(np.uint8)
    return pa.Array.from_buffers(
        pa.large_binary(), len(blobs), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def records_to_batch(records: Sequence[Record]) -> pa.RecordBatch:
    columns = [
        pa.array([r.name for r in records], pa.string()),
        pa.array([r.seq_no for r in records], pa.int64()),
        pa.array([r.step for r in records], pa.int64()),
        pa.array([r.rank for r in records], pa.int32()),
        pa.array([r.depth for r in records], pa.int32()),
        pa.array([r.dtype for r in records], pa.string()),
        pa.array([r.static for r in records], pa.bool_()),
        pa.array([list(r.data.shape) for r in records], pa.list_(pa.int64())),
        _list_array([np.asarray(r.request, dtype=object) for r in records], pa.string()),
        _list_array([r.position for r in records], pa.int64()),
        _list_array([r.token_id for r in records], pa.int64()),
        _binary_array([r.data for r in records]),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def key_columns(batch: pa.RecordBatch, batch_no: int) -> dict[str, list]:
    """The index entries of one batch (every record, ``__tokens__`` ones included, but not the
    closing ``__index__`` / ``__final__`` rows), with where they live."""
    if batch.schema.names[: len(KEY_COLUMNS)] != list(KEY_COLUMNS):
        raise ValueError("Arrow columns do not match the tracediff schema")
    names = batch.column("name").to_pylist()
    rows = [i for i, name in enumerate(names) if name not in CLOSING_RECORDS]
    taken = pa.array(rows, pa.int64())
    cols = {key: batch.column(key).take(taken).to_pylist() for key in KEY_COLUMNS}
    cols["batch"] = [batch_no] * len(rows)
    cols["row"] = rows
    return cols


def _reserved(batch: pa.RecordBatch, name: str) -> bytes | None:
    """The data of a reserved row (``__final__``, ``__index__``) in this batch, if present."""
    names = batch.column("name").to_pylist()
    return batch.column("data")[names.index(name)].as_py() if name in names else None


def _blob_record(name: str, blob: bytes) -> Record:
    return Record(name=name, data=np.frombuffer(blob, dtype=np.uint8), dtype="uint8", static=True)


class ArrowWriter:
    """Appends batches of records; each ``write`` reaches the OS before it returns.

    At close it appends one last batch holding ``__index__`` (every record's key columns and
    location, so a reader need not visit each batch) and ``__final__`` (end-of-run metadata).
    """

    def __init__(self, path: str | Path, meta: dict, compression: str | None = None) -> None:
        self.path = Path(path)
        if compression not in (None, "lz4", "zstd"):
            raise ValueError(f"Arrow traces compress with 'lz4' or 'zstd', not {compression!r}")
        schema = SCHEMA.with_metadata(
            {
                "tracediff.format": FORMAT_NAME,
                "tracediff.format_version": str(FORMAT_VERSION),
                "tracediff.meta": dumps_meta(meta),
            }
        )
        self._file = open(self.path, "wb", buffering=0)
        options = pa.ipc.IpcWriteOptions(compression=compression)
        self._writer = pa.ipc.new_file(self._file, schema, options=options)
        self._index: dict[str, list] = {key: [] for key in INDEX_COLUMNS}
        self._batches = 0

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        self._writer.write_batch(records_to_batch(records))
        index = self._index  # the same entries key_columns() would read back from the batch
        for row, r in enumerate(records):
            for key, value in (("name", r.name), ("seq_no", r.seq_no), ("step", r.step), ("rank", r.rank),
                               ("depth", r.depth), ("dtype", r.dtype), ("static", r.static),
                               ("shape", list(r.data.shape)), ("batch", self._batches), ("row", row)):
                index[key].append(value)
        self._batches += 1

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    def abort(self) -> None:
        """Let go of the file after a failed write; the stream body stays readable."""
        self._file.close()

    def close(self, final: dict) -> None:
        sink = pa.BufferOutputStream()
        table = pa.table({key: pa.array(values, INDEX_SCHEMA.field(key).type)
                          for key, values in self._index.items()}, schema=INDEX_SCHEMA)
        with pa.ipc.new_stream(sink, INDEX_SCHEMA) as stream:
            stream.write_table(table)
        closing = [_blob_record(INDEX_RECORD, sink.getvalue().to_pybytes()),
                   _blob_record(FINAL_RECORD, dumps_meta(final).encode())]
        self._writer.write_batch(records_to_batch(closing))
        self._writer.close()
        self.sync()
        self._file.close()


class ArrowTraceFile:
    """Reads one Arrow trace file through a memory map: only touched bytes are read from disk."""

    def __init__(self, path: Path, part: int = 0) -> None:
        self.path = path
        try:
            self._source = pa.memory_map(str(path), "r")
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise TraceError(path, f"cannot open: {exc.strerror or exc}") from None
        # Where the map starts: a buffer inside it sits at file offset (address - base).
        self._base, self._size = self._source.read_buffer(1).address, self._source.size()
        self._source.seek(0)
        self._batches: dict[int, pa.RecordBatch] = {}
        self._key_columns: dict[int, tuple[np.ndarray, ...]] = {}
        self._reader: pa.ipc.RecordBatchFileReader | None = None
        schema = self._open()
        self.meta, self.version = _meta_from_schema(path, schema)
        check_version(path, self.version, close=self.close)
        self.final: dict | None = None
        try:
            self.index, self.token_slots = self._load_index(part)
        except (ValueError, KeyError) as exc:
            raise TraceError(path, f"Arrow trace with a malformed index: {exc}") from None

    @property
    def complete(self) -> bool:
        return self.final is not None

    def _open(self) -> pa.Schema:
        """Open by the footer; without one (the writer died), recover every whole batch of the stream."""
        try:
            self._reader = pa.ipc.open_file(self._source)
            return self._reader.schema
        except pa.ArrowInvalid:
            pass
        self._source.seek(8)
        try:
            stream = pa.ipc.open_stream(self._source)
        except pa.ArrowInvalid as exc:
            raise TraceError(self.path, f"truncated or corrupt Arrow trace: {exc}") from None
        while True:
            try:
                self._batches[len(self._batches)] = stream.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError):
                break  # a torn last batch: everything before it is intact
        return stream.schema

    @property
    def _n_batches(self) -> int:
        return self._reader.num_record_batches if self._reader is not None else len(self._batches)

    def _batch(self, b: int) -> pa.RecordBatch:
        if b not in self._batches:
            if self._reader is None:  # a recovered stream holds all its batches; or the trace is closed
                raise IndexError(f"{self.path}: no record batch {b}")
            self._batches[b] = self._reader.get_batch(b)
        return self._batches[b]

    def _load_index(self, part: int) -> tuple[RecordIndex, np.ndarray]:
        """From the closing ``__index__`` row when present (two reads), else by visiting every batch;
        the tensor records' index and the slots of the ``__tokens__`` records."""
        n = self._n_batches
        last = self._batch(n - 1) if n else None
        blob = _reserved(last, INDEX_RECORD) if last is not None else None
        if blob is not None:
            cols = pa.ipc.open_stream(pa.py_buffer(blob)).read_all().to_pydict()
        else:
            cols = {key: [] for key in INDEX_COLUMNS}
            for b in range(n):
                for key, values in key_columns(self._batch(b), b).items():
                    cols[key].extend(values)
        if last is not None and (final := _reserved(last, FINAL_RECORD)) is not None:
            self.final = json.loads(final)
        self._locations = list(zip(cols["batch"], cols["row"]))
        cols["n_rows"] = [0 if st else (sh[0] if sh else 0) for st, sh in zip(cols["static"], cols["shape"])]
        cols["nbytes"] = [math.prod(shape) * storage_dtype(dtype).itemsize
                          for shape, dtype in zip(cols["shape"], cols["dtype"])]
        return RecordIndex.tensors_of(part, cols)

    def _row(self, slot: int) -> tuple[pa.RecordBatch, int]:
        b, row = self._locations[slot]
        return self._batch(b), row

    def _data(self, slot: int) -> tuple[pa.Buffer, int, int]:
        """The buffer holding a record's bytes, and where in it they start and end."""
        batch, row = self._row(slot)
        column = batch.column("data")
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=len(column) + 1,
                                offset=column.offset * 8)
        return column.buffers()[2], int(offsets[row]), int(offsets[row + 1])

    def read_raw(self, slot: int) -> np.ndarray:
        """Raw bytes of one record, zero-copy from the memory map."""
        buffer, start, end = self._data(slot)
        return np.frombuffer(buffer, dtype=np.uint8)[start:end]

    def _file_range(self, slot: int) -> tuple[int, int] | None:
        """(file offset, length) of a record's bytes; None where they are compressed in the file."""
        buffer, start, end = self._data(slot)
        at = buffer.address - self._base + start
        return (at, end - start) if 0 <= at and at + (end - start) <= self._size else None

    def data_offsets(self) -> np.ndarray:
        """File offset of every record's bytes where they lie uncompressed in the file, else -1."""
        return np.array([-1 if (where := self._file_range(slot)) is None else where[0]
                         for slot in range(len(self._locations))], dtype=np.int64)

    def prefetch(self, slot: int, offset: int = 0, n: int | None = None) -> None:
        if (where := self._file_range(slot)) is not None:
            prefetch(self._fd, where[0] + offset, where[1] - offset if n is None else n)

    def read_into(self, slot: int, out: np.ndarray, offset: int = 0) -> None:
        """Copy bytes [offset, offset + out.nbytes) of a record into ``out``: one pread where the
        bytes lie uncompressed in the file."""
        where = self._file_range(slot)
        if where is not None:
            pread_into(self._fd, out, where[0] + offset)
        else:  # a compressed file: the buffer was decompressed into memory
            buffer, start, _ = self._data(slot)
            out[:] = np.frombuffer(buffer, dtype=np.uint8)[start + offset : start + offset + out.nbytes]

    def read_keys(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of one record."""
        return self.read_keys_many(np.array([slot]))

    def read_keys_many(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of the given records, concatenated; each
        batch's key columns are flattened to numpy once."""
        parts: list[tuple[np.ndarray, ...]] = []
        for slot in slots.tolist():
            b, row = self._locations[slot]
            offsets, *columns = self._batch_keys(b)
            start, stop = offsets[row], offsets[row + 1]
            parts.append(tuple(column[start:stop] for column in columns))
        if not parts:
            return np.empty(0, dtype=object), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        request, position, token_id = (np.concatenate(column) for column in zip(*parts))
        return request, position, token_id

    def _batch_keys(self, b: int) -> tuple[np.ndarray, ...]:
        """(row offsets, request, position, token_id) of one batch, flattened."""
        if b not in self._key_columns:
            batch = self._batch(b)
            lists = [batch.column(key) for key in ("request", "position", "token_id")]
            base = lists[0].offsets.to_numpy()
            flat = [column.values.to_numpy(zero_copy_only=False) for column in lists]
            for column in lists[1:]:  # the three list columns share one row layout
                if not np.array_equal(column.offsets.to_numpy(), base):
                    raise ValueError(f"{self.path}: key columns of batch {b} disagree in length")
            self._key_columns[b] = (base, flat[0].astype(object), *flat[1:])
        return self._key_columns[b]

    def close(self) -> None:
        self._batches = {}
        self._reader = None
        self._source.close()
        os.close(self._fd)


def _meta_from_schema(path: Path, schema: pa.Schema) -> tuple[dict, int]:
    raw = schema.metadata or {}
    if raw.get(b"tracediff.format") != FORMAT_NAME.encode():
        raise TraceError(path, "not a tracediff trace (Arrow file without tracediff metadata)")
    version = int(raw.get(b"tracediff.format_version", b"0"))
    return json.loads(raw.get(b"tracediff.meta", b"{}")), version
