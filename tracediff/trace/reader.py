"""open_trace: one entry point for every format and for traces split over rank files."""

from __future__ import annotations

import mmap
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from tracediff.errors import InputError, TraceError
from tracediff.trace.codes import factorize
from tracediff.trace.completeness import Completeness, completeness
from tracediff.trace.crc import crc32
from tracediff.trace.dtypes import decode, storage_dtype
from tracediff.trace.fileio import MADV_POPULATE_READ, advise
from tracediff.trace.schema import Record, RecordIndex, tokens_record
from tracediff.trace.storage import MAGIC_BYTES, TraceFile, by_magic, by_name

PREFETCH_MIN_BYTES = 1 << 20  # a gather of fewer bytes sends the kernel no read-ahead hints
PREFETCH = 16  # records read ahead by rows()
SPAN_GAP = 1 << 20
CRC_WINDOW = 16 << 20  # bytes of a record mapped at once while its checksum is computed in place


@dataclass(kw_only=True)
class KeyColumns:
    """Per-row keys of one tensor name: the columns alignment works from."""

    name: str
    dtype: str
    request: np.ndarray
    request_code: np.ndarray  # int64, equal for equal requests within one trace: cheap to sort and match
    position: np.ndarray
    token_id: np.ndarray
    step: np.ndarray
    depth: np.ndarray
    rank: np.ndarray

    def __len__(self) -> int:
        return len(self.position)


@dataclass(kw_only=True)
class TensorRows(KeyColumns):
    """All rows of one tensor name (optionally one step / request / depth), with their keys."""

    data: np.ndarray  # raw storage dtype, shape (n_rows, *row_shape)

    def numpy(self) -> np.ndarray:
        return decode(self.data, self.dtype)


@dataclass(kw_only=True)
class RowKeys(KeyColumns):
    """The keys of every row and where its bytes lie (record index position and row number
    inside it); no tensor data."""

    row_shape: tuple[int, ...]
    record: np.ndarray
    within: np.ndarray

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * storage_dtype(self.dtype).itemsize

    def take(self, rows: np.ndarray) -> RowKeys:
        return RowKeys(**{k: (v[rows] if isinstance(v, np.ndarray) else v) for k, v in vars(self).items()})


class MixedRecords(InputError, ValueError):
    """The records of one name differ in dtype or row shape: they cannot form one tensor (compare
    reports the name instead of comparing it; a command that needs the tensor says so in one line)."""

    def __init__(self, name: str, dtypes: list[str], row_shapes: list[tuple], path: str | Path = "") -> None:
        super().__init__(path, f"{name}: records differ in dtype or row shape (dtypes {dtypes}, "
                               f"row shapes {row_shapes}); one --step at a time reads them")
        self.name, self.dtypes, self.row_shapes = name, dtypes, row_shapes


