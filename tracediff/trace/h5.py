"""HDF5 physical format: columnar record index, per-row key columns and one raw data blob.

Written in SWMR mode (single writer, multiple readers): every dataset exists from the start
and only grows, and each ``write`` ends with a flush, so a writer killed at any moment leaves
a file that opens (with ``swmr=True``) up to its last flush. Layout: docs/FORMAT.md.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import stat
import tempfile
import time
from glob import escape as glob_escape
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np

from tracediff.errors import TraceError
from tracediff.trace.checks import (
    MAX_CHUNK_BYTES,
    MAX_META_BYTES,
    RecordShapes,
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
from tracediff.trace.h5attrs import SIGNATURE, root_attributes
from tracediff.trace.schema import (
    CHECKSUMS_SINCE,
    FORMAT_NAME,
    FORMAT_VERSION,
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
from tracediff.trace.storage import H5, TraceFile, describe, register, trace_errors

CHUNK_LOOKUPS = 64  # single chunk-index lookups before reading the whole index instead
SUPERBLOCK_ONLY = 96  # bytes: an HDF5 file no larger holds at most its superblock (no trace)
DIRECT_BYTES = 1 << 20  # a record this large is written from its own buffer; smaller ones are joined
COMPACT_BELOW = 16 << 20  # a closed trace whose datasets hold less is rewritten compact

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
# Format version 3 on: per record, the CRC32 of its bytes, of its own key columns and of its rows' keys
# (the columns of records/checksums)
CRC_COLUMNS = ("data_crc", "record_crc", "rows_crc")
ROW_COLUMNS: dict[str, np.dtype] = {
    "request": np.dtype(np.int32),
    "position": np.dtype(np.int64),
    "token_id": np.dtype(np.int64),
}
# Every dataset: (dtype, width of its rows or None for 1-D, chunk length while the trace is written).
# HDF5 allocates a whole chunk for the first byte written into it. Large chunks keep a large trace's
# data chunks one after the other in the file (compare reads bfloat16 rows in place there; small
# chunks interleave with HDF5's chunk-index blocks and the other datasets' chunks, and records that
# span a gap must be copied), at ~1.3 MB for the first chunks: a closed trace smaller than
# COMPACT_BELOW is rewritten with one chunk per dataset (_rewrite_compact).
DATASETS: dict[str, tuple[np.dtype, int | None, int]] = {
    **{f"records/{key}": (dtype, None, 1024) for key, dtype in RECORD_COLUMNS.items()},
    "records/shape": (np.dtype(np.int64), MAX_NDIM, 1024),
    "records/checksums": (np.dtype(np.uint32), len(CRC_COLUMNS), 1024),
    **{f"rows/{key}": (dtype, None, 8192) for key, dtype in ROW_COLUMNS.items()},
    "strings/bytes": (np.dtype(np.uint8), None, 8192),
    "strings/ends": (np.dtype(np.int64), None, 1024),
    "data": (np.dtype(np.uint8), None, 1 << 20),
    "final": (np.dtype(np.uint8), None, 4096),
    "final_crc": (np.dtype(np.uint32), None, 1),  # the CRC32 of "final", written just before it
}


def _create(f: h5py.File, name: str, chunk: int, compression: str | None,
            data: np.ndarray | None = None) -> h5py.Dataset:
    """One dataset of the layout, empty or holding ``data``, without a chunk cache (1 byte: h5py
    ignores 0). With HDF5's default cache a writer's memory grew by ~100 bytes a record over a long
    run (chunk caches and free lists, up to ~8 MB a dataset); without, it stays flat, a write reads
    a partial last chunk back from the page cache, and the data's chunks reach the file in the write
    that fills them: a full disk fails that write rather than a later flush (HDF5 cannot close a
    file whose metadata flush failed: see ``H5Writer.abort``)."""
    dtype, width, _ = DATASETS[name]
    tail = () if width is None else (width,)
    shape = (0, *tail) if data is None else data.shape
    return f.create_dataset(name, shape, dtype=dtype, data=data, maxshape=(None, *tail),
                            chunks=(chunk, *tail), compression=compression if name == "data" else None,
                            rdcc_nbytes=1)


def _write_attrs(f: h5py.File, meta_text: str) -> None:
    f.attrs["format"] = FORMAT_NAME
    f.attrs["format_version"] = FORMAT_VERSION
    f.attrs["meta"] = meta_text
    f.attrs["meta_crc32"] = np.int64(crc32(meta_text.encode()))


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

    def intern_all(self, texts: Iterable[str], count: int) -> np.ndarray:
        """Ids of many strings at once (one dict lookup each; new ones interned)."""
        ids = self.ids
        return np.fromiter((ids[t] if t in ids else self.intern(t) for t in texts), np.int32, count=count)

    def flush(self, blob: h5py.Dataset, ends: h5py.Dataset) -> None:
        if not self.pending:
            return
        base = blob.shape[0]
        _append(blob, np.frombuffer(b"".join(self.pending), dtype=np.uint8))
        _append(ends, base + np.cumsum([len(b) for b in self.pending], dtype=np.int64))
        self.pending = []


class H5Writer:
    """Appends batches of records; each ``write`` is one append per dataset, then a SWMR flush."""

    def __init__(self, path: str | Path, meta: dict, compression: str | None = None) -> None:
        self.path = Path(path).absolute()  # the host may change directory while recording
        if compression not in (None, "gzip", "lzf"):
            raise ValueError(f"HDF5 traces compress with 'gzip' or 'lzf', not {compression!r}")
        self._compression = compression
        self._meta_text = dumps_meta(meta)
        _remove_stranded(self.path)
        f = self._file = h5py.File(self.path, "w", libver="latest")
        _write_attrs(f, self._meta_text)
        self._datasets = {name: _create(f, name, chunk, compression)
                          for name, (_, _, chunk) in DATASETS.items()}
        f.swmr_mode = True
        self._strings = StringTable()
        opened = os.stat(self.path)
        self._identity = (opened.st_dev, opened.st_ino)  # the file we write, whatever takes its path later

    def write(self, records: Sequence[Record]) -> None:
        """One append per dataset for the whole batch, whatever the number of records: a flood of
        tiny records costs numpy work per record, not HDF5 calls."""
        if not records:
            return
        n = len(records)
        shapes = np.full((n, MAX_NDIM), -1, dtype=np.int64)
        for i, r in enumerate(records):
            if r.data.ndim > MAX_NDIM:
                raise ValueError(f"{r.name}: {r.data.ndim} dims; the HDF5 format holds at most {MAX_NDIM}")
            shapes[i, : r.data.ndim] = r.data.shape
        raws = [np.ascontiguousarray(r.data).reshape(-1).view(np.uint8) for r in records]
        nbytes = np.fromiter((raw.nbytes for raw in raws), np.int64, count=n)
        n_rows = np.fromiter((len(r.position) for r in records), np.int64, count=n)
        data = self._datasets["data"]
        data_end, row_end = data.shape[0], self._datasets["rows/position"].shape[0]
        strings = self._strings
        columns = {
            "name": strings.intern_all((r.name for r in records), n),
            "seq_no": np.fromiter((r.seq_no for r in records), np.int64, count=n),
            "step": np.fromiter((r.step for r in records), np.int64, count=n),
            "rank": np.fromiter((r.rank for r in records), np.int32, count=n),
            "depth": np.fromiter((r.depth for r in records), np.int32, count=n),
            "dtype": strings.intern_all((r.dtype for r in records), n),
            "static": np.fromiter((r.static for r in records), np.uint8, count=n),
            "ndim": (shapes >= 0).sum(axis=1, dtype=np.int32),
            "data_offset": data_end + np.cumsum(nbytes) - nbytes,
            "data_nbytes": nbytes,
            "row_start": row_end + np.cumsum(n_rows) - n_rows,
            "n_rows": n_rows,
        }
        total_rows = int(n_rows.sum())
        rows = {
            "request": strings.intern_all(itertools.chain.from_iterable(r.request for r in records),
                                          total_rows),
            "position": _joined([r.position for r in records], np.int64, total_rows),
            "token_id": _joined([r.token_id for r in records], np.int64, total_rows),
        }
        sums = batch_checksums(records)
        # Order matters for readers of a killed or live file: what is pointed at before what points at
        # it (strings, then the data and rows that name them), the index that points at them last.
        strings.flush(self._datasets["strings/bytes"], self._datasets["strings/ends"])
        self._write_data(data, raws, data_end, int(nbytes.sum()))
        for key, values in rows.items():
            _append(self._datasets[f"rows/{key}"], values)
        _append(self._datasets["records/shape"], shapes)
        _append(self._datasets["records/checksums"], sums)
        for key in RECORD_COLUMNS:
            _append(self._datasets[f"records/{key}"], columns[key])
        self._file.flush()

    @staticmethod
    def _write_data(data: h5py.Dataset, raws: list[np.ndarray], start: int, total: int) -> None:
        """Grow ``data`` once and fill it: runs of small records joined into one write each (one
        copy, no HDF5 call per record), large records straight from their buffers (no copy)."""
        if not total:
            return
        data.resize((start + total,))
        run: list[np.ndarray] = []
        run_start = at = start
        for raw in raws:
            if raw.nbytes >= DIRECT_BYTES:
                _write_run(data, run, run_start)
                data[at : at + raw.nbytes] = raw
                run, run_start = [], at + raw.nbytes
            elif raw.nbytes:
                run.append(raw)
            at += raw.nbytes
            if at - run_start >= DIRECT_BYTES:
                _write_run(data, run, run_start)
                run, run_start = [], at
        _write_run(data, run, run_start)

    def sync(self) -> None:
        self._file.flush()
        _fsync_path(self.path)

    def abort(self) -> None:
        """Let go of the file after a failed write, leaving it as last flushed: what HDF5 still holds
        of the failed write is flushed into an unlinked scratch file instead. A close whose flush
        fails (a full disk) would leave the file open in this library for good, and a reader of the
        same file in this process would share that broken state (HDF5 shares open files)."""
        try:
            _redirect(self._file)
            self._file.close()
            return
        except Exception:
            pass
        try:  # no scratch file to be had: close as is
            self._file.close()
        except Exception:
            pass

    def forked(self) -> None:
        """Point this process's copy of the file's descriptor at an unlinked scratch file: HDF5
        flushes the files it holds open when the library shuts down at exit, and in a forked child
        that would write the parent's metadata, as it stood at the fork, into the parent's trace."""
        _redirect(self._file)

    def close(self, final: dict) -> None:
        text = dumps_meta(final).encode()
        _append(self._datasets["final_crc"], np.array([crc32(text)], dtype=np.uint32))
        _append(self._datasets["final"], np.frombuffer(text, dtype=np.uint8))
        stored = sum(d.size * d.dtype.itemsize for d in self._datasets.values())
        values = {name: d[:] for name, d in self._datasets.items()} if stored < COMPACT_BELOW else None
        self._file.close()
        _fsync_path(self.path)
        if values is not None:
            _rewrite_compact(self.path, self._identity, self._meta_text, values, self._compression)


def _redirect(f: h5py.File) -> None:
    """Point HDF5's descriptor of an open file at a scratch file in memory (a regular file: HDF5 may
    truncate it), so that what HDF5 still writes there never reaches the trace."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        scratch = memfd("tracediff-scratch")
    else:  # not Linux
        scratch, name = tempfile.mkstemp(prefix="tracediff-scratch-")
        os.unlink(name)
    try:
        os.dup2(scratch, f.id.get_vfd_handle())
    finally:
        os.close(scratch)


