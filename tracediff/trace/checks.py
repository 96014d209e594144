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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracediff.errors import TraceError
from tracediff.trace.dtypes import STORAGE

MAX_META_BYTES = 16 << 20  # run or final metadata; real ones are a few KiB
MAX_DEPTH = 32  # nesting of metadata JSON (contracts nest 3 or 4 deep)
MAX_NDIM = 32  # dims of one record (HDF5 traces hold at most 8)
MAX_RECORD_LOG2 = 62  # a record's bytes must fit an int64 with room to add offsets

ITEMSIZE = {tag: dtype.itemsize for tag, dtype in STORAGE.items()}

_INT = "an integer"
_TEXT = "a string"
_OBJECT = "an object"
# Documented keys -> what their values must be (other keys may hold anything: additive changes).
RUN_META: dict[str, tuple[str, ...]] = {
    "format": (_TEXT,), "format_version": (_INT,), "source": (_TEXT,), "producer": (_TEXT,),
    "producer_version": (_TEXT,), "created": (_TEXT,), "host": (_OBJECT,), "torch": (_OBJECT, "null"),
    "rank": (_INT,), "world_size": (_INT,), "filters": (_OBJECT,), "contract": (_OBJECT,),
}
FINAL_META: dict[str, tuple[str, ...]] = {
    "closed": ("a boolean",), "records": (_INT,), "bytes": (_INT,), "dropped_records": (_INT,),
    "dropped": ("an object of counts",), "dropped_reasons": ("an object of counts",),
    "stopped": (_TEXT, "null"), "contract": (_OBJECT,),
    "tokens": (_INT,), "token_conflicts": (_INT,), "token_calls_dropped": (_INT,),
    "token_positions_ignored": (_INT,), "mixed_records": ("a list of strings",),
}


def _is(value: object, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
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
    try:
        value = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise TraceError(path, f"{what} is JSON nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:
        raise TraceError(path, f"{what} is not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(value, dict):
        raise TraceError(path, f"{what} is JSON {type(value).__name__}, not an object")
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
    stack: list[tuple[dict | list, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TraceError(path, f"{what} is JSON nested more than {MAX_DEPTH} deep")
        for child in [*node.keys(), *node.values()] if isinstance(node, dict) else node:
            if isinstance(child, str):
                try:
                    child.encode("utf-8")
                except UnicodeEncodeError:
                    raise TraceError(path, f"{what} holds a string that is not valid Unicode") from None
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


def check_keys(path: str | Path, meta: dict, schema: dict[str, tuple[str, ...]], what: str) -> dict:
    """The documented keys of ``meta`` hold what FORMAT.md says they hold."""
    for key, kinds in schema.items():
        if key in meta and not any(_is(meta[key], kind) for kind in kinds):
            raise TraceError(path, f"{what} key {key!r} is {_kind_of(meta[key])}, not {' or '.join(kinds)}")
    return meta


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
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
    """The declared format version: a positive integer (bytes or text of digits in Arrow metadata)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        value = int(value)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value < 1 << 31:
        shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
        raise TraceError(path, f"format version {shown} is not a positive integer")
    return int(value)


def check_record_count(path: str | Path, final: dict | None, found: int) -> None:
    """A closed file holds the tensor records its final metadata counts."""
    if final is not None and isinstance(final.get("records"), int) and final["records"] != found:
        raise TraceError(path, f"the final metadata counts {final['records']} records but the file "
                               f"indexes {found}")


@dataclass
class RecordShapes:
    """What an index declares of each record, as whole columns."""

    itemsize: np.ndarray  # int64, -1 for an unknown dtype tag
    static: np.ndarray  # bool
    ndim: np.ndarray  # int64
    dims: np.ndarray  # int64 [n, width]: dims, anything past ndim ignored
    n_rows: np.ndarray  # int64: the rows the record declares (its first axis unless static)
    nbytes: np.ndarray  # int64: the bytes it declares

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

    def _live(self) -> np.ndarray:
        ndim = np.clip(self.ndim, 0, self.dims.shape[1])
        return np.where(np.arange(self.dims.shape[1]) < ndim[:, None], self.dims, 1)

    def _sizes(self, dims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bytes each shape and dtype take, 0 where too large; whether too large). The float
        product only tells which exact int64 products cannot overflow."""
        itemsize = np.maximum(self.itemsize, 0)
        approx = np.prod(np.maximum(dims, 1).astype(np.float64), axis=1) * np.maximum(itemsize, 1)
        too_large = ~(dims == 0).any(axis=1) & (approx >= float(1 << MAX_RECORD_LOG2))
        safe = np.where(too_large[:, None], 0, np.maximum(dims, 0))
        return np.prod(safe, axis=1, dtype=np.int64) * itemsize, too_large

    def expected_nbytes(self) -> np.ndarray:
        """Bytes each shape and dtype take (0 where that overflows: those records are refused)."""
        return self._sizes(self._live())[0]

    def faults(self) -> list[tuple[np.ndarray, str]]:
        """(mask of records, what is wrong with them), in the order a record is judged."""
        dims = self._live()
        expected, too_large = self._sizes(dims)
        first = dims[:, 0] if dims.shape[1] else np.zeros(len(dims), np.int64)
        return [
            (self.itemsize < 0, "an unknown dtype"),
            ((self.ndim < 0) | (self.ndim > min(MAX_NDIM, self.dims.shape[1])),
             "an impossible number of dims"),
            ((dims < 0).any(axis=1), "a negative dimension"),
            (too_large, f"a shape of 2^{MAX_RECORD_LOG2} bytes or more"),
            (self.static & (self.n_rows != 0), "rows, yet it is static"),
            (~self.static & (self.ndim < 1), "no first axis, yet it is not static"),
            (~self.static & (self.n_rows != first), "a row count that is not its shape's first dim"),
            (self.nbytes != expected, "a byte size that its shape and dtype do not give"),
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