@dataclass
class TokenTable:
    """The tokens a trace knows of each request (declared or learned from any log call), one
    entry per (request, position), sorted by request (first appearance) then position."""

    request: np.ndarray  # object (str)
    position: np.ndarray  # int64
    token_id: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.position)

    @classmethod
    def empty(cls) -> TokenTable:
        return cls(np.empty(0, dtype=object), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

    @classmethod
    def first_seen(cls, request: np.ndarray, position: np.ndarray, token_id: np.ndarray) -> TokenTable:
        """One entry per (request, position): the first in the order given wins."""
        if not len(position):
            return cls.empty()
        _, codes = factorize(request)
        order = np.lexsort((np.arange(len(position)), position, codes))
        c, p = codes[order], position[order]
        keep = order[np.r_[True, (c[1:] != c[:-1]) | (p[1:] != p[:-1])]]
        return cls(request[keep].astype(object), position[keep].astype(np.int64),
                   token_id[keep].astype(np.int64))

    def requests(self) -> list[str]:
        """The requests with known tokens, in table order."""
        return list(dict.fromkeys(self.request.tolist()))

    def sequence(self, request: str) -> tuple[np.ndarray, np.ndarray]:
        """(positions, token ids) known for one request, by position."""
        rows = self.request == request
        return self.position[rows], self.token_id[rows]


_CRC_POOL: ThreadPoolExecutor | None = None


def _crc_pool() -> ThreadPoolExecutor:
    """One thread that computes checksums of bytes already read while the next are read (zlib
    releases the GIL over large buffers)."""
    global _CRC_POOL
    if _CRC_POOL is None:
        _CRC_POOL = ThreadPoolExecutor(1, thread_name_prefix="tracediff-crc")
    return _CRC_POOL


class NotRegularFile(OSError):
    """A FIFO, socket or device where a file is read: a read would block, or never end."""


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of the regular file ``path``, opened without blocking: a FIFO (or a
    device) named as an input must be refused, not waited on. IsADirectoryError for a directory,
    ``NotRegularFile`` for the rest that is not a regular file, OSError as raised (a link loop)."""
    import errno
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise NotRegularFile("not a regular file (a FIFO, socket or device)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def detect_format(path: Path) -> str:
    """The format's name ('h5', 'arrow') by the file's magic bytes, whatever its extension."""
    import os

    try:
        fd = open_regular(path)
        try:
            head = os.read(fd, MAGIC_BYTES)
        finally:
            os.close(fd)
    except NotRegularFile as exc:
        raise TraceError(path, f"{exc}, not a trace file") from None
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(path, f"cannot read: {exc.strerror or exc}") from None
    fmt = by_magic(head)
    if fmt is not None:
        return fmt.name
    if not head:
        raise TraceError(path, "empty file (0 bytes), not a trace: a recorder killed before it opened the "
                               "file leaves one")
    raise TraceError(path, "not a trace file (neither HDF5 nor Arrow IPC)")


RANKED = re.compile(r"(.+)\.rank\d+(\.[^.]+)$")  # one rank's file of a trace: stem.rankN.ext


def rank_files(path: str | Path) -> list[Path]:
    """The files of one trace: the path itself, or its per-rank siblings ``stem.rankN.ext``."""
    path = Path(path)
    if path.exists():
        return [path]
    pattern = re.compile(re.escape(path.stem) + r"\.rank(\d+)" + re.escape(path.suffix) + "$")
    found = sorted(
        ((int(m.group(1)), p) for p in path.parent.glob(f"{path.stem}.rank*{path.suffix}")
         if (m := pattern.match(p.name))),
    )
    return [p for _, p in found] or [path]


def open_file(path: Path, part: int = 0, verify: bool = True) -> TraceFile:
    """One file of a trace, read by the format its magic bytes name; ``verify``: check its checksums."""
    return by_name(detect_format(path)).reader(path, part, verify=verify)


def _check_names(file: TraceFile) -> None:
    """Tensor names are selected with numpy, whose strings drop trailing NUL characters: a name
    holding one (a corrupt file; the recorder writes none) could never be found again."""
    bad = next((n for n in dict.fromkeys(file.index.name.tolist()) if "\x00" in n), None)
    if bad is not None:
        raise TraceError(file.path, f"a tensor name holds a NUL character ({bad!r})")


def check_rank_set(files: Sequence[TraceFile]) -> None:
    """Refuse rank files read as one trace that are not one run's: a file whose metadata's ``rank``
    contradicts its name's ``.rankN``, or whose ``world_size`` differs from the first file's (a file
    that joined the set by its name alone, such as a copy of another trace)."""
    if len(files) < 2:
        return
    first = files[0]
    for file in files:
        named = re.fullmatch(r".+\.rank(\d+)", file.path.stem)
        rank = file.meta.get("rank")
        if named is not None and isinstance(rank, int) and rank != int(named.group(1)):
            raise TraceError(file.path, f"its metadata says rank {rank} but its name says rank "
                                        f"{named.group(1)}: not a rank file of this trace")
        if file.meta.get("world_size") != first.meta.get("world_size"):
            raise TraceError(file.path, f"its metadata says world_size {file.meta.get('world_size')} but "
                                        f"{first.path.name} says {first.meta.get('world_size')}: not a rank "
                                        "file of the same run")


class InPlaceRows(NamedTuple):
    """Rows of one tensor to read in place: their keys, which of them, and their file offsets
    (``Trace.row_offsets``)."""

    keys: RowKeys
    rows: np.ndarray
    at: np.ndarray


class Trace:
    """A trace opened for reading: metadata, the record index, and tensors on demand."""

    def __init__(self, paths: Sequence[str | Path], verify: bool = True) -> None:
        self.verify = verify
        self.files: list[TraceFile] = []
        self._map: np.ndarray | None = None  # the file mapped for in-place reads (single-file traces)
        self._mmap: mmap.mmap | None = None
        try:
            for part, path in enumerate(paths):
                self.files.append(open_file(Path(path), part, verify=verify))
                _check_names(self.files[-1])
            check_rank_set(self.files)
        except BaseException:
            self.close()
            raise
        self.index = RecordIndex.concat([f.index for f in self.files])
        self._offsets: np.ndarray | None = None  # per record slot: file offset of its bytes, or -1
        self._request_codes: dict[str, int] = {}  # request -> code, in order of first appearance

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self.files]

    @property
    def name(self) -> str:
        """The path that opens this trace, as a user gives it: the file, or ``stem.ext`` for the
        rank files ``stem.rankN.ext`` (``rank_files``); else the files, comma-separated."""
        paths = self.paths
        if len(paths) == 1:
            return str(paths[0])
        found = {(p.parent, m.group(1), m.group(2)) for p in paths if (m := RANKED.match(p.name))}
        if len(found) == 1 and sum(1 for p in paths if RANKED.match(p.name)) == len(paths):
            parent, stem, suffix = found.pop()
            return str(parent / f"{stem}{suffix}")
        return ", ".join(map(str, paths))

    @property
    def meta(self) -> dict:
        """Run metadata as the (first, rank-0) writer opened the file."""
        return self.files[0].meta

    @property
    def finals(self) -> list[dict | None]:
        """Per file: what the writer wrote at close (None where it never closed)."""
        return [f.final for f in self.files]

    @property
    def complete(self) -> bool:
        return all(f.complete for f in self.files)

    @property
    def checksummed(self) -> bool:
        """Whether every file carries checksums (written in format version 3 on); an older trace
        opens all the same, unverified."""
        return all(f.checksummed for f in self.files)

    @property
    def unverified(self) -> str | None:
        """Why this trace's reads are not checked against checksums; None when they are."""
        if not self.checksummed:
            return "written before checksums"
        return None if self.verify else "--no-verify"

    def check_records(self, records: np.ndarray, held: Sequence[tuple[int, int]] = ()) -> None:
        """Refuse the first of these records (index positions) whose bytes fail their checksum. In a
        single-file trace whose records lie uncompressed in the file, the checksum is computed over
        the file's mapping, with no copy: a record inside ``held`` spans (``hold`` has mapped them
        for the read that follows) in one call, any other a window at a time, each window unmapped
        again after (resident memory stays flat, whatever the record's size). Elsewhere each record
        is read a piece at a time."""
        idx = self.index
        if len(self.files) == 1 and self._offsets is None:
            self._offsets = self.files[0].data_offsets()
        for part, file in enumerate(self.files):
            mine = np.unique(records if len(self.files) == 1 else records[idx.part[records] == part])
            mine = mine[np.isin(idx.slot[mine], file.unchecked_slots(idx.slot[mine]))]
            if not len(mine):
                continue
            slots = idx.slot[mine].astype(np.int64)
            at = self._offsets[slots] if len(self.files) == 1 and self._offsets is not None else None
            if at is None or (at < 0).any():
                for slot in slots.tolist():
                    file.check_data(slot)
                continue
            self._check_in_place(file, slots, at, idx.nbytes[mine], held)

    def _check_in_place(self, file: TraceFile, slots: np.ndarray, at: np.ndarray, nbytes: np.ndarray,
                        held: Sequence[tuple[int, int]]) -> None:
        """``check_records`` of records lying uncompressed at file offsets ``at``: each record inside
        a held span in one call over the mapping, any other a window at a time."""
        spans = sorted(held)
        starts = np.array([start for start, _ in spans], dtype=np.int64)
        ends = np.array([start + length for start, length in spans], dtype=np.int64)
        k = np.searchsorted(starts, at, side="right") - 1
        inside = (k >= 0) & (at + nbytes <= ends[np.maximum(k, 0)]) if len(spans) else np.zeros(len(at), bool)
        view = memoryview(self._mapping())
        crcs = np.zeros(len(slots), dtype=np.int64)
        for j in np.flatnonzero(inside).tolist():
            start = int(at[j])
            crcs[j] = crc32(view[start : start + int(nbytes[j])])
        for j in np.flatnonzero(~inside).tolist():
            crc, start, stop = 0, int(at[j]), int(at[j] + nbytes[j])
            for begin in range(start, stop, CRC_WINDOW):  # each window unmapped after: bounded pages
                end = min(begin + CRC_WINDOW, stop)
                crc = crc32(view[begin:end], crc)
                self.release(self._spans(np.array([begin]), np.array([end])))
            if spans:  # unmapping may have taken held pages: map them again for the read that follows
                self._populate(spans)
            crcs[j] = crc
        view.release()
        file.accept_crcs(slots, crcs)

    @cached_property
    def contract(self) -> dict:
        """The run contract as the run opened it, updated key by key by what each file's writer learned
        before closing; computed once (read it, never change it)."""
        opened = self.meta.get("contract")
        merged = dict(opened) if isinstance(opened, dict) else {}
        for final in self.finals:
            learned = final.get("contract") if isinstance(final, dict) else None
            merged.update(learned if isinstance(learned, dict) else {})
        return merged

    @cached_property
    def completeness(self) -> Completeness:
        """What this trace lacks of what its run logged (drops, stops, attached names never
        recorded are checked by compare against the other side, unclosed or missing files), and
        what its user filtered out; computed once."""
        idx = self.index
        logged: dict[str, int] = {}
        if len(idx):
            names, counts = np.unique(idx.name, return_counts=True)
            logged = {str(n): int(c) for n, c in zip(names.tolist(), counts.tolist())}
        per_token = idx.step[~idx.static.astype(bool)]
        last_step = int(per_token.max()) if len(per_token) else None  # static records have no step
        world = self.meta.get("world_size")
        world = world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else 1
        return completeness(self.meta, self.finals, self.contract, logged, world, len(self.files), last_step)

    @property
    def speculative_args(self) -> dict | None:
        """The speculative arguments the server resolved (``num_steps``, ``topk``,
        ``num_draft_tokens``, ``algorithm``) where the contract states any (a serving trace), else None."""
        return self._stated("speculative_args")

    @property
    def speculative_args_requested(self) -> dict | None:
        """The speculative arguments as the user gave them (a clamp shows as a difference from
        ``speculative_args``), where the contract states any."""
        return self._stated("speculative_args_requested")

    def _stated(self, key: str) -> dict | None:
        value = self.contract.get(key)
        return value if isinstance(value, dict) and any(v is not None for v in value.values()) else None

    @property
    def engine(self) -> str | None:
        """The engine whose draft code produced the trace, as its contract states it: ``draft_engine``
        where stated (the integrations and a replay's output say it), else "specforge" (its trainer's
        integration, also where SGLang's target code captured the features), else "sglang" (a
        server's trace: SGLang's version or speculative arguments), else None."""
        contract = self.contract
        if isinstance(contract.get("draft_engine"), str):
            return contract["draft_engine"]
        if contract.get("producer_integration") == "specforge":  # its draft, whoever captured the target
            return "specforge"
        return "sglang" if contract.get("sglang_version") or self.speculative_args is not None else None

    def names(self) -> list[str]:
        """Tensor names in execution order (first seq_no of each name); reserved ``__`` records
        never enter the index, so never appear here."""
        idx = self.index
        return list(dict.fromkeys(idx.name[np.lexsort((idx.seq_no, idx.part))].tolist()))

    def last_static(self, name: str, step: int | None = None) -> Record | None:
        """The last static record of ``name`` (at ``step`` if given), as compare reads a static
        tensor (a weight, the vocab map); None when the trace holds none."""
        hits = self.select(name=name, step=step)
        hits = hits[self.index.static[hits].astype(bool)]
        return self.read(int(hits[-1])) if len(hits) else None

    def select(self, name: str | None = None, step: int | None = None, rank: int | None = None,
               depth: int | None = None) -> np.ndarray:
        """Index positions of the records that match, in (rank file, seq_no) order."""
        idx = self.index
        mask = np.ones(len(idx), dtype=bool)
        if name is not None:
            mask &= idx.name == name
        for column, value in (("step", step), ("rank", rank), ("depth", depth)):
            if value is not None:
                mask &= getattr(idx, column) == value
        hits = np.flatnonzero(mask)
        return hits[np.lexsort((idx.seq_no[hits], idx.part[hits]))]

    def read(self, i: int) -> Record:
        """The whole record at index position ``i``: tensor and row keys."""
        idx = self.index
        file, slot = self.files[idx.part[i]], int(idx.slot[i])
        request, position, token_id = file.read_keys(slot)
        dtype = idx.dtype[i]
        raw = file.read_raw(slot)
        file.check_data(slot, raw)
        return Record(
            name=idx.name[i], data=raw.view(storage_dtype(dtype)).reshape(idx.shape[i]),
            dtype=dtype, seq_no=int(idx.seq_no[i]), step=int(idx.step[i]), rank=int(idx.rank[i]),
            depth=int(idx.depth[i]), static=bool(idx.static[i]),
            request=request, position=position, token_id=token_id,
        )

    def records(self, **where) -> Iterator[Record]:
        for i in self.select(**where):
            yield self.read(i)

    def keys(self, name: str, step: int | None = None, depth: int | None = None) -> RowKeys:
        """The key columns of every row of ``name`` and where each row lies, without its data:
        alignment works from these alone, whatever the size of the tensors."""
        idx = self.index
        hits = self.select(name=name, step=step, depth=depth)
        hits = hits[~idx.static[hits]]
        if not len(hits):
            raise KeyError(f"no rows of {name!r} match")
        dtypes = set(idx.dtype[hits].tolist())
        row_shapes = {idx.shape[i][1:] for i in hits.tolist()}
        if len(dtypes) > 1 or len(row_shapes) > 1:
            raise MixedRecords(name, sorted(dtypes), sorted(row_shapes), self.paths[0])
        request, position, token_id = self.key_columns(hits)
        per_record = idx.n_rows[hits]
        record_start = np.repeat(np.cumsum(per_record) - per_record, per_record)
        return RowKeys(
            name=name, dtype=dtypes.pop(), row_shape=row_shapes.pop(),
            record=np.repeat(hits, per_record),
            within=np.arange(int(per_record.sum())) - record_start,
            request=request, request_code=self.request_codes(request), position=position, token_id=token_id,
            step=np.repeat(idx.step[hits], per_record),
            depth=np.repeat(idx.depth[hits], per_record),
            rank=np.repeat(idx.rank[hits], per_record),
        )

    def _runs(self, keys: RowKeys, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Starts and stops (into ``rows``) of the runs of neighbouring rows of one record."""
        if not len(rows):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        record, within = keys.record[rows], keys.within[rows]
        breaks = np.flatnonzero((np.diff(record) != 0) | (np.diff(within) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        return starts, np.append(starts[1:], len(rows))

    def prefetch(self, keys: RowKeys, rows: np.ndarray) -> None:
        """Ask the kernel to start reading these rows now (one hint per run)."""
        idx, size = self.index, keys.row_nbytes
        for start, stop in zip(*self._runs(keys, rows)):
            i = keys.record[rows[start]]
            self.files[idx.part[i]].prefetch(int(idx.slot[i]), int(keys.within[rows[start]]) * size,
                                             int(stop - start) * size)

    def key_columns(self, hits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of the records ``hits`` (index positions in
        rank-file order, as ``select`` gives them): one bulk read per file."""
        parts = self.index.part[hits]
        columns: list[list[np.ndarray]] = [[], [], []]
        for part in np.unique(parts):
            keys = self.files[part].read_keys_many(self.index.slot[hits[parts == part]].astype(np.int64))
            for found, values in zip(columns, keys):
                found.append(values)
        if not len(hits):
            return np.empty(0, dtype=object), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        request, position, token_id = (np.concatenate(c) for c in columns)
        return request.astype(object), position, token_id

    def request_tokens(self) -> TokenTable:
        """The token table: every ``__tokens__`` entry of every rank file, the first seen winning
        where two disagree; empty for a version 1 trace."""
        parts = [self.token_keys(part) for part in range(len(self.files))]
        parts = [p for p in parts if len(p[1])]
        if not parts:
            return TokenTable.empty()
        request, position, token_id = (np.concatenate(column) for column in zip(*parts))
        return TokenTable.first_seen(request.astype(object), position, token_id)

    def token_keys(self, part: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of one rank file's ``__tokens__`` entries, in file order."""
        file = self.files[part]
        if not len(file.token_slots):
            return np.empty(0, dtype=object), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return file.read_keys_many(file.token_slots)

    def tokens_record(self, part: int) -> Record | None:
        """One rank file's token table entries as one ``__tokens__`` record (for convert)."""
        request, position, token_id = self.token_keys(part)
        if not len(position):
            return None
        return tokens_record(request, position, token_id, rank=int(self.files[part].meta.get("rank", 0)))

    def request_codes(self, requests: np.ndarray) -> np.ndarray:
        """The trace-wide code of each request id (new ids get the next free codes, in order of
        first appearance)."""
        distinct, codes = factorize(requests)
        table = [self._request_codes.setdefault(n, len(self._request_codes)) for n in distinct]
        return np.asarray(table, dtype=np.int64)[codes]

    def gather(self, keys: RowKeys, rows: np.ndarray | None = None,
               into: np.ndarray | None = None) -> np.ndarray:
        """Raw data of the given rows of ``keys`` (all by default), in the order given; each run of
        neighbouring rows of one record is one read, and the next runs are prefetched meanwhile.
        ``into``: a uint8 buffer to reuse (at least the rows' bytes), for callers reading many."""
        rows = np.arange(len(keys)) if rows is None else np.asarray(rows, dtype=np.int64)
        shape, dtype = (len(rows), *keys.row_shape), storage_dtype(keys.dtype)
        if into is None:
            out = np.empty(shape, dtype=dtype)
        else:
            out = into[: int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)
        row_bytes = keys.row_nbytes
        flat = out.reshape(-1).view(np.uint8)
        starts, stops = self._runs(keys, rows)
        idx = self.index
        first = keys.record[rows[starts]]  # the record of each run
        whole = (keys.within[rows[starts]] == 0) & (stops - starts == idx.n_rows[first])
        self.check_records(first[~whole])  # records read in part: checked on their own, first
        sums: list[tuple[TraceFile, int, Future]] = []
        ahead_too = flat.nbytes >= PREFETCH_MIN_BYTES  # a small read is over before a hint would help
        for k, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist())):
            if ahead_too and k % PREFETCH == 0:  # the disk reads the next window meanwhile
                ahead = slice(k + (PREFETCH if k else 0), k + 2 * PREFETCH)
                for s, e in zip(starts[ahead].tolist(), stops[ahead].tolist()):
                    self.prefetch(keys, rows[s:e])
            i = keys.record[rows[start]]
            file, slot = self.files[idx.part[i]], int(idx.slot[i])
            piece = flat[start * row_bytes : stop * row_bytes]
            file.read_into(slot, piece, int(keys.within[rows[start]]) * row_bytes)
            if whole[k] and file.unchecked(slot):  # read whole: its checksum over the bytes read (no
                if piece.nbytes < SPAN_GAP:  # second read); a large record's in a thread, meanwhile
                    file.check_data(slot, crc=crc32(piece.data))
                else:
                    sums.append((file, slot, _crc_pool().submit(crc32, piece.data)))
        for file, slot, crc in sums:
            file.check_data(slot, crc=crc.result())
        return out

    def row_offsets(self, keys: RowKeys, rows: np.ndarray) -> np.ndarray | None:
        """File offset of each row's bytes, for reading them in place from ``mapped()``; None
        unless the trace is one file whose records involved lie uncompressed in it. Not checked
        yet: ``hold`` checks the records as it maps them, before anything reads them in place."""
        if len(self.files) != 1:
            return None
        if self._offsets is None:
            self._offsets = self.files[0].data_offsets()
        base = self._offsets[self.index.slot[keys.record[rows]]]
        if (base < 0).any():
            return None
        return base + keys.within[rows] * keys.row_nbytes

    def mapped(self) -> np.ndarray:
        """The (single) trace file as read-only uint8 memory, mapped once."""
        if self._map is None:
            with open(self.paths[0], "rb") as fh:
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        return self._map

    def hold(self, parts: list[InPlaceRows]) -> list[tuple[int, int]]:
        """Map these rows (``row_offsets`` of several tensors) into ``mapped()`` now, reading them
        from disk if need be, so that a kernel reading them in place takes no page faults, and check
        the records they belong to against their checksums over the mapped bytes (before anything
        reads them). Returns the spans held: ``release`` them when done."""
        if not parts:
            return []
        starts = np.concatenate([part.at for part in parts])
        spans = self._spans(starts, np.concatenate([part.at + part.keys.row_nbytes for part in parts]))
        self._populate(spans)
        self.check_records(np.concatenate([part.keys.record[part.rows] for part in parts]), held=spans)
        return spans

    def _spans(self, starts: np.ndarray, stops: np.ndarray) -> list[tuple[int, int]]:
        """(file offset, length) of page-aligned spans covering the byte ranges [starts, stops);
        ranges less than ``SPAN_GAP`` apart share a span: one sequential read."""
        if not len(starts):
            return []
        order = np.argsort(starts, kind="stable")
        begin = (starts[order] // mmap.PAGESIZE) * mmap.PAGESIZE
        end = np.maximum.accumulate(stops[order])
        first = np.flatnonzero(np.r_[True, begin[1:] > end[:-1] + SPAN_GAP])
        last = np.r_[first[1:], len(begin)] - 1
        return list(zip(begin[first].tolist(), (end[last] - begin[first]).tolist()))

    def _populate(self, spans: list[tuple[int, int]]) -> None:
        mapping = self._mapping()
        for start, length in spans:
            if not advise(mapping, start, length, MADV_POPULATE_READ):  # kernel < 5.14
                advise(mapping, start, length, mmap.MADV_WILLNEED)  # the faults read ahead

    def release(self, spans: list[tuple[int, int]]) -> None:
        """Unmap spans ``hold`` returned (the pages stay in the page cache): resident memory stays at
        a few chunks, whatever the trace size."""
        mapping = self._mapping()
        for start, length in spans:
            advise(mapping, start, length, mmap.MADV_DONTNEED)

    def _mapping(self) -> mmap.mmap:
        """The mmap under ``mapped()``, mapped first if need be."""
        self.mapped()
        assert self._mmap is not None  # mapped() has made it
        return self._mmap

    def rows(self, name: str, step: int | None = None, request: str | None = None,
             depth: int | None = None) -> TensorRows:
        """Every row of ``name`` (one step / request / depth if given), concatenated in order."""
        keys = self.keys(name, step=step, depth=depth)
        if request is not None:
            keys = keys.take(np.flatnonzero(keys.request == request))
        shared = {f.name: getattr(keys, f.name) for f in fields(KeyColumns)}
        return TensorRows(**shared, data=self.gather(keys))

    def close(self) -> None:
        for f in self.files:
            f.close()
        self._map = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # rows a caller still holds point into it: the GC unmaps it later
                pass

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_trace(path: str | Path | Sequence[str | Path], verify: bool = True) -> Trace:
    """Open a trace file, a trace split over ``stem.rankN.ext`` files, or an explicit list of files.
    ``verify`` (false: the CLI's --no-verify): check checksums,
    the metadata and record keys at open, each record's bytes and row keys when first read; a
    mismatch is a TraceError naming the record."""
    if isinstance(path, (str, Path)):
        return Trace(rank_files(path), verify=verify)
    return Trace(list(path), verify=verify)