def _rewrite_compact(path: Path, identity: tuple[int, int], meta_text: str, values: dict[str, np.ndarray],
                     compression: str | None) -> None:
    """Put a copy of a small closed trace with one chunk per dataset (its exact size) in its place,
    in one rename: the file then weighs what it holds. Only while the path still names the file
    written (``identity``: device and inode; a file the user put there since is never replaced),
    not through a link (the rename would replace the link, not the file it names), and only for a
    file the copy would not change otherwise (its owner, extended attributes); a failure leaves the
    original, whole and closed."""
    try:
        before = os.lstat(path)
        if (before.st_dev, before.st_ino) != identity or not stat.S_ISREG(before.st_mode) \
                or before.st_nlink != 1 or (before.st_uid, before.st_gid) != (os.getuid(), os.getgid()) \
                or _has_xattrs(path):
            return
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".compact")
    except OSError:
        return
    os.close(fd)
    tmp = Path(name)
    try:
        with h5py.File(tmp, "w", libver="latest") as f:
            _write_attrs(f, meta_text)
            for dataset, array in values.items():
                _create(f, dataset, max(1, len(array)), compression, data=array)
        os.chmod(tmp, stat.S_IMODE(before.st_mode))
        _fsync_path(tmp)
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != identity:
            raise OSError("the path names another file now")
        os.replace(tmp, path)
        _fsync_path(path.parent)
    except Exception:
        tmp.unlink(missing_ok=True)


