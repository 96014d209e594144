"""Checks of what a trace file declares, made before a reader trusts it.

Metadata is JSON from the file: bounded in size and nesting, an object, its documented keys of the
documented types (docs/FORMAT.md), so nothing downstream meets a list where it expects an object.
Record index entries must describe tensors that can exist: a known dtype, non-negative dims, a
byte size that their shape and dtype give, a row count that their first axis gives. All checks are
numpy over whole columns: one pass per file, not one Python step per row.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tracediff.errors import TraceError
from tracediff.trace.dtypes import STORAGE
from tracediff.trace.metarules import (  # shared with the recorder
    MAX_DEPTH,
    MAX_META_BYTES,
    may_hold_surrogates,
    text_problem,
    tree_problem,
)
from tracediff.trace.schema import MAX_NDIM

MAX_RECORD_LOG2 = 62  # a record's bytes must fit an int64 with room to add offsets
# Compressed bytes are decompressed whole, a chunk (HDF5) or a batch's buffers (Arrow) at a time: what
# a file's compressed parts declare is checked before they are decompressed, so that a small file
# cannot make memory a large multiple of what is being read. Tensor data is held to what the index
# declares (zeros compress ~1000x with gzip, far more with zstd: a truthful record costs its size);
# an index itself (Arrow's __index__, its closing batch) does not compress past MAX_EXPANSION (each
# entry has checksums, a sequence number), and is read before anything declares its size.
MAX_CHUNK_BYTES = 64 << 20  # a compressed HDF5 chunk, decompressed
MAX_EXPANSION = 256  # a compressed index may expand this many times the file's size ...
EXPANSION_FLOOR = 64 << 20  # ... or to this, whichever is more

ITEMSIZE = {tag: dtype.itemsize for tag, dtype in STORAGE.items()}

_INT = "an integer from 0 to 2^63-1"  # what an int64 column or numpy index can take
_RANK = "an integer from 0 to 2^31-1"  # ranks are an int32 column of every record
_TEXT = "a string"
_OBJECT = "an object"
_LIMIT = {_INT: 1 << 63, _RANK: 1 << 31}
# Documented keys -> what their values must be (other keys may hold anything: additive changes).
RUN_META: dict[str, tuple[str, ...]] = {
    "format": (_TEXT,), "format_version": (_INT,), "source": (_TEXT,), "producer": (_TEXT,),
    "producer_version": (_TEXT,), "created": (_TEXT,), "host": (_OBJECT,), "torch": (_OBJECT, "null"),
    "rank": (_RANK,), "world_size": (_RANK,), "filters": (_OBJECT,), "contract": (_OBJECT,),
}
FINAL_META: dict[str, tuple[str, ...]] = {
    "closed": ("a boolean",), "records": (_INT,), "bytes": (_INT,), "dropped_records": (_INT,),
    "dropped": ("an object of counts",), "dropped_reasons": ("an object of counts",),
    "stopped": (_TEXT, "null"), "contract": (_OBJECT,),
    "tokens": (_INT,), "token_conflicts": (_INT,), "token_calls_dropped": (_INT,),
    "token_positions_ignored": (_INT,), "mixed_records": ("a list of strings",),
    "dropped_by": (_OBJECT,), "producers": (_OBJECT,), "queue": (_OBJECT,),
}


def _is(value: object, kind: str) -> bool:
    if kind in _LIMIT:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _LIMIT[kind]
    if kind == "a boolean":
        return isinstance(value, bool)
    if kind == _TEXT:
        return isinstance(value, str)
    if kind == _OBJECT:
        return isinstance(value, dict)
    if kind == "null":
        return value is None
    if kind == "an object of counts":
        return isinstance(value, dict) and all(_is(v, _INT) for v in value.values())
    return isinstance(value, list) and all(isinstance(v, str) for v in value)  # a list of strings


def load_json_object(path: str | Path, raw: bytes | str, what: str) -> dict:
    """``raw`` as a JSON object, or a TraceError saying what is wrong with it."""
    if len(raw) > MAX_META_BYTES:
        raise TraceError(path, f"{what} is {len(raw)} bytes, more than a trace may hold ({MAX_META_BYTES})")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise TraceError(path, f"{what} is not UTF-8 text (byte {exc.start})") from None
    encoded = raw if isinstance(raw, bytes) else text.encode("utf-8", "surrogatepass")
    _refuse_problem(path, text_problem(encoded), what)  # its size and nesting, before a tree is built
    try:
        value = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise TraceError(path, f"{what} is JSON nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:
        raise TraceError(path, f"{what} is not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(value, dict):
        raise TraceError(path, f"{what} is JSON {type(value).__name__}, not an object")
    if not isinstance(raw, bytes) or may_hold_surrogates(encoded):  # else no string can hold one
        _check_tree(path, value, what)
    return value


def _finite(text: str) -> float:
    """Numbers a writer can write back: its JSON refuses NaN and infinities (allow_nan=False)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(path: str | Path, value: dict, what: str) -> None:
    """Nesting within MAX_DEPTH, and every string encodable (JSON escapes can make lone surrogates,
    which no terminal or file can take)."""
    _refuse_problem(path, tree_problem(value), what)


