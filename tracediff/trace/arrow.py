"""Arrow IPC physical format: one Arrow row per record, raw tensor bytes in a binary column.

The file is an Arrow IPC *file* (readable by pyarrow, polars, duckdb). Its body is a plain IPC
stream after the 8-byte magic, so a writer killed before the footer leaves a readable stream;
the reader recovers every complete batch from it.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np
import pyarrow as pa

from tracediff.errors import TraceError
from tracediff.trace.checks import (
    RecordShapes,
    check_expansion,
    check_record_count,
    final_meta,
    first_fault,
    format_version,
    itemsizes,
    refuse,
    run_meta,
)
from tracediff.trace.crc import crc32
from tracediff.trace.fileio import pread_into, prefetch
from tracediff.trace.footer import FOOTER_END, file_blocks
from tracediff.trace.schema import (
    CHECKSUMS_SINCE,
    CLOSING_RECORDS,
    FINAL_RECORD,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_RECORD,
    MAX_NDIM,
    MetaSum,
    Record,
    RecordIndex,
    batch_checksums,
    check_version,
    corrupt_record,
    dumps_meta,
    record_crc,
    rows_crc,
)
from tracediff.trace.storage import ARROW, TraceFile, describe, register, trace_errors

SCHEMA_V2 = pa.schema(  # format versions 1 and 2: no checksums
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
# Format version 3 on: per record, the CRC32 of its bytes, of its own key columns and of its rows' keys
CRC_COLUMNS = ("data_crc", "record_crc", "rows_crc")
SCHEMA = pa.schema([*SCHEMA_V2, *(pa.field(key, pa.uint32()) for key in CRC_COLUMNS)])
KEY_COLUMNS = ("name", "seq_no", "step", "rank", "depth", "dtype", "static", "shape")
# The closing __index__ row: every record's key columns (and checksums) plus the batch and row that hold it.
_WHERE = [pa.field("batch", pa.int32()), pa.field("row", pa.int32())]
INDEX_SCHEMA_V2 = pa.schema([SCHEMA.field(k) for k in KEY_COLUMNS] + _WHERE)
INDEX_SCHEMA = pa.schema([SCHEMA.field(k) for k in (*KEY_COLUMNS, *CRC_COLUMNS)] + _WHERE)
INDEX_COLUMNS = tuple(INDEX_SCHEMA.names)
ARROW_MAGIC = b"ARROW1\0\0"  # an IPC file's first 8 bytes
END_OF_STREAM = b"\xff\xff\xff\xff\0\0\0\0"
INDEX_MERGE = 64  # a writer merges its index entries into one table every this many batches
INDEX_HELD = 16384  # index entries a writer holds in memory (~1.4 MB); it spills them beyond that
HELD_DECOMPRESSED = 256 << 20  # bytes of decompressed batches a reader holds (at least the one in use)
# What a compressed batch's key columns may decompress to beyond the data its index entries declare:
# this floor, plus per record its fixed columns, names and shape, plus per row its position, token id
# and request id (a request id of more than ~200 bytes on every row of 2^18 rows or more is refused).
KEYS_FLOOR = 64 << 20
KEY_BYTES_PER_RECORD = 1024
KEY_BYTES_PER_ROW = 256


def _buffer_count(field_type: pa.DataType) -> int:
    """IPC buffers of a column of this type, its children's included."""
    return field_type.num_buffers + sum(_buffer_count(field_type.field(i).type)
                                        for i in range(field_type.num_fields))


DATA_VALUES = sum(_buffer_count(f.type) for f in SCHEMA_V2) - 1  # the data column's bytes: its last buffer


class _Flat:
    """A flatbuffer table of an IPC message's metadata, read with bounds checks (ValueError)."""

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - self._int("<i", pos)
        self.vtable_len = self._int("<H", self.vtable)

    def _int(self, fmt: str, at: int) -> int:
        if at < 0 or at + struct.calcsize(fmt) > len(self.buf):
            raise ValueError(f"flatbuffer offset {at} outside its {len(self.buf)} bytes")
        return int(struct.unpack_from(fmt, self.buf, at)[0])

    def _field(self, i: int) -> int:
        slot = 4 + 2 * i
        return self._int("<H", self.vtable + slot) if slot + 2 <= self.vtable_len else 0

    def scalar(self, i: int, fmt: str) -> int:
        at = self._field(i)
        return self._int(fmt, self.pos + at) if at else 0

    def table(self, i: int) -> _Flat | None:
        at = self._field(i)
        return _Flat(self.buf, self.pos + at + self._int("<I", self.pos + at)) if at else None

    def structs(self, i: int, fmt: str) -> list[tuple]:
        at = self._field(i)
        if not at:
            return []
        vector = self.pos + at + self._int("<I", self.pos + at)
        count, size = self._int("<I", vector), struct.calcsize(fmt)
        if vector + 4 + count * size > len(self.buf):
            raise ValueError(f"a flatbuffer vector of {count} entries past its end")
        return list(struct.iter_unpack(fmt, self.buf[vector + 4 : vector + 4 + count * size]))


RECORD_BATCH_HEADER = 3  # org.apache.arrow.flatbuf.MessageHeader.RecordBatch