STRANDED_AGE = 600  # seconds after which a compaction copy that names no process is taken as stranded


def _remove_stranded(path: Path) -> None:
    """Remove the compaction copies (``.NAME.PID.XXXXXXXX.compact``) of this trace that a writer
    killed while compacting left beside it: those whose process is gone, and unnamed ones (an older
    tracediff's ``.NAME.XXXXXXXX.compact``) untouched for STRANDED_AGE. A live writer's copy stays."""
    try:
        candidates = list(Path(path).absolute().parent.glob(f".{glob_escape(Path(path).name)}.*.compact"))
    except OSError:
        return
    prefix = f".{Path(path).name}."
    for copy in candidates:
        middle = copy.name[len(prefix): -len(".compact")].split(".")
        try:
            if len(middle) == 2 and middle[0].isdigit():
                if _alive(int(middle[0])):
                    continue
            elif len(middle) != 1 or time.time() - os.lstat(copy).st_mtime < STRANDED_AGE:
                continue
            if stat.S_ISREG(os.lstat(copy).st_mode):
                copy.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _has_xattrs(path: Path) -> bool:
    """Whether the file carries extended attributes (a copy would lose them); False where the
    system or file system has none."""
    try:
        return bool(os.listxattr(path)) if hasattr(os, "listxattr") else False
    except OSError:
        return False


