"""The logical trace model shared by every physical format (see docs/FORMAT.md).

A trace is run metadata plus an ordered stream of records; a record is one logged tensor with
its place in the run (name, seq_no, step, rank, depth) and, unless it is static, one
(request, position, token_id) key per row of its first axis (position -1: a padding row).
Version 2 adds the token table: reserved ``__tokens__`` records whose rows are its entries.
Version 3 adds checksums (CRC32): of each record's bytes, of its key columns and of the metadata.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from tracediff.errors import TraceError
from tracediff.trace.crc import crc32
from tracediff.trace.dtypes import decode

FORMAT_NAME = "tracediff"
FORMAT_VERSION = 3
CHECKSUMS_SINCE = 3  # the first format version whose traces carry checksums
MAX_NDIM = 8  # the most dims a record may have, in either format (HDF5's shape column; docs/FORMAT.md)

# Names starting with this are the format's own bookkeeping, never user data.
RESERVED_PREFIX = "__"
FINAL_RECORD = "__final__"
INDEX_RECORD = "__index__"
TOKENS_RECORD = "__tokens__"  # rows are token table entries (request, position, token_id); no data
CLOSING_RECORDS = frozenset({FINAL_RECORD, INDEX_RECORD})  # Arrow's closing batch, not records
PADDING_POSITION = -1

_EMPTY_STR = np.empty(0, dtype=object)
_EMPTY_INT = np.empty(0, dtype=np.int64)


@dataclass
class Record:
    """One logged tensor. ``data`` holds raw bits in the storage dtype of ``dtype``."""

    name: str
    data: np.ndarray
    dtype: str
    seq_no: int = 0
    step: int = 0
    rank: int = 0
    depth: int = 0
    static: bool = False
    request: np.ndarray = field(default_factory=lambda: _EMPTY_STR)
    position: np.ndarray = field(default_factory=lambda: _EMPTY_INT)
    token_id: np.ndarray = field(default_factory=lambda: _EMPTY_INT)
    # (data, record, rows) checksums a writer stores as they are instead of computing them: a copy
    # of a record read unchecked (--no-verify) carries its source's, so corrupt bytes stay corrupt
    checksums: tuple[int, int, int] | None = field(default=None, compare=False, repr=False)

    @property
    def n_rows(self) -> int:
        return 0 if self.static else int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def numpy(self) -> np.ndarray:
        """Values as numpy holds them (bfloat16 upcast exactly to float32)."""
        return decode(self.data, self.dtype)

    def torch(self):
        """The exact tensor, bfloat16 included (needs torch)."""
        from tracediff.trace.dtypes import raw_to_torch

        return raw_to_torch(self.data, self.dtype)


@dataclass
class RecordIndex:
    """Key columns of every record in one trace, one entry per record, in file order.

    ``part`` and ``slot`` say where a reader finds the record (which file, which entry).
    """

    name: np.ndarray
    seq_no: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    depth: np.ndarray
    dtype: np.ndarray
    static: np.ndarray
    n_rows: np.ndarray
    nbytes: np.ndarray
    shape: list[tuple[int, ...]]
    part: np.ndarray
    slot: np.ndarray

    def __len__(self) -> int:
        return len(self.seq_no)

    @classmethod
    def from_columns(cls, part: int, columns: dict, slot: np.ndarray | None = None) -> RecordIndex:
        """``slot``: where each entry sits in its file (default 0..n-1)."""
        n = len(columns["seq_no"])
        return cls(
            name=np.asarray(columns["name"], dtype=object),
            seq_no=np.asarray(columns["seq_no"], dtype=np.int64),
            step=np.asarray(columns["step"], dtype=np.int64),
            rank=np.asarray(columns["rank"], dtype=np.int64),
            depth=np.asarray(columns["depth"], dtype=np.int64),
            dtype=np.asarray(columns["dtype"], dtype=object),
            static=np.asarray(columns["static"], dtype=bool),
            n_rows=np.asarray(columns["n_rows"], dtype=np.int64),
            nbytes=np.asarray(columns["nbytes"], dtype=np.int64),
            shape=[tuple(s) for s in columns["shape"]],  # python ints: callers pass lists of int
            part=np.full(n, part, dtype=np.int64),
            slot=np.arange(n, dtype=np.int64) if slot is None else np.asarray(slot, dtype=np.int64),
        )

    @classmethod
    def tensors_of(cls, part: int, columns: dict) -> tuple[RecordIndex, np.ndarray]:
        """The index of a file's tensor records (reserved ``__`` names left out, so nothing that
        lists tensors sees them) and the file slots of its ``__tokens__`` records."""
        names = columns["name"]
        reserved = np.fromiter((n.startswith(RESERVED_PREFIX) for n in names), dtype=bool, count=len(names))
        tokens = np.flatnonzero([n == TOKENS_RECORD for n in names]).astype(np.int64)
        if not reserved.any():
            return cls.from_columns(part, columns), tokens
        keep = np.flatnonzero(~reserved)
        subset = {key: values[keep] if isinstance(values, np.ndarray) else [values[i] for i in keep]
                  for key, values in columns.items()}
        return cls.from_columns(part, subset, slot=keep), tokens

    @classmethod
    def concat(cls, parts: list[RecordIndex]) -> RecordIndex:
        if len(parts) == 1:
            return parts[0]
        arrays = {
            key: np.concatenate([getattr(p, key) for p in parts])
            for key in ("name", "seq_no", "step", "rank", "depth", "dtype", "static", "n_rows",
                        "nbytes", "part", "slot")
        }
        return cls(shape=[s for p in parts for s in p.shape], **arrays)


def tokens_record(request: np.ndarray, position: np.ndarray, token_id: np.ndarray, rank: int = 0) -> Record:
    """A ``__tokens__`` record: token table entries as rows of a zero-width uint8 tensor."""
    return Record(name=TOKENS_RECORD, data=np.empty((len(position), 0), dtype=np.uint8), dtype="uint8",
                  seq_no=-1, step=-1, rank=rank, request=np.asarray(request, dtype=object),
                  position=np.asarray(position, dtype=np.int64),
                  token_id=np.asarray(token_id, dtype=np.int64))


def check_version(path: str | Path, version: int, close: Callable[[], None]) -> None:
    """Refuse a trace written by a newer format version than this tracediff reads."""
    if version > FORMAT_VERSION:
        close()
        raise TraceError(path, f"written in trace format version {version}; this tracediff reads up to "
                               f"{FORMAT_VERSION}: upgrade tracediff")


def dumps_meta(meta: dict) -> str:
    """Metadata as JSON; refuses values JSON cannot hold rather than stringify them silently."""
    return json.dumps(meta, sort_keys=True, allow_nan=False)


# Checksums (format version 3, docs/FORMAT.md "Checksums"): CRC32 (zlib) of canonical bytes, the same
# in both formats, so a converted or sliced record keeps its checksums.


def data_crc(raw: np.ndarray | bytes | memoryview) -> int:
    """CRC32 of a record's tensor bytes."""
    return crc32(raw.data if isinstance(raw, np.ndarray) else raw)


