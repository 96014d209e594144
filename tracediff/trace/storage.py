"""What a physical trace format provides, and which format a path or a file's first bytes name.

A format is one module: a writer (``TraceWriter``) and a per-file reader (``TraceFile``), declared
as a ``StorageFormat`` and registered here with its suffixes and magic bytes; ``open_writer`` and
``open_trace`` find it through this registry, so a third format is one more module (declared in
``BUILTIN``, or imported by its user before reading or writing: it registers itself). A built-in
format's module loads only when its writer or reader is first wanted (``Declared``): a command on
an Arrow trace never imports h5py, nor one on an HDF5 trace pyarrow.

A reader trusts nothing in a file: every failure of a file (corrupt, truncated, foreign) leaves a
``TraceFile`` method as ``TraceError``, whatever library noticed it (``trace_errors``).
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Concatenate, ParamSpec, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np

from tracediff.errors import TraceError
from tracediff.trace.crc import crc32
from tracediff.trace.schema import MetaSum, Record, RecordIndex, corrupt_record

MAGIC_BYTES = 8  # how much of a file's head the registry looks at
VERIFY_PIECE = 4 << 20  # bytes of a record read at a time to check its checksum


class TraceWriter(Protocol):
    def write(self, records: Sequence[Record]) -> None:
        """Append records; they reach the OS (and survive a killed process) before this returns."""

    def sync(self) -> None:
        """fsync what was written."""

    def abort(self) -> None:
        """Release the file after a failed write, leaving it as last flushed."""

    def close(self, final: dict) -> None:
        """Write the end-of-run metadata and close; the file is then complete."""

    def forked(self) -> None:
        """In a forked child that holds a copy of this writer (its thread stayed in the parent):
        make sure nothing the child does reaches the file."""


@runtime_checkable
class TraceFile(Protocol):
    """One file of a trace, opened for reading. Opening checks the metadata and the record index
    against the file (strictly when the writer closed it, keeping the whole prefix when it was
    killed); methods check what they read. Every failure is a ``TraceError``. A format's reader
    subclasses it to inherit ``read_keys``."""

    path: Path
    meta: dict  # run metadata as the writer opened the file
    version: int  # the format version it was written in
    final: dict | None  # end-of-run metadata; None when the writer never closed the file
    index: RecordIndex  # its tensor records (reserved ``__`` ones left out)
    token_slots: np.ndarray  # slots of its ``__tokens__`` records
    verify: bool  # whether reads check checksums (open_trace(..., verify=False): they do not)
    # Per file slot: the CRC32 of the record's bytes; None for a file written before checksums
    data_crcs: np.ndarray | None = None
    record_crcs: np.ndarray | None = None  # per file slot: the stored ``record_crc`` (None: no checksums)
    rows_crcs: np.ndarray | None = None  # per file slot: the stored ``rows_crc``
    meta_sums: list[MetaSum]  # the metadata's pieces with their stored checksums (none before checksums)

    @property
    def checksummed(self) -> bool:
        """Whether the file carries checksums (format version 3 on)."""
        return self.data_crcs is not None

    def check_data(self, slot: int, raw: np.ndarray | None = None, crc: int | None = None) -> None:
        """Refuse a record whose bytes (``raw`` when the caller has read them all, else read here a
        piece at a time) fail their checksum; each record is checked once. Nothing to check in a
        file without checksums, or opened with verify=False. ``crc``: the caller's CRC32 of them."""
        if not self.unchecked(slot):
            return
        if crc is not None:  # the caller computed it over the record's bytes
            pass
        elif raw is not None:
            crc = crc32(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).data)
        else:
            n = self.record_nbytes(slot)
            crc, piece = 0, np.empty(min(n, VERIFY_PIECE), dtype=np.uint8)
            for at in range(0, n, VERIFY_PIECE):
                part = piece[: min(VERIFY_PIECE, n - at)]
                self.read_into(slot, part, at)
                crc = crc32(part.data, crc)
        assert self.data_crcs is not None  # unchecked() holds
        if crc != int(self.data_crcs[slot]):
            raise corrupt_record(self.path, slot, *self.describe_slot(slot))
        self._verified()[slot] = True

    def accept_crcs(self, slots: np.ndarray, crcs: np.ndarray) -> None:
        """Refuse the first of these records whose computed CRC32 (``crcs``, one per slot) is not the
        one stored; else remember them as checked."""
        assert self.data_crcs is not None  # callers check only what owes a check (``unchecked``)
        bad = np.flatnonzero(self.data_crcs[slots] != crcs)
        if len(bad):
            slot = int(slots[bad[0]])
            raise corrupt_record(self.path, slot, *self.describe_slot(slot))
        self._verified()[slots] = True

    def stored_checksums(self, slot: int) -> tuple[int, int, int] | None:
        """(data, record, rows) checksums the file stores for the record at a slot, as read (not
        checked here); None for a file without checksums."""
        if self.data_crcs is None or self.record_crcs is None or self.rows_crcs is None:
            return None
        return int(self.data_crcs[slot]), int(self.record_crcs[slot]), int(self.rows_crcs[slot])

    def check_metadata(self) -> None:
        """Refuse metadata (run, final; Arrow's record index) that fails its checksum: at open, and
        before a copy of a file opened unchecked writes it anew with new checksums."""
        for piece in self.meta_sums:
            piece.check(self.path)

    def unchecked(self, slot: int) -> bool:
        """Whether reading this record's bytes still owes a check of its checksum."""
        return self.verify and self.data_crcs is not None and not self._verified()[slot]

    def unchecked_slots(self, slots: np.ndarray) -> np.ndarray:
        """Those of these slots whose bytes still owe a check (``unchecked`` of many at once)."""
        if not self.verify or self.data_crcs is None:
            return slots[:0]
        return slots[~self._verified()[slots]]

    def _verified(self) -> np.ndarray:
        """Per file slot: whether its bytes were checked (made at the first check)."""
        done = self.__dict__.get("_data_verified")
        if done is None:
            count = 0 if self.data_crcs is None else len(self.data_crcs)
            done = self.__dict__["_data_verified"] = np.zeros(count, dtype=bool)
        return done

    def record_nbytes(self, slot: int) -> int:
        """Bytes of the record at a file slot."""

    def describe_slot(self, slot: int) -> tuple[str, int]:
        """(name, step) of the record at a file slot, as its index holds them."""

    @property
    def complete(self) -> bool:
        """Whether the writer closed the file."""

    def read_raw(self, slot: int) -> np.ndarray:
        """A record's raw bytes (uint8)."""

    def read_into(self, slot: int, out: np.ndarray, offset: int = 0) -> None:
        """Bytes [offset, offset + out.nbytes) of a record into ``out``."""

    def prefetch(self, slot: int, offset: int = 0, n: int | None = None) -> None:
        """Ask the kernel to start reading these bytes of a record now."""

    def data_offsets(self) -> np.ndarray:
        """File offset of each record's bytes where they lie contiguous and uncompressed, else -1."""

    def read_keys(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of one record (formats inherit this)."""
        return self.read_keys_many(np.array([slot]))

    def read_keys_many(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(request, position, token_id) of every row of these records, concatenated."""

    def close(self) -> None:
        """Release the file."""


@dataclass(frozen=True)
class StorageFormat:
    """A physical format: how to recognise, write and read it."""

    name: str
    suffixes: tuple[str, ...]  # lower case, with the dot; the first is the one to write
    magic: bytes  # the file's first bytes
    writer: Callable[[Path, dict, str | None], TraceWriter]  # (path, run metadata, compression)
    reader: Callable[..., TraceFile]  # (path, part: its place in a multi-file trace, verify=bool)


@dataclass(frozen=True)
class Declared:
    """A built-in format as the registry knows it before its module loads: what names it, and the
    module that registers its ``StorageFormat`` (loaded on the first use of ``writer`` or ``reader``)."""

    name: str
    suffixes: tuple[str, ...]
    magic: bytes
    module: str

    def loaded(self) -> StorageFormat:
        importlib.import_module(self.module)
        return _FORMATS[self.name]

    @property
    def writer(self) -> Callable[[Path, dict, str | None], TraceWriter]:
        return self.loaded().writer

    @property
    def reader(self) -> Callable[..., TraceFile]:
        return self.loaded().reader

    def format(self, writer: Callable[[Path, dict, str | None], TraceWriter],
               reader: Callable[..., TraceFile]) -> StorageFormat:
        """The ``StorageFormat`` its module registers: this declaration's names, and its classes."""
        return StorageFormat(self.name, self.suffixes, self.magic, writer, reader)


H5 = Declared("h5", (".h5", ".hdf5"), b"\x89HDF\r\n\x1a\n", "tracediff.trace.h5")
ARROW = Declared("arrow", (".arrow", ".ipc", ".feather"), b"ARROW1", "tracediff.trace.arrow")
BUILTIN = (H5, ARROW)  # in this order whatever was imported first; others follow as registered

_FORMATS: dict[str, StorageFormat] = {}


def register(fmt: StorageFormat) -> StorageFormat:
    """Make a format known by name, suffix and magic (a format module calls this on import)."""
    _FORMATS[fmt.name] = fmt
    return fmt


def formats() -> list[StorageFormat | Declared]:
    """Every known format: the built-in ones in BUILTIN's order (their modules not loaded until
    wanted), then the others as registered."""
    builtin = {d.name for d in BUILTIN}
    return [*BUILTIN, *(f for name, f in _FORMATS.items() if name not in builtin)]


def unwritable_suffix(path: str | Path) -> str | None:
    """Why ``path`` cannot name a trace to write (its suffix is no format's), or None."""
    if any(Path(path).suffix.lower() in fmt.suffixes for fmt in formats()):
        return None
    return "the output must end in " + " or ".join(fmt.suffixes[0] for fmt in formats())


def by_name(name: str) -> StorageFormat | Declared:
    known = {f.name: f for f in formats()}
    if name not in known:
        raise ValueError(f"unknown trace format {name!r}; use {' or '.join(map(repr, known))}")
    return known[name]


def by_suffix(path: str | Path) -> StorageFormat | Declared:
    suffix = Path(path).suffix.lower()
    for fmt in formats():
        if suffix in fmt.suffixes:
            return fmt
    first = " or ".join(f.suffixes[0] for f in formats())
    raise ValueError(f"{path}: cannot tell the trace format from {suffix!r}; use {first}")


def by_magic(head: bytes) -> StorageFormat | Declared | None:
    """The format whose magic bytes start ``head`` (a file's first ``MAGIC_BYTES``)."""
    return next((f for f in formats() if head.startswith(f.magic)), None)


# What libraries raise on a file that is not what it claims (and pyarrow's own errors, once it is
# loaded: before, none can be raised); anything else is a bug of ours.
LIBRARY_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, RuntimeError, OverflowError)


def library_error(exc: Exception) -> bool:
    """Whether ``exc`` is what a library raises on a file that is not what it claims."""
    arrow = sys.modules.get("pyarrow")
    return isinstance(exc, LIBRARY_ERRORS) or (arrow is not None and isinstance(exc, arrow.ArrowException))

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound="HasPath")


class HasPath(Protocol):
    path: Path


def describe(exc: object, limit: int = 200) -> str:
    """One short line about a library's exception (its text may quote whole buffers)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def trace_errors(method: Callable[Concatenate[F, P], R]) -> Callable[Concatenate[F, P], R]:
    """A reader method whose library errors (h5py, pyarrow, the OS) become one ``TraceError``."""

    @functools.wraps(method)
    def wrapper(self: F, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except TraceError:
            raise
        except MemoryError as exc:
            raise TraceError(self.path, f"out of memory while reading it ({describe(exc)})") from None
        except Exception as exc:
            if not library_error(exc):
                raise
            raise TraceError(self.path, f"corrupt trace: {describe(exc)}") from None

    return wrapper