def _joined(parts: list[np.ndarray], dtype: type, count: int) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(count, dtype)


def _write_run(data: h5py.Dataset, run: list[np.ndarray], start: int) -> None:
    if run:
        joined = run[0] if len(run) == 1 else np.concatenate(run)
        data[start : start + joined.nbytes] = joined


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class H5TraceFile(TraceFile):
    """Reads one HDF5 trace: the whole index up front (checked against the file), tensors on demand.

    A closed file (final metadata present) is read strictly: every column and record must agree
    with the others and with the final metadata. A file whose writer was killed keeps the longest
    prefix of records that are whole and sound."""

    def __init__(self, path: Path, part: int = 0, verify: bool = True) -> None:
        self.path = path
        self.verify = verify
        self.meta_sums: list[MetaSum] = []
        self._fd = -1
        _remove_stranded(path)
        self._file = _open_h5(path)
        try:
            self._fd = os.open(path, os.O_RDONLY)
            self._size = os.fstat(self._fd).st_size
            self._load(part)
        except BaseException:
            self.close()
            raise

    @trace_errors
    def _load(self, part: int) -> None:
        attrs = root_attributes(self.path)
        if attrs.get("format") != FORMAT_NAME.encode():
            raise TraceError(self.path, "not a tracediff trace (HDF5 file without format='tracediff')")
        self.version = format_version(self.path, attrs.get("format_version"))
        check_version(self.path, self.version, close=lambda: None)
        meta = attrs.get("meta", b"{}")
        if not isinstance(meta, bytes):
            raise TraceError(self.path, f"run metadata is {meta}, not a string")
        self.meta = run_meta(self.path, meta)
        checksummed = self.version >= CHECKSUMS_SINCE  # checked once the rules of metadata hold
        if checksummed:
            self.meta_sums.append(MetaSum(meta, attrs.get("meta_crc32"), "run metadata"))
        final = self._column("final", np.dtype(np.uint8))
        if len(final) > MAX_META_BYTES:
            raise TraceError(self.path, f"final metadata of {len(final)} bytes; a trace holds at most "
                                        f"{MAX_META_BYTES}")
        final_text = final[:].tobytes() if len(final) else b""
        self.final = final_meta(self.path, final_text) if len(final) else None
        if checksummed and len(final):
            stored = self._column("final_crc", np.dtype(np.uint32))
            self.meta_sums.append(MetaSum(final_text, int(stored[0]) if self._length(stored) else None,
                                          "final metadata"))
        if self.verify:
            self.check_metadata()
        self.index, self.token_slots = self._build_index(part)
        check_record_count(self.path, self.final, len(self.index))

    @property
    def complete(self) -> bool:
        return self.final is not None

    def _column(self, name: str, dtype: np.dtype, width: int | None = None) -> h5py.Dataset:
        """A dataset of the layout, checked to be what FORMAT.md says before anything is read."""
        dset: h5py.Group | h5py.Dataset = self._file
        for part in name.split("/"):  # hard links only: a soft or external link could lead anywhere
            link = dset.get(part, getlink=True) if isinstance(dset, h5py.Group) else None
            if not isinstance(dset, h5py.Group) or not isinstance(link, h5py.HardLink):
                raise TraceError(self.path, f"HDF5 trace lacks dataset '{name}'")
            dset = dset[part]
        ndim = 1 if width is None else 2
        if not isinstance(dset, h5py.Dataset) or dset.dtype != dtype or dset.ndim != ndim \
                or (width is not None and dset.shape[1] != width):
            what = "a group" if not isinstance(dset, h5py.Dataset) else f"{dset.dtype} {list(dset.shape)}"
            raise TraceError(self.path, f"dataset '{name}' is {what}; the format has {dtype} "
                                        f"{'[n]' if width is None else f'[n, {width}]'}")
        if dset.chunks is None:
            raise TraceError(self.path, f"dataset '{name}' is contiguous; trace datasets are chunked "
                                        "(they grow)")
        chunk_bytes = int(np.prod(dset.chunks, dtype=np.int64)) * dset.dtype.itemsize
        if chunk_bytes > MAX_CHUNK_BYTES and dset.id.get_create_plist().get_nfilters():
            raise TraceError(self.path, f"dataset '{name}' has compressed chunks of {chunk_bytes} bytes; "
                                        "HDF5 decompresses a whole chunk to read any of it, and a reader "
                                        f"takes chunks of at most {MAX_CHUNK_BYTES} (tracediff writes 1 MiB)")
        return dset

    def _length(self, dset: h5py.Dataset) -> int:
        """Entries of an index dataset that the file can hold: a closed file must hold all it declares."""
        row = int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
        held = self._size // row
        if dset.shape[0] > held:
            if self.complete:
                raise TraceError(self.path, f"dataset '{dset.name.lstrip('/')}' declares {dset.shape[0]} "
                                            f"entries, more than the file's {self._size} bytes can hold")
            return held
        return int(dset.shape[0])

    def _strings(self) -> list[str]:
        ends_d = self._column("strings/ends", np.dtype(np.int64))
        bytes_d = self._column("strings/bytes", np.dtype(np.uint8))
        ends, blob = ends_d[: self._length(ends_d)], bytes_d[: self._length(bytes_d)].tobytes()
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        sound = (starts >= 0) & (ends >= starts) & (ends <= len(blob))
        whole = len(ends) if sound.all() else int(np.argmin(sound))
        if self.complete and (whole < len(ends) or (len(ends) and ends[-1] != len(blob))):
            problem = (f"string table entry {whole} lies outside strings/bytes ({len(blob)} bytes)"
                       if whole < len(ends) else f"strings/bytes holds {len(blob)} bytes, its table ends at "
                                                 f"{ends[-1]}")
            raise TraceError(self.path, problem)
        strings = []
        for i, (s, e) in enumerate(zip(starts[:whole].tolist(), ends[:whole].tolist())):
            try:
                strings.append(blob[s:e].decode("utf-8"))
            except UnicodeDecodeError:
                raise TraceError(self.path, f"string table entry {i} is not UTF-8 text") from None
        return strings

    def _build_index(self, part: int) -> tuple[RecordIndex, np.ndarray]:
        """The tensor records' index and the slots of the ``__tokens__`` records."""
        # The index first, what it points at after: a writer appends in the other order (strings,
        # data, rows, the index last), so a live trace read this way has all its index names.
        columns = {key: self._column(f"records/{key}", dtype) for key, dtype in RECORD_COLUMNS.items()}
        checks_d = self._column("records/checksums", np.dtype(np.uint32), len(CRC_COLUMNS)) \
            if self.version >= CHECKSUMS_SINCE else None
        shape_d = self._column("records/shape", np.dtype(np.int64), MAX_NDIM)
        rows_d = {key: self._column(f"rows/{key}", dtype) for key, dtype in ROW_COLUMNS.items()}
        data = self._column("data", np.dtype(np.uint8))
        strings = self._strings()
        sized = (*columns.values(), shape_d, *((checks_d,) if checks_d is not None else ()))
        lengths = [self._length(d) for d in sized]
        row_lengths = [self._length(d) for d in rows_d.values()]
        if self.complete and (len(set(lengths)) > 1 or len(set(row_lengths)) > 1):
            raise TraceError(self.path, "the records/* (or rows/*) datasets differ in length "
                                        f"({min(lengths)}..{max(lengths)} records, {min(row_lengths)}.."
                                        f"{max(row_lengths)} rows)")
        n, n_rows = min(lengths), min(row_lengths)
        raw = data.id.get_create_plist().get_nfilters() == 0
        # Unfiltered bytes all lie in the file. Filtered ones may declare more than the file (zeros
        # compress ~1000x): a record read costs its own bytes and one chunk (bounded above), never more.
        n_data = self._length(data) if raw else int(data.shape[0])
        cols = {key: d[:n] for key, d in columns.items()}
        shapes = shape_d[:n]
        faults = self._faults(cols, shapes, len(strings), n_rows, n_data, strings)
        fault = first_fault(faults, n)
        if fault is not None:
            if self.complete:
                refuse(self.path, fault)
            n = fault[0]  # a killed writer: keep the records before the first that is not whole
        if not self.complete:  # a live or killed trace: its last records may name strings not yet flushed
            n = self._named_rows(cols, n, rows_d["request"], n_rows, len(strings))
        cols = {k: v[:n] for k, v in cols.items()}
        if checks_d is not None:
            checks = checks_d[:n]
            cols.update({key: np.ascontiguousarray(checks[:, k]) for k, key in enumerate(CRC_COLUMNS)})
        self.data_crcs = cols.get("data_crc")
        self.record_crcs, self.rows_crcs = cols.get("record_crc"), cols.get("rows_crc")
        self._rows_verified = np.zeros(n, dtype=bool)
        if self.verify and self.data_crcs is not None:
            self._check_records(cols, shapes[:n], strings)
        self._strings_table = np.array(strings, dtype=object)
        self._cols = cols
        self._rows = rows_d
        self._data = data
        self._chunk = int(data.chunks[0])
        self._raw_chunks = raw
        self._chunk_at: dict[int, int | None] = {}
        self._all_chunks = False
        self._key_columns: dict[str, np.ndarray] | None = None
        ndim = cols["ndim"].tolist()
        return RecordIndex.tensors_of(part, {
            **{k: cols[k] for k in ("seq_no", "step", "rank", "depth")},
            "name": [strings[i] for i in cols["name"].tolist()],
            "dtype": [strings[i] for i in cols["dtype"].tolist()],
            "static": cols["static"].astype(bool),
            "n_rows": np.where(cols["static"] > 0, 0, cols["n_rows"]),
            "nbytes": cols["data_nbytes"],
            "shape": [s[:d] for s, d in zip(shapes[:n].tolist(), ndim)],
        })

    @staticmethod
    def _named_rows(cols: dict[str, np.ndarray], n: int, request_d: h5py.Dataset, n_rows: int,
                    n_strings: int) -> int:
        """The first ``n`` records cut before the first whose rows name a request string outside the
        table: rows of records whose strings were not flushed yet are unflushed data (a closed trace
        is held to its table strictly, when its rows are read)."""
        start, count = cols["row_start"][:n], cols["n_rows"][:n]
        end = int((start + count).max(initial=0))
        if not end:
            return n
        request = request_d[: min(end, n_rows)]
        bad = np.concatenate([[0], np.cumsum((request < 0) | (request >= n_strings))])
        named = bad[start + count] - bad[start]  # within n_rows: the faults above have checked
        return int(np.argmax(named > 0)) if named.any() else n

    def _check_records(self, cols: dict[str, np.ndarray], shapes: np.ndarray, strings: list[str]) -> None:
        """Refuse the first record whose own key columns fail their checksum."""
        fields = [cols[k].tolist() for k in ("name", "dtype", "seq_no", "step", "rank", "depth", "static",
                                              "ndim", "record_crc")]
        dims = shapes.tolist()
        for slot, (name, dtype, seq_no, step, rank, depth, static, ndim, stored) in enumerate(zip(*fields)):
            shape = dims[slot][:ndim]
            if record_crc(strings[name], strings[dtype], seq_no, step, rank, depth, static, shape) != stored:
                raise corrupt_record(self.path, slot, strings[name], step)

    def record_nbytes(self, slot: int) -> int:
        return int(self._cols["data_nbytes"][slot])

    def describe_slot(self, slot: int) -> tuple[str, int]:
        return str(self._strings_table[self._cols["name"][slot]]), int(self._cols["step"][slot])

    @staticmethod
    def _faults(cols: dict[str, np.ndarray], shapes: np.ndarray, n_strings: int, n_rows: int, n_data: int,
                strings: list[str]) -> list[tuple[np.ndarray, str]]:
        """Every way each record can be unsound, in the order they are judged."""
        ids = {key: cols[key].astype(np.int64) for key in ("name", "dtype")}
        known = {key: (v >= 0) & (v < n_strings) for key, v in ids.items()}
        sizes = np.append(itemsizes(strings), -1)  # an id outside the table has no itemsize
        itemsize = sizes[np.where(known["dtype"], ids["dtype"], n_strings)]
        static = cols["static"] > 0
        offset, nbytes = cols["data_offset"], cols["data_nbytes"]
        start, count = cols["row_start"], cols["n_rows"]
        declared = RecordShapes(itemsize, static, cols["ndim"].astype(np.int64), shapes, count, nbytes)
        return [
            (~known["name"], "a name id outside the string table"),
            (~known["dtype"], "a dtype id outside the string table"),
            (cols["static"] > 1, "a static flag that is neither 0 nor 1"),
            *declared.faults(),
            ((offset < 0) | (offset > n_data) | (nbytes > n_data - offset),
             f"data bytes outside the data dataset ({n_data} bytes)"),
            ((start < 0) | (count < 0) | (start > n_rows) | (count > n_rows - start),
             f"rows outside the rows/* datasets ({n_rows} rows)"),
        ]

    def _chunk_offset(self, index: int) -> int | None:
        """File offset of data chunk ``index`` (None if never written), from HDF5's own chunk index:
        looked up one by one for a few reads (one step), read whole in one pass for many (one name)."""
        if index in self._chunk_at:
            return self._chunk_at[index]
        if not self._all_chunks and len(self._chunk_at) < CHUNK_LOOKUPS:
            info = self._data.id.get_chunk_info_by_coord((index * self._chunk,))
            self._chunk_at[index] = self._checked(info)
            return self._chunk_at[index]
        return self._every_chunk().get(index)

    def _checked(self, info) -> int | None:
        """A chunk's file offset, once it is known to lie inside the file."""
        at = info.byte_offset
        if at is None:
            return None
        size = self._chunk if self._raw_chunks else int(info.size)
        if at < 0 or at + size > self._size or (self._raw_chunks and info.size != self._chunk):
            raise TraceError(self.path, f"a data chunk ({info.size} bytes at byte {at}) lies outside the "
                                        f"file ({self._size} bytes)")
        return int(at)

    def _every_chunk(self) -> dict[int, int | None]:
        """Chunk index -> file offset of every written chunk, from one pass over HDF5's index."""
        if not self._all_chunks:
            found: list = []
            self._data.id.chunk_iter(found.append)
            for info in found:
                self._chunk_at[info.chunk_offset[0] // self._chunk] = self._checked(info)
            self._all_chunks = True
        return self._chunk_at

    def _need_chunks(self, start: int, n: int) -> None:
        """Every chunk holding bytes [start, start + n) of the data dataset was written: a record of
        a trace never points at bytes its writer did not write."""
        for index in range(start // self._chunk, (start + n + self._chunk - 1) // self._chunk):
            if self._chunk_offset(index) is None:
                raise TraceError(self.path, f"data chunk {index} is missing, yet records point into it")

    def _file_ranges(self, slot: int, offset: int, n: int) -> list[tuple[int, int]]:
        """(file offset, length) pieces of bytes [offset, offset + n) of a record, one per run of
        chunks that lie one after the other in the file, where the chunks are unfiltered (else the
        bytes must go through HDF5)."""
        if offset < 0 or n < 0 or offset + n > int(self._cols["data_nbytes"][slot]):
            raise IndexError(f"bytes {offset}..{offset + n} of a record of {self._cols['data_nbytes'][slot]}")
        start = int(self._cols["data_offset"][slot]) + offset
        self._need_chunks(start, n)
        ranges: list[tuple[int, int]] = []
        done = 0
        while self._raw_chunks and done < n:
            index, within = divmod(start + done, self._chunk)
            at = self._chunk_offset(index)
            assert at is not None  # _need_chunks has checked
            take = min(self._chunk - within, n - done)
            if ranges and ranges[-1][0] + ranges[-1][1] == at + within:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + take)
            else:
                ranges.append((at + within, take))
            done += take
        return ranges

    @trace_errors
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

    @trace_errors
    def prefetch(self, slot: int, offset: int = 0, n: int | None = None) -> None:
        n = int(self._cols["data_nbytes"][slot]) - offset if n is None else n
        for at, length in self._file_ranges(slot, offset, n):
            prefetch(self._fd, at, length)

    @trace_errors
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

    @trace_errors
    def read_keys_many(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of the given records, concatenated; the key
        columns are read from the file once, whole (a few bytes per row)."""
        keys = self._keys()
        starts, counts = self._cols["row_start"][slots], self._cols["n_rows"][slots]
        rows = np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        request = self._strings_table[keys["request"][rows]]
        position, token_id = keys["position"][rows], keys["token_id"][rows]
        if self.verify and self.data_crcs is not None:
            self._check_rows(slots, counts, request, position, token_id)
        return request, position, token_id

    def _check_rows(self, slots: np.ndarray, counts: np.ndarray, request: np.ndarray, position: np.ndarray,
                    token_id: np.ndarray) -> None:
        """Refuse the first of these records whose rows' keys fail their checksum (each checked once)."""
        ends = np.cumsum(counts)
        stored = self._cols["rows_crc"]
        for slot, end, count in zip(slots.tolist(), ends.tolist(), counts.tolist()):
            if self._rows_verified[slot]:
                continue
            at = slice(end - count, end)
            if rows_crc(request[at], position[at], token_id[at]) != int(stored[slot]):
                raise corrupt_record(self.path, slot, *self.describe_slot(slot))
            self._rows_verified[slot] = True

    def _keys(self) -> dict[str, np.ndarray]:
        """The rows/* columns up to the last row a record holds, request ids checked."""
        if self._key_columns is None:
            n = int((self._cols["row_start"] + self._cols["n_rows"]).max(initial=0))
            keys = {key: self._rows[key][:n] for key in ROW_COLUMNS}
            request = keys["request"]
            bad = (request < 0) | (request >= len(self._strings_table))
            if bad.any():
                row = int(np.argmax(bad))
                raise TraceError(self.path, f"row {row} names request string {int(request[row])}, outside "
                                            f"the string table ({len(self._strings_table)} strings)")
            self._key_columns = keys
        return self._key_columns

    def close(self) -> None:
        self._file.close()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _open_h5(path: Path) -> h5py.File:
    """Open read-only; a file whose writer never closed opens only in SWMR read mode."""
    try:
        return h5py.File(path, "r")
    except OSError as first:
        if "already open for write" not in str(first):
            raise TraceError(path, _unreadable(path, first)) from None
    try:
        return _open_swmr(path)
    except OSError as second:
        raise TraceError(path, f"unreadable HDF5 (writer died mid-file): {_h5_reason(second)}") from None


SWMR_READ_ATTEMPTS = 8  # HDF5's default (100) retries a bad metadata checksum, sleeping, for minutes


def _open_swmr(path: Path) -> h5py.File:
    """SWMR read mode with few metadata read attempts: a corrupt killed trace fails in milliseconds
    instead of hanging ``show``. h5py does not expose the setting, so it is set through the HDF5
    library h5py loaded; where that library cannot be found, HDF5's default stands."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    set_attempts = _metadata_read_attempts_setter()
    if set_attempts is not None:
        set_attempts(fapl.id, SWMR_READ_ATTEMPTS)
    flags = h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ
    return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=fapl))


@functools.cache
def _metadata_read_attempts_setter():  # -> ctypes function or None
    """``H5Pset_metadata_read_attempts`` of the libhdf5 mapped into this process (h5py's own), or
    None (no /proc, or no such library)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if os.path.basename(line.split()[-1]).startswith("libhdf5") and "hl" not in
                            os.path.basename(line.split()[-1])})
        setter = ctypes.CDLL(paths[0]).H5Pset_metadata_read_attempts
    except (OSError, IndexError, AttributeError):
        return None
    setter.argtypes = [ctypes.c_int64, ctypes.c_uint]
    setter.restype = ctypes.c_int
    return setter


def _unreadable(path: Path, exc: OSError) -> str:
    """Why HDF5 cannot open the file; a writer killed while it created the file (before its first
    flush) leaves HDF5's superblock alone (48 bytes), which HDF5 calls a truncated file."""
    try:
        size = path.stat().st_size
    except OSError:
        size = SUPERBLOCK_ONLY + 1
    if size <= SUPERBLOCK_ONLY:
        return (f"no trace in it: {size} bytes, at most an HDF5 superblock (what a writer killed before its "
                "first write leaves)")
    return f"unreadable HDF5 (truncated or corrupt): {_h5_reason(exc)}"


def _h5_reason(exc: OSError) -> str:
    text = str(exc)
    return describe(text[text.find("(") + 1 : -1] if text.endswith(")") and "(" in text else text)


assert H5.magic == SIGNATURE  # the registry's declaration names the file format's signature
FORMAT = register(H5.format(writer=H5Writer, reader=H5TraceFile))