def _refuse_problem(path: str | Path, problem: str | None, what: str) -> None:
    if problem is not None:
        verb = "is" if problem.startswith("JSON") else "holds"
        raise TraceError(path, f"{what} {verb} {problem}")


def check_keys(path: str | Path, meta: dict, schema: dict[str, tuple[str, ...]], what: str) -> dict:
    """The documented keys of ``meta`` hold what FORMAT.md says they hold."""
    for key, kinds in schema.items():
        if key in meta and not any(_is(meta[key], kind) for kind in kinds):
            raise TraceError(path, f"{what} key {key!r} is {_kind_of(meta[key])}, not {' or '.join(kinds)}")
    return meta


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value}" if len(str(value)) <= 24 else f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, float) and value < 0:
        return f"negative ({value})"
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return kinds.get(type(value), "a number")


def run_meta(path: str | Path, raw: bytes | str) -> dict:
    """The run metadata written when the file was opened."""
    return check_keys(path, load_json_object(path, raw, "run metadata"), RUN_META, "run metadata")


def final_meta(path: str | Path, raw: bytes | str) -> dict:
    """The end-of-run metadata written at close."""
    return check_keys(path, load_json_object(path, raw, "final metadata"), FINAL_META, "final metadata")


def format_version(path: str | Path, value: object) -> int:
    """The declared format version: a positive integer (bytes or text of digits in Arrow metadata; an
    exception instance says what else an HDF5 attribute held)."""
    if isinstance(value, Exception):
        raise TraceError(path, f"format version is {value}, not a positive integer")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        value = int(value)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value < 1 << 31:
        shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
        raise TraceError(path, f"format version {shown} is not a positive integer")
    return int(value)


def check_expansion(path: str | Path, declared: int, file_size: int, what: str) -> None:
    """A compressed index that decompresses to ``declared`` bytes, from a file of ``file_size``, within
    ``MAX_EXPANSION`` times the file (or ``EXPANSION_FLOOR``): nothing declares an index's size before
    it is read, and no index compresses that far."""
    if declared > max(EXPANSION_FLOOR, MAX_EXPANSION * file_size):
        raise TraceError(path, f"{what} would decompress to {declared} bytes from a file of {file_size}: "
                               f"more than {MAX_EXPANSION}x its size, which no index compresses to (a "
                               "small file must not take large memory)")


def check_record_count(path: str | Path, final: dict | None, found: int) -> None:
    """A closed file holds the tensor records its final metadata counts."""
    if final is not None and isinstance(final.get("records"), int) and final["records"] != found:
        raise TraceError(path, f"the final metadata counts {final['records']} records but the file "
                               f"indexes {found}")


@dataclass
class Scan:
    """What the dims of each record give, from one pass over the dims columns."""

    expected: np.ndarray  # int64: bytes the shape and dtype take, 0 where too large
    too_large: np.ndarray  # bool: the dims other than 0 and the itemsize multiply to 2^62 or more
    negative: np.ndarray  # bool: a dim below 0
    first: np.ndarray  # int64: the first dim, 1 where there is none