def _declared_sizes(message: pa.ipc.Message) -> tuple[int, int, int] | None:
    """(rows, bytes, bytes of the data column) a record batch message decompresses to, from its
    metadata and each compressed buffer's length prefix (what Arrow allocates for it), before any of
    it is decompressed; None for an uncompressed message (its buffers are read in place)."""
    meta = memoryview(message.metadata).cast("B")
    root = _Flat(meta, struct.unpack_from("<I", meta, 0)[0] if len(meta) >= 4 else -1)
    header = root.table(2)
    if root.scalar(1, "<B") != RECORD_BATCH_HEADER or header is None:
        raise ValueError("not a record batch message")
    if header.table(3) is None:  # no BodyCompression
        return None
    body = message.body
    body_view = memoryview(body).cast("B") if body is not None else memoryview(b"")
    total = data = 0
    for k, (offset, length) in enumerate(header.structs(2, "<qq")):
        if length < 8:
            continue  # an empty buffer
        if offset < 0 or offset + 8 > len(body_view):
            raise ValueError(f"buffer {k} at {offset} outside the message body ({len(body_view)} bytes)")
        size = struct.unpack_from("<q", body_view, offset)[0]
        if size == -1:  # stored uncompressed: read in place
            continue
        if size < 0:
            raise ValueError(f"buffer {k} declares {size} bytes")
        total += size
        if k == DATA_VALUES:
            data = size
    return header.scalar(0, "<q"), total, data


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


def records_to_batch(records: Sequence[Record], data: pa.Array | None = None) -> pa.RecordBatch:
    """One Arrow row per record; ``data``: their data column, when already built."""
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
        _binary_array([r.data for r in records]) if data is None else data,
    ]
    sums = batch_checksums(records)
    columns += [pa.array(sums[:, k], pa.uint32()) for k in range(len(CRC_COLUMNS))]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def key_table(batch: pa.RecordBatch, batch_no: int) -> pa.Table:
    """The index entries of one batch (every record, ``__tokens__`` ones included, but not the
    closing ``__index__`` / ``__final__`` rows), with where they live, as an ``INDEX_SCHEMA`` table."""
    if batch.schema.names[: len(KEY_COLUMNS)] != list(KEY_COLUMNS):
        raise ValueError("Arrow columns do not match the tracediff schema")
    names = batch.column("name").to_numpy(zero_copy_only=False)  # a null name is None: kept
    kept = np.flatnonzero(~np.isin(names, sorted(CLOSING_RECORDS))).astype(np.int32)
    summed = batch.schema.names[-len(CRC_COLUMNS):] == list(CRC_COLUMNS)
    keys = (*KEY_COLUMNS, *CRC_COLUMNS) if summed else KEY_COLUMNS
    if len(kept) == 0 or kept[-1] == len(kept) - 1:  # the closing rows come last (or there are none)
        columns = [batch.column(key).slice(0, len(kept)) for key in keys]
    else:  # never written so: take (pyarrow.compute, imported only here)
        columns = [batch.column(key).take(pa.array(kept)) for key in keys]
    columns += [pa.array(np.full(len(kept), batch_no, np.int32)), pa.array(kept)]
    return pa.Table.from_arrays(columns, schema=INDEX_SCHEMA if summed else INDEX_SCHEMA_V2)


def key_columns(batch: pa.RecordBatch, batch_no: int) -> dict[str, list]:
    """``key_table`` as lists."""
    return key_table(batch, batch_no).to_pydict()


def _reserved(batch: pa.RecordBatch, name: str) -> bytes | None:
    """The data of a reserved row (``__final__``, ``__index__``) in this (validated) batch, if present."""
    names = batch.column("name").to_pylist()
    return batch.column("data")[names.index(name)].as_py() if name in names else None


def file_header(schema: pa.Schema) -> bytes:
    """The head of an Arrow IPC file of this schema: its magic, padded to 8 bytes, and the schema
    message, which is the start of an IPC stream of it (what a stream writer writes before its
    end-of-stream marker)."""
    sink = pa.BufferOutputStream()
    pa.ipc.new_stream(sink, schema).close()
    return ARROW_MAGIC + sink.getvalue().to_pybytes()[: -len(END_OF_STREAM)]


def closing_batch(blob: pa.Buffer, index_nbytes: int) -> pa.RecordBatch:
    """The closing batch: ``__index__`` (the first ``index_nbytes`` of ``blob``) and ``__final__``
    (the rest), their data column over ``blob`` itself (no copy)."""
    view = np.frombuffer(blob, dtype=np.uint8)
    records = [Record(name=name, data=part, dtype="uint8", static=True)
               for name, part in ((INDEX_RECORD, view[:index_nbytes]), (FINAL_RECORD, view[index_nbytes:]))]
    offsets = np.array([0, index_nbytes, blob.size], dtype=np.int64)
    data = pa.Array.from_buffers(pa.large_binary(), 2, [None, pa.py_buffer(offsets), blob])
    return records_to_batch(records, data)