def record_crc(name: str, dtype: str, seq_no: int, step: int, rank: int, depth: int, static: bool,
               shape: tuple[int, ...] | list[int]) -> int:
    """CRC32 of a record's own key columns: seq_no, step, rank, depth, static and shape (int64 LE),
    then name and dtype (UTF-8, each ended by a NUL). Readers and writers pay it per record: the
    packing of each ndim and the tail of each (name, dtype) are made once."""
    head = _HEADS.get(len(shape)) or _head(len(shape))
    tail = _TAILS.get((name, dtype)) or _tail(name, dtype)
    return crc32(head.pack(seq_no, step, rank, depth, 1 if static else 0, *shape) + tail)


def _head(ndim: int) -> struct.Struct:
    head = _HEADS[ndim] = struct.Struct(f"<{5 + ndim}q")
    return head


def _tail(name: str, dtype: str) -> bytes:
    if len(_TAILS) >= 4096:  # bounded: names are few, but a reader trusts no file
        _TAILS.clear()
    tail = _TAILS[(name, dtype)] = b"".join((name.encode(), b"\0", dtype.encode(), b"\0"))
    return tail


def rows_crc(request, position: np.ndarray, token_id: np.ndarray) -> int:
    """CRC32 of a record's per-row keys: position, token_id (int64 LE), then the request ids (UTF-8,
    joined by NUL)."""
    if position.dtype == _LE_INT64 and token_id.dtype == _LE_INT64 and position.flags.c_contiguous \
            and token_id.flags.c_contiguous:  # the usual case: straight from the buffers
        crc = crc32(token_id.data, crc32(position.data))
    else:
        crc = _crc_of_array(token_id, _LE_INT64, _crc_of_array(position, _LE_INT64))
    if len(request) == 1:
        return crc32(request[0].encode(), crc)
    texts = request.tolist() if isinstance(request, np.ndarray) else list(request)
    return crc32("\0".join(texts).encode(), crc)