@dataclass
class RecordShapes:
    """What an index declares of each record, as whole columns."""

    itemsize: np.ndarray  # int64, -1 for an unknown dtype tag
    static: np.ndarray  # bool
    ndim: np.ndarray  # int64
    dims: np.ndarray  # int64 [n, width]: dims, anything past ndim ignored
    n_rows: np.ndarray  # int64: the rows the record declares (its first axis unless static)
    nbytes: np.ndarray  # int64: the bytes it declares
    _scan: Scan | None = field(default=None, repr=False, compare=False)

    @classmethod
    def derived(cls, itemsize: np.ndarray, static: np.ndarray, ndim: np.ndarray,
                dims: np.ndarray) -> RecordShapes:
        """For a format whose row count and byte size follow from the shape (Arrow)."""
        zeros = np.zeros(len(ndim), np.int64)
        shapes = cls(itemsize, static, ndim, dims, zeros, zeros)
        first = np.where(ndim > 0, dims[:, 0] if dims.shape[1] else 0, 0)
        shapes.n_rows = np.where(static, 0, first).astype(np.int64)
        shapes.nbytes = shapes.expected_nbytes()
        return shapes

    def scan(self) -> Scan:
        """One dims column at a time, so that a 10M-record index costs a few vectors of n, never
        copies of its [n, width] dims. A dim of 0 does not excuse the others: a shape [0, 2^62]
        holds no bytes, yet numpy cannot make an array of it. The float product only tells which
        exact int64 products cannot overflow (they wrap where it says too large: replaced by 0)."""
        if self._scan is None:
            n, width = self.dims.shape
            ndim = np.minimum(self.ndim, width)
            exact = np.maximum(self.itemsize, 0).astype(np.int64, copy=False)
            approx = np.maximum(exact, 1).astype(np.float64)
            negative, first, scratch = np.zeros(n, bool), np.ones(n, np.int64), np.empty(n, np.int64)
            for j in range(int(ndim.max(initial=0))):  # columns past every record's ndim hold nothing
                dim = np.where(ndim > j, self.dims[:, j], 1)
                if j == 0:
                    first = dim
                negative |= dim < 0
                approx *= np.maximum(dim, 1, out=scratch)
                exact *= np.maximum(dim, 0, out=scratch)
            too_large = approx >= float(1 << MAX_RECORD_LOG2)
            exact[too_large] = 0
            self._scan = Scan(exact, too_large, negative, first)
        return self._scan

    def expected_nbytes(self) -> np.ndarray:
        """Bytes each shape and dtype take (0 where that overflows: those records are refused)."""
        return self.scan().expected

    def faults(self) -> list[tuple[np.ndarray, str]]:
        """(mask of records, what is wrong with them), in the order a record is judged."""
        scan = self.scan()
        return [
            (self.itemsize < 0, "an unknown dtype"),
            ((self.ndim < 0) | (self.ndim > min(MAX_NDIM, self.dims.shape[1])),
             "an impossible number of dims"),
            (scan.negative, "a negative dimension"),
            (scan.too_large, f"a shape of 2^{MAX_RECORD_LOG2} bytes or more (dims of 0 aside)"),
            (self.static & (self.n_rows != 0), "rows, yet it is static"),
            (~self.static & (self.ndim < 1), "no first axis, yet it is not static"),
            (~self.static & (self.n_rows != scan.first), "a row count that is not its shape's first dim"),
            (self.nbytes != scan.expected, "a byte size that its shape and dtype do not give"),
        ]


def first_fault(faults: list[tuple[np.ndarray, str]], n: int) -> tuple[int, str] | None:
    """The first record (of n) that any check refuses, and why."""
    bad = np.zeros(n, dtype=bool)
    for mask, _ in faults:
        bad |= mask[:n]
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return i, next(reason for mask, reason in faults if mask[i])


def refuse(path: str | Path, fault: tuple[int, str] | None) -> None:
    if fault is not None:
        raise TraceError(path, f"record {fault[0]} of the index has {fault[1]}")


def itemsizes(tags: list[str]) -> np.ndarray:
    """The storage itemsize of each dtype tag, -1 for a tag the format does not know."""
    lookup = ITEMSIZE.get
    return np.fromiter((lookup(t, -1) if isinstance(t, str) else -1 for t in tags), np.int64, count=len(tags))
