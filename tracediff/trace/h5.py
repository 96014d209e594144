"""HDF5 physical format: columnar record index, per-row key columns and one raw data blob.

Written in SWMR mode (single writer, multiple readers): every dataset exists from the start
and only grows, and each ``write`` ends with a flush, so a writer killed at any moment leaves
a file that opens (with ``swmr=True``) up to its last flush. Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from tracediff.errors import TraceError
from tracediff.trace.fileio import pread_into, prefetch
from tracediff.trace.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Record,
    RecordIndex,
    check_version,
    dumps_meta,
)

MAX_NDIM = 8
CHUNK_LOOKUPS = 64  # single chunk-index lookups before reading the whole index instead
DATA_CHUNK = 1 << 20  # larger chunks write no faster here and bloat small traces

# dataset path -> (dtype, chunk length); every one is 1-D and grows along axis 0
RECORD_COLUMNS: dict[str, np.dtype] = {
    "name": np.dtype(np.int32),
    "seq_no": np.dtype(np.int64),
    "step": np.dtype(np.int64),
    "rank": np.dtype(np.int32),
    "depth": np.dtype(np.int32),
    "dtype": np.dtype(np.int32),
    "static": np.dtype(np.uint8),
    "ndim": np.dtype(np.int32),
    "data_offset": np.dtype(np.int64),
    "data_nbytes": np.dtype(np.int64),
    "row_start": np.dtype(np.int64),
    "n_rows": np.dtype(np.int64),
}
ROW_COLUMNS: dict[str, np.dtype] = {
    "request": np.dtype(np.int32),
    "position": np.dtype(np.int64),
    "token_id": np.dtype(np.int64),
}


def _append(dset: h5py.Dataset, values: np.ndarray) -> int:
    start = dset.shape[0]
    if len(values):
        dset.resize((start + len(values),) + dset.shape[1:])
        dset[start:] = values
    return start


class StringTable:
    """Interned strings (names, dtype tags, request ids) as one byte blob plus end offsets."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.pending: list[bytes] = []

    def intern(self, text: str) -> int:
        sid = self.ids.get(text)
        if sid is None:
            sid = self.ids[text] = len(self.ids)
            self.pending.append(text.encode())
        return sid

    def flush(self, group: h5py.Group) -> None:
        if not self.pending:
            return
        base = group["bytes"].shape[0]
        ends = base + np.cumsum([len(b) for b in self.pending], dtype=np.int64)
        _append(group["bytes"], np.frombuffer(b"".join(self.pending), dtype=np.uint8))
        _append(group["ends"], ends)
        self.pending = []