def record_checksums(record: Record) -> tuple[int, int, int]:
    """(data, record, rows) checksums of a record as a writer stores them."""
    raw = np.ascontiguousarray(record.data).reshape(-1).view(np.uint8)
    return (data_crc(raw),
            record_crc(record.name, record.dtype, record.seq_no, record.step, record.rank, record.depth,
                       record.static, record.data.shape),
            rows_crc(record.request, record.position, record.token_id))


_HEADS: dict[int, struct.Struct] = {}  # record_crc's int64 head, by the record's ndim
_TAILS: dict[tuple[str, str], bytes] = {}  # record_crc's name-and-dtype tail, by (name, dtype)
_LE_INT64 = np.dtype("<i8")


def _crc_of_array(values: np.ndarray, dtype: np.dtype | None = None, crc: int = 0) -> int:
    """CRC32 of an array's bytes (as ``dtype``, C order): straight from its buffer when it already
    is that, else from a contiguous copy."""
    if (dtype is None or values.dtype == dtype) and values.flags.c_contiguous:
        return crc32(values.data, crc) if values.ndim else crc32(values.tobytes(), crc)
    return crc32(np.ascontiguousarray(values, dtype=dtype).tobytes(), crc)


def batch_checksums(records: Sequence[Record]) -> np.ndarray:
    """``record_checksums`` of each record, as a writer's uint32 [n, 3] column block (tensor bytes
    checksummed in place). A record that carries ``checksums`` gets those, as they are."""
    sums: list[tuple[int, int, int]] = []
    heads, tails, crc = _HEADS, _TAILS, crc32  # per record: a few dict lookups and four CRC calls
    for r in records:
        if r.checksums is not None:  # carried from the record's source (a copy read unchecked)
            sums.append(r.checksums)
            continue
        data, position, token_id, request = r.data, r.position, r.token_id, r.request
        shape = data.shape
        head = heads.get(len(shape)) or _head(len(shape))
        tail = tails.get((r.name, r.dtype)) or _tail(r.name, r.dtype)
        keys = head.pack(r.seq_no, r.step, r.rank, r.depth, 1 if r.static else 0, *shape) + tail
        if position.dtype == _LE_INT64 and token_id.dtype == _LE_INT64 and position.flags.c_contiguous \
                and token_id.flags.c_contiguous:
            rows = crc(token_id.data, crc(position.data))
        else:
            rows = _crc_of_array(token_id, _LE_INT64, _crc_of_array(position, _LE_INT64))
        texts = request[0].encode() if len(request) == 1 else "\0".join(request.tolist()).encode()
        sums.append((crc(data.data) if data.ndim and data.flags.c_contiguous else _crc_of_array(data),
                     crc(keys), crc(texts, rows)))
    return np.array(sums, dtype=np.uint32).reshape(len(records), 3)


def corrupt_record(path: str | Path, slot: int, name: object, step: object, what: str = "") -> TraceError:
    """The error of a record whose bytes or keys fail their checksum."""
    return TraceError(path, f"corrupt trace: record {slot} ({name}, step {step}) fails its checksum{what}")


class MetaSum(NamedTuple):
    """A piece of a file's metadata as read and the checksum stored for it (an int, or its decimal
    text; None where missing), to check at open or, opened unchecked, before a copy rewrites it."""

    text: bytes
    stored: object
    what: str  # "run metadata", "final metadata", "record index"

    def check(self, path: str | Path) -> None:
        check_meta_crc(path, self.text, self.stored, self.what)


def check_meta_crc(path: str | Path, text: bytes, stored: object, what: str = "run metadata") -> None:
    """Refuse metadata whose stored checksum (an int, or its decimal text) is missing or wrong."""
    try:
        expected = int(stored)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TraceError(path, f"corrupt trace: its {what} has no checksum") from None
    if crc32(text) != expected:
        raise TraceError(path, f"corrupt trace: its {what} fails its checksum")