class WholeWrites(io.RawIOBase):
    """A raw file whose ``write`` writes every byte or raises. pyarrow ignores the count a Python
    file's ``write`` returns, and a raw write may write less than asked: at most 2147479552 bytes
    per call on Linux, or a part of it near a full disk. Unwrapped, a record of 2 GiB or more (or a
    write cut short by ENOSPC) would leave a silent hole in the stream."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:  # any buffer, as RawIOBase.write takes
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self._raw.write(view[done:])
            if not n:  # 0 or None: the file takes nothing; looping again would spin
                raise OSError(f"a write of {len(view) - done} bytes wrote none")
            done += n
        return done

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def scratch_file(directory: Path) -> BinaryIO:
    """An unlinked scratch file beside the trace, else (a directory that refuses new files, though
    the trace itself is writable) in the system temp dir; an OSError only when both refuse."""
    try:
        return tempfile.TemporaryFile(dir=directory, prefix=".tracediff-index-")
    except OSError:
        return tempfile.TemporaryFile(prefix=".tracediff-index-")


class IndexBuilder:
    """A writer's index of the records it wrote (``__index__``), in bounded memory: the entries of
    recent batches as Arrow tables (merged every ``INDEX_MERGE`` batches), spilled every
    ``INDEX_HELD`` entries as one batch of an IPC stream in an unlinked scratch file beside the
    trace (or in the system temp dir). At close that stream, followed by the final metadata, is the
    closing batch's data: mapped from the scratch file, never read into memory."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._merged: list[pa.Table] = []  # one table per INDEX_MERGE batches
        self._recent: list[pa.Table] = []  # one per batch since
        self._held = 0  # entries in both
        self._scratch: BinaryIO | None = None
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None

    def add(self, entries: pa.Table) -> None:
        self._recent.append(entries)
        self._held += entries.num_rows
        if len(self._recent) == INDEX_MERGE:
            self._merged.append(pa.concat_tables(self._recent).combine_chunks())
            self._recent = []
        if self._held >= INDEX_HELD:
            self._spill()

    def _held_table(self) -> pa.Table:
        """Every entry held, as one batch."""
        parts = self._merged + self._recent
        self._merged, self._recent, self._held = [], [], 0
        return pa.concat_tables(parts).combine_chunks() if parts else INDEX_SCHEMA.empty_table()

    def _spill(self) -> None:
        if self._stream is None:
            self._scratch = scratch_file(self._directory)
            self._stream = pa.ipc.new_stream(self._scratch, INDEX_SCHEMA)
        self._stream.write_table(self._held_table())

    def write_closing(self, writer: pa.ipc.RecordBatchFileWriter, final: bytes) -> None:
        """Append the closing batch (``__index__`` and ``__final__``) to the trace's writer."""
        if self._stream is None:  # everything is held: one stream in memory
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, INDEX_SCHEMA) as stream:
                stream.write_table(self._held_table())
            index_nbytes = sink.tell()
            sink.write(final)
            writer.write_batch(closing_batch(sink.getvalue(), index_nbytes))
            return
        assert self._scratch is not None  # made with the stream
        if self._held:
            self._spill()
        self._stream.close()
        index_nbytes = self._scratch.tell()
        self._scratch.write(final)
        self._scratch.flush()
        mapped = mmap.mmap(self._scratch.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            writer.write_batch(closing_batch(pa.py_buffer(mapped), index_nbytes))
        finally:
            try:
                mapped.close()
            except BufferError:  # a view outlived the write: unmapped when it is collected
                pass

    def discard(self) -> None:
        """Close the scratch file (unlinked: nothing is left behind)."""
        if self._scratch is not None:
            self._scratch.close()


class ArrowWriter:
    """Appends batches of records; each ``write`` reaches the OS before it returns.

    At open it writes the file's header (magic, schema, run metadata): pyarrow writes it only with
    the first batch, and a writer killed before its first flush would leave 0 bytes, where a reader
    now finds an empty trace that says who started it. At close it appends one last batch holding
    ``__index__`` (every record's key columns and location, so a reader need not visit each batch)
    and ``__final__`` (end-of-run metadata).
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
                "tracediff.meta_crc32": str(crc32(dumps_meta(meta).encode())),
            }
        )
        self._file = WholeWrites(self._open_raw())
        options = pa.ipc.IpcWriteOptions(compression=compression)
        self._file.write(file_header(schema))
        self._file.seek(0)  # pyarrow writes the same header again, over it, with its first batch
        self._writer = pa.ipc.new_file(self._file, schema, options=options)
        self._index = IndexBuilder(self.path.parent)
        self._batches = 0

    def _open_raw(self) -> BinaryIO:
        """The trace's file, unbuffered: each write reaches the OS before ``write`` returns."""
        return open(self.path, "wb", buffering=0)

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        batch = records_to_batch(records)
        self._writer.write_batch(batch)
        # The entries key_table() would read back, held as Arrow columns (no reference to the
        # batch's data) and spilled beyond INDEX_HELD of them: memory stays flat over a long run.
        self._index.add(key_table(batch, self._batches))
        self._batches += 1

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    def abort(self) -> None:
        """Let go of the file after a failed write; the stream body stays readable."""
        self._index.discard()
        self._file.close()

    def forked(self) -> None:
        """Nothing to do in a forked child: nothing here writes to the file unless called (pyarrow
        writes nothing when its writer is collected, and the file is unbuffered)."""

    def close(self, final: dict) -> None:
        try:
            self._index.write_closing(self._writer, dumps_meta(final).encode())
        finally:
            self._index.discard()
        self._writer.close()
        self.sync()
        self._file.close()


class ArrowTraceFile(TraceFile):
    """Reads one Arrow trace file through a memory map: only touched bytes are read from disk.

    Nothing is used before it is checked: the schema and metadata at open, the ``__index__``
    against the file's batches, each batch (``validate(full=True)``: offsets, lengths, UTF-8) and
    its records' data and key lengths the first time a record in it is read. A closed file is read
    strictly; a killed one (no footer) up to its last whole batch. A file killed while it was being
    closed (its closing batch written, its footer not, or not all of it) is read as a killed one: its
    ``__index__`` and ``__final__`` are not used, the close that would vouch for them never ended."""

    def __init__(self, path: Path, part: int = 0, verify: bool = True) -> None:
        self.path = path
        self.verify = verify
        self._fd = -1
        self._batches: dict[int, pa.RecordBatch] = {}
        self._resident: dict[int, int] = {}  # decompressed batches held -> their bytes, oldest first
        self._data_columns: dict[int, tuple[pa.Buffer, np.ndarray, int | None]] = {}
        self._reader: pa.ipc.RecordBatchFileReader | None = None
        self._keys_reader: pa.ipc.RecordBatchFileReader | None = None
        self._messages: list[tuple[pa.ipc.Message, tuple[int, int, int] | None]] | None = None
        try:
            self._source = pa.memory_map(str(path), "r")
        except OSError as exc:
            raise TraceError(path, f"cannot open: {exc.strerror or exc}") from None
        try:
            self._fd = os.open(path, os.O_RDONLY)
            self._load(part)
        except BaseException:
            self.close()
            raise

    @trace_errors
    def _load(self, part: int) -> None:
        # Where the map starts: a buffer inside it sits at file offset (address - base).
        self._base, self._size = self._source.read_buffer(1).address, self._source.size()
        self._source.seek(0)
        self._sound: set[int] = set()  # batches validated
        self._checked: set[int] = set()  # batches whose index entries were checked against them
        self._key_columns: dict[int, tuple[np.ndarray, ...]] = {}
        schema = self._open()
        self.meta, self.version, meta_sum = _meta_from_schema(self.path, schema)
        self.meta_sums = [] if meta_sum is None else [meta_sum]
        if self.verify:
            self.check_metadata()
        check_version(self.path, self.version, close=lambda: None)
        self._summed = self.version >= CHECKSUMS_SINCE
        if not schema.equals(SCHEMA if self._summed else SCHEMA_V2, check_metadata=False):
            raise TraceError(self.path, "Arrow columns do not match the tracediff schema (docs/FORMAT.md)")
        self.final: dict | None = None
        self.index, self.token_slots = self._load_index(part)
        check_record_count(self.path, self.final, len(self.index))
        self._read_ahead_keys()

    def _read_ahead_keys(self) -> None:
        """Ask the disk for every batch's metadata and key columns now, all at once: reading keys
        (``read_keys_many``) then finds them in the page cache instead of waiting for one small
        read per batch (a cold 2 x 1 GB compare: 0.36-0.48 s of key reads -> 0.13-0.19 s). Only
        for an uncompressed file with a footer; a hint: what it reads is never trusted."""
        if self._reader is None or self._messages is not None or self._n_batches < 2:
            return
        blocks = file_blocks(self._fd, self._size)
        if len(blocks) != self._n_batches:
            return
        sizes = np.r_[0, np.cumsum(self._nbytes_of[self._by_batch])]
        data = sizes[self._batch_starts[1:]] - sizes[self._batch_starts[:-1]]
        for block, held in zip(blocks[:-1], data.tolist()):  # the last batch, the index's, is read
            keys = max(0, block.body - held)  # key columns lie before the data, checksums after it
            prefetch(self._fd, block.offset, block.meta + keys)
            prefetch(self._fd, block.end - keys, keys)

    @property
    def complete(self) -> bool:
        return self.final is not None

    def _open(self) -> pa.Schema:
        """Open by the footer; without one (the writer died), recover every whole batch of the stream.
        Either way the stream's record batch messages are listed (their metadata read, nothing
        decompressed): what each batch decompresses to is known before it is read."""
        try:
            self._reader = pa.ipc.open_file(self._source)
        except pa.ArrowInvalid:
            self._reader = None
        self._messages, schema = self._scan()
        if self._reader is not None:
            if self._messages is not None and len(self._messages) != self._reader.num_record_batches:
                raise TraceError(self.path, f"its footer lists {self._reader.num_record_batches} record "
                                            f"batches, its stream holds {len(self._messages)}")
            return self._reader.schema
        assert self._messages is not None and schema is not None  # a stream without a footer is listed whole
        self._schema = schema
        for b in range(len(self._messages)):  # a torn last batch: everything before it is intact
            try:
                batch = pa.ipc.read_record_batch(self._messages[b][0], schema)
            except (pa.ArrowInvalid, OSError):
                del self._messages[b:]
                break
            self._hold(b, batch)
        return schema

    def _scan(self) -> tuple[list[tuple[pa.ipc.Message, tuple[int, int, int] | None]] | None,
                             pa.Schema | None]:
        """The stream's record batch messages, each with what it declares it decompresses to; for a
        file with a footer whose first batch is uncompressed, None (its batches are read in place)."""
        try:
            self._source.seek(len(ARROW_MAGIC))
            body = pa.BufferReader(self._source.read_buffer(max(0, self._size - len(ARROW_MAGIC))))  # mapped
            self._source.seek(0)
            reader = pa.ipc.MessageReader.open_stream(body)
            first = reader.read_next_message()
            schema = pa.ipc.read_schema(first) if first.type == "schema" else None
        except (pa.ArrowInvalid, OSError, StopIteration, ValueError) as exc:
            if self._reader is not None:
                return None, None  # what the footer says is read; bounds below still apply
            raise TraceError(self.path, f"truncated or corrupt Arrow trace: {describe(exc)}") from None
        if schema is None:
            raise TraceError(self.path, "its Arrow stream does not open with a schema")
        messages: list[tuple[pa.ipc.Message, tuple[int, int, int] | None]] = []
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as exc:
                if self._reader is not None:
                    raise TraceError(self.path, f"record batch {len(messages)} is corrupt: {describe(exc)}") \
                        from None
                break  # a torn last batch
            if message.type != "record batch":
                raise TraceError(self.path, f"its Arrow stream holds a {message.type} message; a trace holds "
                                            "record batches")
            try:
                declared = _declared_sizes(message)
            except ValueError as exc:
                raise TraceError(self.path, f"record batch {len(messages)} is corrupt: "
                                            f"{describe(exc)}") from None
            if declared is None and not messages and self._reader is not None:
                return None, schema  # uncompressed: nothing to decompress, nothing to list
            messages.append((message, declared))
        return messages, schema

    @property
    def _n_batches(self) -> int:
        return self._reader.num_record_batches if self._reader is not None else len(self._messages or ())

    def _load_batch(self, b: int) -> pa.RecordBatch:
        """Batch ``b``, validated (offsets, lengths, UTF-8, no nulls) before anything reads it; a
        compressed one decompressed only once what it declares is within what is being read."""
        batch = self._batch_read(b) if b not in self._batches else self._batches[b]
        if b not in self._sound:
            try:
                batch.validate(full=True)
            except pa.ArrowInvalid as exc:
                raise TraceError(self.path, f"record batch {b} is corrupt: {describe(exc)}") from None
            _no_nulls(self.path, f"record batch {b}", batch.columns, batch.schema.names)
            self._sound.add(b)
        return batch

    def _batch_read(self, b: int) -> pa.RecordBatch:
        if not 0 <= b < self._n_batches:
            raise TraceError(self.path, f"no record batch {b}")
        declared = self._messages[b][1] if self._messages is not None else None
        if declared is not None:
            self._check_declared(b, *declared)
        if self._reader is not None:
            batch = self._reader.get_batch(b)
        else:
            assert self._messages is not None  # a stream without a footer is read by its messages
            batch = pa.ipc.read_record_batch(self._messages[b][0], self._schema)
        size, bound = self._decompressed(batch), declared[1] if declared is not None else 0
        if size > bound:
            raise TraceError(self.path, f"record batch {b} decompressed to {size} bytes; its message "
                                        f"declares {bound}")
        self._hold(b, batch)
        return batch

    def _check_declared(self, b: int, n_records: int, total: int, data: int) -> None:
        """A compressed batch decompresses to what is being read: the data its index entries declare
        (exactly, no more) and key columns within a bound of their records and rows. The closing batch,
        read before the index it holds, is held to ``check_expansion`` (an index does not compress
        past it). A stream without a footer has no index to declare anything: each batch costs its size."""
        starts = getattr(self, "_batch_starts", None)
        if starts is not None and b + 1 < len(starts):
            slots = self._slots_in(b)
            declared, rows = int(self._nbytes_of[slots].sum()), int(self._rows_of[slots].sum())
            if data > declared:
                raise TraceError(self.path, f"record batch {b} would decompress to {data} bytes of data "
                                            f"where its index entries declare {declared}")
            keys = KEYS_FLOOR + KEY_BYTES_PER_RECORD * len(slots) + KEY_BYTES_PER_ROW * rows
            if total - data > keys:
                raise TraceError(self.path, f"record batch {b} would decompress to {total - data} bytes of "
                                            f"keys for {len(slots)} records of {rows} rows (at most {keys})")
        elif self._reader is not None:
            check_expansion(self.path, total, self._size, f"record batch {b}")

    def _decompressed(self, batch: pa.RecordBatch) -> int:
        """Bytes of a batch's buffers that do not lie in the file's map: what decompressing it took."""
        total = 0
        for column in batch.columns:
            for buffer in column.buffers():
                if buffer is not None and not 0 <= buffer.address - self._base < self._size:
                    total += buffer.size
        return total

    def _hold(self, b: int, batch: pa.RecordBatch) -> None:
        """Keep batch ``b``: zero-copy from the map, or, decompressed, at most ``HELD_DECOMPRESSED``
        bytes of such batches held at once (the oldest let go, read again when next needed), so that
        reading a compressed trace stays in bounded memory."""
        size = self._decompressed(batch)
        if size:
            self._resident.pop(b, None)
            self._resident[b] = size
            while len(self._resident) > 1 and sum(self._resident.values()) > HELD_DECOMPRESSED:
                old = next(iter(self._resident))
                del self._resident[old]
                self._batches.pop(old, None)
                self._data_columns.pop(old, None)
                self._key_columns.pop(old, None)
        self._batches[b] = batch

    def _batch(self, b: int) -> pa.RecordBatch:
        """Batch ``b`` once its records are known to hold the data and keys the index declares."""
        batch = self._load_batch(b)
        if b not in self._checked:
            self._agrees(b, batch)
            self._checked.add(b)
        return batch

    def _agrees(self, b: int, batch: pa.RecordBatch) -> None:
        """The records of batch ``b`` hold the data (where it has its data column) and keys the index
        declares."""
        slots = self._slots_in(b)
        rows = self._row_of[slots]
        if len(rows) and rows.max() >= batch.num_rows:
            raise TraceError(self.path, f"the index points at row {int(rows.max())} of record batch {b}, "
                                        f"which has {batch.num_rows}")
        if "data" in batch.schema.names:
            held = _lengths(batch.column("data"), rows, np.int64)
            _agree(self.path, b, slots, held, self._nbytes_of[slots], "bytes of data")
        for key in ("request", "position", "token_id"):
            _agree(self.path, b, slots, _lengths(batch.column(key), rows, np.int32), self._rows_of[slots],
                   f"{key} entries")

    @property
    def _compressed(self) -> bool:
        return self._messages is not None and bool(self._messages) and self._messages[0][1] is not None

    def _keys_batch(self, b: int) -> pa.RecordBatch:
        """Batch ``b`` for its key columns: where it is compressed (and not held), those alone, read
        without its data column (no tensor bytes are decompressed to read keys), checked as a batch is."""
        if b in self._batches or self._reader is None or not self._compressed:
            return self._batch(b)
        if not 0 <= b < self._n_batches:
            raise TraceError(self.path, f"no record batch {b}")
        if self._keys_reader is None:
            keep = [k for k, name in enumerate(self._reader.schema.names) if name != "data"]
            options = pa.ipc.IpcReadOptions(included_fields=keep)
            self._keys_reader = pa.ipc.open_file(self._source, options=options)
        assert self._messages is not None  # a compressed file's are listed
        declared = self._messages[b][1]
        if declared is None:  # an uncompressed batch: read in place
            return self._batch(b)
        self._check_declared(b, *declared)
        batch = self._keys_reader.get_batch(b)
        if self._decompressed(batch) > declared[1] - declared[2]:
            raise TraceError(self.path, f"record batch {b} decompressed to {self._decompressed(batch)} bytes "
                                        f"of keys; its message declares {declared[1] - declared[2]}")
        try:
            batch.validate(full=True)
        except pa.ArrowInvalid as exc:
            raise TraceError(self.path, f"record batch {b} is corrupt: {describe(exc)}") from None
        _no_nulls(self.path, f"record batch {b}", batch.columns, batch.schema.names)
        self._agrees(b, batch)
        return batch

    def _slots_in(self, b: int) -> np.ndarray:
        return self._by_batch[self._batch_starts[b] : self._batch_starts[b + 1]]

    def _load_index(self, part: int) -> tuple[RecordIndex, np.ndarray]:
        """From the closing ``__index__`` row when present (two reads), else by visiting every batch;
        the tensor records' index and the slots of the ``__tokens__`` records."""
        n = self._n_batches
        last = self._load_batch(n - 1) if n else None
        blob = _reserved(last, INDEX_RECORD) if last is not None else None
        final = _reserved(last, FINAL_RECORD) if last is not None else None
        if self._reader is None:  # killed, perhaps while closing: what its closing batch says is not used
            if final is not None and self._footed():
                raise TraceError(self.path, "its writer closed it, but its Arrow footer is unreadable")
            blob = final = None
        if final is not None:
            self.final = final_meta(self.path, final)
        if blob is not None:
            table, batches = _index_table(self.path, blob, self._summed, self._size), n - 1
        else:
            tables = [key_table(self._load_batch(b), b) for b in range(n)]
            empty = (INDEX_SCHEMA if self._summed else INDEX_SCHEMA_V2).empty_table()
            table, batches = pa.concat_tables(tables) if tables else empty, n
        found = self._index_columns(table, batches, part)
        if self._summed and last is not None:  # once the rules of both hold
            names = last.column("name").to_pylist()
            for what, text, name in (("final metadata", final, FINAL_RECORD),
                                     ("record index", blob, INDEX_RECORD)):
                if text is not None:
                    stored = last.column("data_crc")[names.index(name)].as_py()
                    self.meta_sums.append(MetaSum(text, stored, what))
        if self.verify:
            self.check_metadata()
        return found

    def _footed(self) -> bool:
        """The file ends as a closed one does (a footer's end marker): its footer was written whole."""
        return self._size >= len(ARROW_MAGIC) + len(FOOTER_END) and \
            self._source.read_at(len(FOOTER_END), self._size - len(FOOTER_END)) == FOOTER_END

    def _index_columns(self, table: pa.Table, batches: int, part: int) -> tuple[RecordIndex, np.ndarray]:
        """The index checked: records that can exist, each in a batch of this file, no row twice."""
        shape = table.column("shape").combine_chunks()
        offsets = shape.offsets.to_numpy().astype(np.int64)
        ndim = np.diff(offsets)
        if len(ndim) and ndim.max() > MAX_NDIM:
            raise TraceError(self.path, f"record {int(np.argmax(ndim))} of the index has {int(ndim.max())} "
                                        "dims")
        width = int(ndim.max(initial=0))
        dims = np.zeros((len(ndim), width), dtype=np.int64)
        if width:
            flat = shape.values.to_numpy()[offsets[0] : offsets[-1]]
            within = np.arange(len(flat)) - np.repeat(offsets[:-1] - offsets[0], ndim)
            dims[np.repeat(np.arange(len(ndim)), ndim), within] = flat
        dtypes = table.column("dtype").to_pylist()
        static = table.column("static").to_numpy()
        shapes = RecordShapes.derived(itemsizes(dtypes), static, ndim, dims)
        batch, row = (table.column(key).to_numpy().astype(np.int64) for key in ("batch", "row"))
        faults = [*shapes.faults(), (row < 0, "a negative row"),
                  ((batch < 0) | (batch >= batches), f"a batch outside the file's {batches}")]
        refuse(self.path, first_fault(faults, len(batch)))
        where = (batch << 32) | row
        if len(np.unique(where)) != len(where):
            raise TraceError(self.path, "two entries of its index point at the same record")
        self._locations = list(zip(batch.tolist(), row.tolist()))
        self._row_of, self._nbytes_of, self._rows_of = row, shapes.nbytes, shapes.n_rows
        self._by_batch = np.argsort(batch, kind="stable")
        self._batch_starts = np.searchsorted(batch[self._by_batch], np.arange(batches + 1))
        cols = {key: table.column(key).to_numpy() for key in ("seq_no", "step", "rank", "depth")}
        names = table.column("name").to_pylist()
        self._names, self._steps = names, cols["step"]
        self._rows_verified = np.zeros(len(names), dtype=bool)
        if self._summed:
            self.data_crcs = table.column("data_crc").to_numpy()
            self._rows_crcs = table.column("rows_crc").to_numpy()
            self.record_crcs, self.rows_crcs = table.column("record_crc").to_numpy(), self._rows_crcs
            if self.verify:
                self._check_records(table, names, dtypes, static, shape.to_pylist())
        return RecordIndex.tensors_of(part, {
            **cols, "name": names, "dtype": dtypes, "static": static,
            "shape": shape.to_pylist(), "n_rows": shapes.n_rows, "nbytes": shapes.nbytes,
        })

    def _check_records(self, table: pa.Table, names: list[str], dtypes: list[str], static: np.ndarray,
                       shapes: list[list[int]]) -> None:
        """Refuse the first record whose own key columns fail their checksum."""
        fields = [table.column(k).to_pylist() for k in ("seq_no", "step", "rank", "depth", "record_crc")]
        for slot, (seq_no, step, rank, depth, stored) in enumerate(zip(*fields)):
            if record_crc(names[slot], dtypes[slot], seq_no, step, rank, depth, static[slot],
                          shapes[slot]) != stored:
                raise corrupt_record(self.path, slot, names[slot], step)

    def record_nbytes(self, slot: int) -> int:
        return int(self._nbytes_of[slot])

    def describe_slot(self, slot: int) -> tuple[str, int]:
        return self._names[slot], int(self._steps[slot])

    def _data(self, slot: int) -> tuple[pa.Buffer, int, int, int | None]:
        """The buffer holding a record's bytes, where in it they start and end, and the file offset
        of the start where the buffer lies (uncompressed) in the file, else None."""
        b, row = self._locations[slot]
        if b not in self._data_columns:
            column = self._batch(b).column("data")
            offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=len(column) + 1,
                                    offset=column.offset * 8)
            buffer = column.buffers()[2]
            at = buffer.address - self._base  # where the buffer sits in the map, if it does
            in_file = 0 <= at and at + buffer.size <= self._size
            self._data_columns[b] = (buffer, offsets, at if in_file else None)
        buffer, offsets, at = self._data_columns[b]
        start = int(offsets[row])
        return buffer, start, int(offsets[row + 1]), None if at is None else at + start

    @trace_errors
    def read_raw(self, slot: int) -> np.ndarray:
        """Raw bytes of one record, zero-copy from the memory map."""
        buffer, start, end, _ = self._data(slot)
        return np.frombuffer(buffer, dtype=np.uint8)[start:end]

    @trace_errors
    def data_offsets(self) -> np.ndarray:
        """File offset of every record's bytes where they lie uncompressed in the file, else -1 (all of
        them in a compressed file, known from its first batch: no batch is decompressed to find out)."""
        if self._compressed:
            return np.full(len(self._locations), -1, dtype=np.int64)
        starts = [self._data(slot)[3] for slot in range(len(self._locations))]
        return np.array([-1 if at is None else at for at in starts], dtype=np.int64)

    @trace_errors
    def prefetch(self, slot: int, offset: int = 0, n: int | None = None) -> None:
        _, start, end, at = self._data(slot)
        if at is not None:
            prefetch(self._fd, at + offset, end - start - offset if n is None else n)

    @trace_errors
    def read_into(self, slot: int, out: np.ndarray, offset: int = 0) -> None:
        """Copy bytes [offset, offset + out.nbytes) of a record into ``out``: one pread where the
        bytes lie uncompressed in the file."""
        buffer, start, end, at = self._data(slot)
        if offset < 0 or offset + out.nbytes > end - start:
            raise IndexError(f"bytes {offset}..{offset + out.nbytes} of a record of {end - start}")
        if at is not None:
            pread_into(self._fd, out, at + offset)
        else:  # a compressed file: the buffer was decompressed into memory
            out[:] = np.frombuffer(buffer, dtype=np.uint8)[start + offset : start + offset + out.nbytes]

    @trace_errors
    def read_keys_many(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of the given records, concatenated; each
        batch's key columns are flattened to numpy once."""
        parts: list[tuple[np.ndarray, ...]] = []
        for slot in slots.tolist():
            b, row = self._locations[slot]
            offsets, *columns = self._batch_keys(b)
            start, stop = offsets[row], offsets[row + 1]
            part = tuple(column[start:stop] for column in columns)
            if self.verify and self.data_crcs is not None and not self._rows_verified[slot]:
                if rows_crc(*part) != int(self._rows_crcs[slot]):
                    raise corrupt_record(self.path, slot, *self.describe_slot(slot))
                self._rows_verified[slot] = True
            parts.append(part)
        if not parts:
            return np.empty(0, dtype=object), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        request, position, token_id = (np.concatenate(column) for column in zip(*parts))
        return request, position, token_id

    def _batch_keys(self, b: int) -> tuple[np.ndarray, ...]:
        """(row offsets, request, position, token_id) of one batch, flattened."""
        if b not in self._key_columns:
            batch = self._keys_batch(b)
            lists = [batch.column(key) for key in ("request", "position", "token_id")]
            base = lists[0].offsets.to_numpy()
            flat = [column.values.to_numpy(zero_copy_only=False) for column in lists]
            for column in lists[1:]:  # the three list columns share one row layout
                if not np.array_equal(column.offsets.to_numpy(), base):
                    raise TraceError(self.path, f"key columns of record batch {b} disagree in length")
            self._key_columns[b] = (base, flat[0].astype(object), *flat[1:])
        return self._key_columns[b]

    def close(self) -> None:
        self._batches, self._data_columns = {}, {}
        self._reader = self._keys_reader = None
        self._messages = None
        self._source.close()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _lengths(column: pa.Array, rows: np.ndarray, dtype: type) -> np.ndarray:
    """Lengths of the given rows of a (validated) list or binary column."""
    width = np.dtype(dtype).itemsize
    offsets: np.ndarray = np.frombuffer(column.buffers()[1], dtype=dtype, count=len(column) + 1,
                                        offset=column.offset * width)
    return (offsets[rows + 1] - offsets[rows]).astype(np.int64)


def _agree(path: Path, b: int, slots: np.ndarray, held: np.ndarray, declared: np.ndarray, what: str) -> None:
    wrong = held != declared
    if wrong.any():
        k = int(np.argmax(wrong))
        raise TraceError(path, f"a record in batch {b} holds {int(held[k])} {what} where its shape declares "
                               f"{int(declared[k])}")


def _no_nulls(path: Path, what: str, columns: list, names: list[str]) -> None:
    """Trace columns hold no nulls (a null would read as NaN or None where a value is due)."""
    for name, column in zip(names, columns):
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        for chunk in chunks:
            if chunk.null_count or (isinstance(chunk, pa.ListArray) and chunk.values.null_count):
                raise TraceError(path, f"{what} has nulls in column {name!r}")


def _index_table(path: Path, blob: bytes, summed: bool, file_size: int) -> pa.Table:
    """The ``__index__`` row's table, validated like a batch of the file; a stream of compressed
    batches is bounded as the file's own batches are, one batch at a time as it is decompressed."""
    reader = pa.ipc.open_stream(pa.py_buffer(blob))
    if not reader.schema.equals(INDEX_SCHEMA if summed else INDEX_SCHEMA_V2, check_metadata=False):
        raise TraceError(path, "its __index__ does not have the index columns (docs/FORMAT.md)")
    batches, held = [], 0
    for batch in reader:
        held += batch.get_total_buffer_size()
        check_expansion(path, held, file_size, "its __index__")
        batches.append(batch)
    table = pa.Table.from_batches(batches, schema=reader.schema)
    try:
        table.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise TraceError(path, f"its __index__ is corrupt: {describe(exc)}") from None
    _no_nulls(path, "its __index__", table.columns, table.schema.names)
    return table


def _meta_from_schema(path: Path, schema: pa.Schema) -> tuple[dict, int, MetaSum | None]:
    """(run metadata, format version, the metadata's checksum to check) from the schema's metadata."""
    raw = schema.metadata or {}
    if raw.get(b"tracediff.format") != FORMAT_NAME.encode():
        raise TraceError(path, "not a tracediff trace (Arrow file without tracediff metadata)")
    version = format_version(path, raw.get(b"tracediff.format_version"))
    meta = raw.get(b"tracediff.meta", b"{}")
    parsed = run_meta(path, meta)  # the rules of metadata first, then its checksum
    if version < CHECKSUMS_SINCE:
        return parsed, version, None
    stored = raw.get(b"tracediff.meta_crc32")
    return parsed, version, MetaSum(meta, stored.decode("ascii", "replace") if stored is not None else None,
                                    "run metadata")


FORMAT = register(ARROW.format(writer=ArrowWriter, reader=ArrowTraceFile))