class H5Writer:
    """Appends batches of records; each ``write`` ends with a SWMR flush."""

    def __init__(self, path: str | Path, meta: dict, compression: str | None = None) -> None:
        self.path = Path(path)
        if compression not in (None, "gzip", "lzf"):
            raise ValueError(f"HDF5 traces compress with 'gzip' or 'lzf', not {compression!r}")
        f = self._file = h5py.File(self.path, "w", libver="latest")
        f.attrs["format"] = FORMAT_NAME
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["meta"] = dumps_meta(meta)
        grow = dict(maxshape=(None,), chunks=(1024,))
        for key, dtype in RECORD_COLUMNS.items():
            f.create_dataset(f"records/{key}", (0,), dtype=dtype, **grow)
        f.create_dataset("records/shape", (0, MAX_NDIM), dtype=np.int64, maxshape=(None, MAX_NDIM),
                         chunks=(1024, MAX_NDIM))
        for key, dtype in ROW_COLUMNS.items():
            f.create_dataset(f"rows/{key}", (0,), dtype=dtype, maxshape=(None,), chunks=(8192,))
        f.create_dataset("strings/bytes", (0,), dtype=np.uint8, maxshape=(None,), chunks=(8192,))
        f.create_dataset("strings/ends", (0,), dtype=np.int64, **grow)
        f.create_dataset("data", (0,), dtype=np.uint8, maxshape=(None,), chunks=(DATA_CHUNK,),
                         compression=compression)
        f.create_dataset("final", (0,), dtype=np.uint8, maxshape=(None,), chunks=(4096,))
        f.swmr_mode = True
        self._strings = StringTable()

    def write(self, records: Sequence[Record]) -> None:
        if not records:
            return
        f = self._file
        columns: dict[str, list] = {key: [] for key in RECORD_COLUMNS}
        shapes = np.full((len(records), MAX_NDIM), -1, dtype=np.int64)
        for r in records:
            if r.data.ndim > MAX_NDIM:
                raise ValueError(f"{r.name}: {r.data.ndim} dims; the HDF5 format holds at most {MAX_NDIM}")
        raws = [np.ascontiguousarray(r.data).reshape(-1).view(np.uint8) for r in records]
        data = f["data"]
        data_end = data.shape[0]
        data.resize((data_end + sum(raw.nbytes for raw in raws),))
        row_end = f["rows/position"].shape[0]
        requests, positions, tokens = [], [], []
        for i, (r, raw) in enumerate(zip(records, raws)):
            if raw.nbytes:
                data[data_end : data_end + raw.nbytes] = raw
            shapes[i, : r.data.ndim] = r.data.shape
            requests.append(np.fromiter((self._strings.intern(q) for q in r.request), np.int32,
                                        count=len(r.request)))
            positions.append(r.position)
            tokens.append(r.token_id)
            values = dict(name=self._strings.intern(r.name), seq_no=r.seq_no, step=r.step,
                          rank=r.rank, depth=r.depth, dtype=self._strings.intern(r.dtype),
                          static=int(r.static), ndim=r.data.ndim, data_offset=data_end,
                          data_nbytes=raw.nbytes, row_start=row_end, n_rows=len(r.position))
            for key, value in values.items():
                columns[key].append(value)
            data_end += raw.nbytes
            row_end += len(r.position)
        # Order matters for readers of a killed file: payloads first, the index that points at them last.
        for key, parts in (("request", requests), ("position", positions), ("token_id", tokens)):
            _append(f[f"rows/{key}"], np.concatenate(parts).astype(ROW_COLUMNS[key], copy=False))
        self._strings.flush(f["strings"])
        _append(f["records/shape"], shapes)
        for key, dtype in RECORD_COLUMNS.items():
            _append(f[f"records/{key}"], np.asarray(columns[key], dtype=dtype))
        f.flush()

    def sync(self) -> None:
        self._file.flush()
        _fsync_path(self.path)

    def abort(self) -> None:
        """Let go of the file after a failed write; what was flushed before stays readable."""
        try:
            self._file.close()
        except Exception:
            pass

    def close(self, final: dict) -> None:
        _append(self._file["final"], np.frombuffer(dumps_meta(final).encode(), dtype=np.uint8))
        self._file.close()
        _fsync_path(self.path)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class H5TraceFile:
    """Reads one HDF5 trace: the whole index up front, tensors on demand."""

    def __init__(self, path: Path, part: int = 0) -> None:
        self.path = path
        self._file = _open_h5(path)
        f = self._file
        self._fd = os.open(path, os.O_RDONLY)
        if f.attrs.get("format") != FORMAT_NAME:
            f.close()
            raise TraceError(path, "not a tracediff trace (HDF5 file without format='tracediff')")
        self.version = int(f.attrs.get("format_version", 0))
        check_version(path, self.version, close=f.close)
        self.meta = json.loads(f.attrs.get("meta", "{}"))
        final = f["final"][:] if "final" in f else np.empty(0, np.uint8)
        self.final = json.loads(final.tobytes()) if len(final) else None
        self.complete = self.final is not None
        self.index, self.token_slots = self._build_index(part)

    def _build_index(self, part: int) -> tuple[RecordIndex, np.ndarray]:
        """The tensor records' index and the slots of the ``__tokens__`` records."""
        f = self._file
        try:
            cols = {key: f[f"records/{key}"][:] for key in RECORD_COLUMNS}
            shapes = f["records/shape"][:]
            ends = f["strings/ends"][:]
            blob = f["strings/bytes"][:].tobytes()
            n_data, n_rows = f["data"].shape[0], f["rows/position"].shape[0]
        except KeyError as exc:
            raise TraceError(self.path, f"HDF5 trace lacks dataset {exc}") from None
        starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        strings = [blob[s:e].decode() for s, e in zip(starts, ends)]
        # A killed writer may have grown some columns further than others: keep what is whole.
        n = min(len(shapes), *(len(c) for c in cols.values()))
        whole = ((cols["data_offset"][:n] + cols["data_nbytes"][:n] <= n_data)
                 & (cols["row_start"][:n] + cols["n_rows"][:n] <= n_rows)
                 & (cols["name"][:n] < len(strings)) & (cols["dtype"][:n] < len(strings)))
        n = int(np.argmin(whole)) if not whole.all() else n
        cols = {k: v[:n] for k, v in cols.items()}
        self._strings = np.array(strings, dtype=object)
        self._cols = cols
        self._rows = {key: f[f"rows/{key}"] for key in ROW_COLUMNS}
        self._data = f["data"]
        self._chunk = self._data.chunks[0]
        self._raw_chunks = self._data.id.get_create_plist().get_nfilters() == 0
        self._chunk_at: dict[int, int | None] = {}
        self._all_chunks = False
        self._key_columns: dict[str, np.ndarray] | None = None
        return RecordIndex.tensors_of(part, {
            **{k: cols[k] for k in ("seq_no", "step", "rank", "depth")},
            "name": [strings[i] for i in cols["name"]],
            "dtype": [strings[i] for i in cols["dtype"]],
            "static": cols["static"].astype(bool),
            "n_rows": np.where(cols["static"] > 0, 0, cols["n_rows"]),
            "nbytes": cols["data_nbytes"],
            "shape": [s[:d] for s, d in zip(shapes[:n].tolist(), cols["ndim"].tolist())],
        })

    def _chunk_offset(self, index: int) -> int | None:
        """File offset of data chunk ``index`` (None if never written), from HDF5's own chunk index:
        looked up one by one for a few reads (one step), read whole in one pass for many (one name)."""
        if index in self._chunk_at:
            return self._chunk_at[index]
        if not self._all_chunks and len(self._chunk_at) < CHUNK_LOOKUPS:
            self._chunk_at[index] = self._data.id.get_chunk_info_by_coord((index * self._chunk,)).byte_offset
            return self._chunk_at[index]
        return self._every_chunk().get(index)

    def _every_chunk(self) -> dict[int, int | None]:
        """Chunk index -> file offset of every written chunk, from one pass over HDF5's index."""
        if not self._all_chunks:
            found = self._chunk_at

            def note(info) -> None:
                found[info.chunk_offset[0] // self._chunk] = info.byte_offset

            self._data.id.chunk_iter(note)
            self._all_chunks = True
        return self._chunk_at

    def _file_ranges(self, slot: int, offset: int, n: int) -> list[tuple[int, int]]:
        """(file offset, length) pieces of bytes [offset, offset + n) of a record, one per chunk they
        span, while the chunks are unfiltered and written; the rest (if any) must go through HDF5."""
        start = int(self._cols["data_offset"][slot]) + offset
        ranges, done = [], 0
        while self._raw_chunks and done < n:
            index, within = divmod(start + done, self._chunk)
            at = self._chunk_offset(index)
            if at is None:
                break
            take = min(self._chunk - within, n - done)
            ranges.append((at + within, take))
            done += take
        return ranges

    def data_offsets(self) -> np.ndarray:
        """File offset of every record's bytes where they lie contiguous and unfiltered in the file,
        else -1: records whose chunks all sit at their offsets from one common base."""
        start, n = self._cols["data_offset"], self._cols["data_nbytes"]
        if not self._raw_chunks or not len(start):
            return np.full(len(start), -1, dtype=np.int64)
        count = int(((start + n + self._chunk - 1) // self._chunk).max(initial=0))
        at = np.full(count + 1, -1, dtype=np.int64)
        for index, offset in self._every_chunk().items():
            if 0 <= index <= count and offset is not None:
                at[index] = offset
        # a chunk continues the previous one when it sits right after it in the file
        shift = np.where(at >= 0, at - np.arange(count + 1) * self._chunk, -1)
        breaks = np.cumsum(np.r_[1, (shift[1:] != shift[:-1]) | (shift[1:] < 0)])
        first = start // self._chunk
        last = np.maximum(start + n - 1, start) // self._chunk
        whole = (breaks[first] == breaks[last]) & (at[first] >= 0)
        return np.where(whole, at[first] + start % self._chunk, -1)

    def prefetch(self, slot: int, offset: int = 0, n: int | None = None) -> None:
        n = int(self._cols["data_nbytes"][slot]) - offset if n is None else n
        for at, length in self._file_ranges(slot, offset, n):
            prefetch(self._fd, at, length)

    def read_into(self, slot: int, out: np.ndarray, offset: int = 0) -> None:
        """Copy bytes [offset, offset + out.nbytes) of a record into ``out``; unfiltered chunks are
        read with pread, bypassing HDF5's per-call overhead (each chunk's file offset comes from
        HDF5's own chunk index)."""
        done = 0
        for at, length in self._file_ranges(slot, offset, out.nbytes):
            pread_into(self._fd, out[done : done + length], at)
            done += length
        if done < out.nbytes:
            start = int(self._cols["data_offset"][slot]) + offset
            self._data.read_direct(out[done:], np.s_[start + done : start + out.nbytes])

    def read_raw(self, slot: int) -> np.ndarray:
        out = np.empty(int(self._cols["data_nbytes"][slot]), dtype=np.uint8)
        self.read_into(slot, out)
        return out

    def read_keys(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of one record."""
        return self.read_keys_many(np.array([slot]))

    def read_keys_many(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of the given records, concatenated; the key
        columns are read from the file once, whole (a few bytes per row)."""
        if self._key_columns is None:
            n = int((self._cols["row_start"] + self._cols["n_rows"]).max(initial=0))
            self._key_columns = {key: self._rows[key][:n] for key in ("request", "position", "token_id")}
        starts, counts = self._cols["row_start"][slots], self._cols["n_rows"][slots]
        rows = np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        keys = self._key_columns
        return self._strings[keys["request"][rows]], keys["position"][rows], keys["token_id"][rows]

    def close(self) -> None:
        self._file.close()
        os.close(self._fd)


def _open_h5(path: Path) -> h5py.File:
    """Open read-only; a file whose writer never closed opens only in SWMR read mode."""
    try:
        return h5py.File(path, "r")
    except OSError as first:
        if "already open for write" not in str(first):
            raise TraceError(path, f"unreadable HDF5 (truncated or corrupt): {_h5_reason(first)}") from None
    try:
        return h5py.File(path, "r", swmr=True)
    except OSError as second:
        raise TraceError(path, f"unreadable HDF5 (writer died mid-file): {_h5_reason(second)}") from None


def _h5_reason(exc: OSError) -> str:
    text = str(exc)
    return text[text.find("(") + 1 : -1] if text.endswith(")") and "(" in text else text
