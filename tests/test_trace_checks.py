"""Second look at the readers' checks (trace/checks.py) and our HDF5 root-attribute parser
(trace/h5attrs.py): numbers a trace declares must fit what reads them, the index checks cost less
memory than the index itself, and the parser reads exactly what h5py reads, within bounded work."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

import tracediff as td
from tests import test_readers_hostile as hostile
from tests.test_readers_hostile import arrow_rewrite, h5_edit, refused, set_final, set_run_meta
from tracediff.errors import TraceError
from tracediff.trace import h5attrs
from tracediff.trace.checks import RecordShapes, first_fault
from tracediff.trace.convert import convert

originals, copy = hostile.originals, hostile.copy  # the mutants' fixtures: one home, test_readers_hostile


def metadata(path: Path) -> tuple[dict, dict]:
    with td.open_trace(path) as trace:
        return dict(trace.meta), dict(trace.finals[0] or {})


# --- numbers that must fit what reads them ------------------------------------------------------

@pytest.mark.parametrize("fmt", ["h5", "arrow"])
@pytest.mark.parametrize("where,key,value,words", [
    ("run", "rank", 1 << 31, "2^31-1"),  # records hold ranks as int32: convert crashed on it
    ("run", "world_size", 10**30, "an integer of 31 digits"),
    ("final", "bytes", 1 << 63, "2^63-1"),
    ("final", "dropped", {"h": 1 << 64}, "key 'dropped'"),
])
def test_metadata_integers_beyond_the_columns_that_hold_them_are_refused(copy, fmt, where, key, value,
                                                                          words) -> None:
    path = copy(fmt)
    run, final = metadata(path)
    if where == "run":
        set_run_meta(path, json.dumps({**run, key: value}).encode())
    else:
        set_final(path, json.dumps({**final, key: value}).encode())
    refused(path, f"key {key!r}", words)


def test_a_rank_within_int32_still_converts(copy, tmp_path) -> None:
    """The bound is the int32 column's, not tighter: the largest rank converts."""
    path = copy("h5")
    run, _ = metadata(path)
    set_run_meta(path, json.dumps({**run, "rank": (1 << 31) - 1}).encode())
    convert(path, tmp_path / "out.arrow")
    with td.open_trace(tmp_path / "out.arrow") as trace:
        assert trace.meta["rank"] == (1 << 31) - 1 and len(trace.request_tokens()) == 2


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
def test_a_record_of_no_rows_with_an_impossible_row_shape_is_refused(copy, fmt) -> None:
    """Shape [0, 2^62]: no bytes, yet numpy cannot make an array of it (convert crashed)."""
    path = copy(fmt)
    if fmt == "h5":
        h5_edit(path, records_shape={0: [0, 1 << 62, -1, -1, -1, -1, -1, -1]}, records_n_rows={0: 0},
                records_data_nbytes={0: 0})
    else:
        def index(cols: dict) -> None:
            cols["shape"][cols["name"].index("h")] = [0, 1 << 62]

        def batch(b: int, cols: dict) -> None:
            if b == 0:
                i = cols["name"].index("h")
                cols["shape"][i], cols["data"][i] = [0, 1 << 62], b""
                cols["request"][i], cols["position"][i], cols["token_id"][i] = [], [], []
        arrow_rewrite(path, batch=batch, index=index)
    refused(path, "record 0", "2^62")


def test_an_hdf5_format_version_of_another_type_is_named() -> None:
    """Not "TypeError('an HDF5 value of type cl...": what the attribute holds."""
    from tracediff.trace.checks import format_version

    with pytest.raises(TraceError) as caught:
        format_version("t.h5", TypeError("a floating-point number"))
    assert caught.value.problem == "format version is a floating-point number, not a positive integer"


def test_index_checks_take_less_memory_than_the_index_they_check() -> None:
    """A 10M-record HDF5 index is a 640 MB shape column: its checks went one dims column at a time
    (was 3.3x the column, 6.8 s at 10M; now 0.8x, 1.4 s)."""
    n = 1_000_000
    dims = np.full((n, 8), -1, np.int64)
    dims[:, :2] = (4, 4096)
    shapes = RecordShapes(np.full(n, 2, np.int64), np.zeros(n, bool), np.full(n, 2, np.int64), dims,
                          np.full(n, 4, np.int64), np.full(n, 4 * 4096 * 2, np.int64))
    tracemalloc.start()
    try:
        assert first_fault(shapes.faults(), n) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < dims.nbytes


def test_index_checks_refuse_what_they_should_at_every_dim() -> None:
    """Each dims column is looked at, the ones past ndim are not."""
    dims = np.array([[2, 3, -1], [2, -3, 7], [2, 1 << 31, 1 << 31], [0, 1 << 61, 4], [2, 3, 5]], np.int64)
    ndim = np.array([2, 2, 3, 3, 3])
    shapes = RecordShapes.derived(np.full(5, 4, np.int64), np.zeros(5, bool), ndim, dims)
    faults = shapes.faults()
    judged = [first_fault([(mask[i : i + 1], why) for mask, why in faults], 1) for i in range(5)]
    assert [j and j[1] for j in judged] == [None, "a negative dimension", *["a shape of 2^62 bytes or more "
                                                                           "(dims of 0 aside)"] * 2, None]
    assert shapes.nbytes.tolist() == [24, 0, 0, 0, 120]


# --- our HDF5 root-attribute parser against h5py ------------------------------------------------

LONG = json.dumps({"s": "é€😀" * 100_000})
CASES: dict[str, tuple[dict, dict]] = {
    "latest": ({"libver": "latest"}, {"format": "tracediff", "format_version": 2, "meta": '{"a": 1}'}),
    "earliest": ({"libver": "earliest"}, {"format": "tracediff", "format_version": 2, "meta": "{}"}),
    "userblock": ({"userblock_size": 512}, {"format": "tracediff", "format_version": 2, "meta": "{}"}),
    "long-non-ascii": ({"libver": "latest"}, {"format": "tracediff", "format_version": 2, "meta": LONG}),
    "long-earliest": ({"libver": "earliest"}, {"format": "tracediff", "format_version": 2, "meta": LONG}),
    "creation-order": ({"libver": "latest", "track_order": True}, {"format": "tracediff", "meta": "{}"}),
    "many-compact": ({"libver": "earliest"}, {**{f"x{i}": "v" * 1000 for i in range(200)}, "format": "t"}),
    "dense": ({"libver": "latest"}, {**{f"x{i}": i for i in range(20)}, "format": "tracediff"}),
    "fixed-strings": ({}, {"format": np.bytes_(b"tracediff"), "meta": np.bytes_(b"{}\0\0")}),
    "ints": ({}, {"format": np.int16(-7), "format_version": np.uint64((1 << 64) - 1),
                  "meta": np.array(-5, ">i8")}),
    "one-element-arrays": ({}, {"format": np.array([b"tracediff"]), "format_version": np.array([2])}),
    "other-types": ({}, {"format": True, "format_version": 2.0, "meta": h5py.Empty("f")}),
    "vlen-ascii": ({}, {"format": np.array(b"tracediff", dtype=h5py.string_dtype("ascii"))}),
    "empty": ({}, {"format": "", "meta": ""}),
}


def padded(raw: bytes, padding: int) -> dict:
    """A root attribute ``format`` of exactly these bytes in a fixed-length string with this padding."""
    kind = h5py.h5t.C_S1.copy()
    kind.set_size(len(raw))
    kind.set_strpad(padding)
    return {"format": (kind, raw)}


for _name, _pad in (("space", h5py.h5t.STR_SPACEPAD), ("nullterm", h5py.h5t.STR_NULLTERM),
                    ("nullpad", h5py.h5t.STR_NULLPAD)):
    for _k, _raw in enumerate((b"ab\0cd  \0 \0", b"ab  \0\0  ", b"ab\0\0")):
        CASES[f"{_name}-padded-{_k}"] = ({}, padded(_raw, _pad))


def h5_file(path: Path, options: dict, attrs: dict) -> Path:
    with h5py.File(path, "w", **options) as f:
        for key, value in attrs.items():
            if isinstance(value, tuple):  # (fixed-length string type, raw bytes): written as they are
                kind, raw = value
                attr = h5py.h5a.create(f.id, key.encode(), kind, h5py.h5s.create(h5py.h5s.SCALAR))
                attr.write(np.array(raw, dtype=f"S{len(raw)}"), mtype=kind)
            else:
                f.attrs[key] = value
    return path


def plain(values: dict) -> dict:
    """What a reader can use: ints and bytes as they are; anything else is only 'not those'."""
    return {k: v if isinstance(v, (int, bytes)) else "other" for k, v in values.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_root_attribute_parser_reads_what_h5py_reads(tmp_path, case) -> None:
    options, attrs = CASES[case]
    path = h5_file(tmp_path / "a.h5", options, attrs)
    by_h5py = plain(h5attrs._read_in_child(path))
    try:
        ours = plain(h5attrs._parse(path))
    except h5attrs.Unsupported:
        assert case == "dense"  # the one layout handed to h5py (in a child, under a time limit)
        ours = plain(h5attrs.root_attributes(path))
    assert ours == by_h5py
    assert set(ours) == set(attrs) & set(h5attrs.WANTED)


def test_the_root_attribute_parser_reads_a_real_trace_without_a_child(copy) -> None:
    values = h5attrs._parse(copy("h5"))
    assert values["format"] == b"tracediff" and values["format_version"] == td.trace.FORMAT_VERSION
    assert json.loads(values["meta"])["source"] == "training"


def crafted_header_loop(path: Path, chunks: int = 63, size: int = 1 << 20) -> Path:
    """A superblock whose root object header continues, ``chunks`` times, into one ``size``-byte
    chunk of empty 4-byte messages: 16M messages for a 1 MiB file."""
    superblock = (h5attrs.SIGNATURE + bytes([2, 8, 8, 0]) + struct.pack("<QQQQ", 0, (1 << 64) - 1, 0, 64)
                  + bytes(4)).ljust(64, b"\0")
    at = 4096
    continuation = bytes([h5attrs.CONTINUATION, 16, 0, 0]) + struct.pack("<QQ", at, size)
    header = b"OHDR" + bytes([2, 0x02]) + struct.pack("<I", chunks * len(continuation)) \
        + continuation * chunks + bytes(4)
    path.write_bytes((superblock + header).ljust(at, b"\0") + b"OCHK" + bytes(size - 8) + bytes(4))
    return path


def test_the_root_header_is_bounded_in_total_not_only_per_chunk(tmp_path) -> None:
    """Each chunk was bounded (1 MiB) and their number (64), not their sum: this file took our
    parser 19 s of Python loop. Past 1 MiB in all, the header is h5py's to read, in a child under
    its time limit."""
    path = crafted_header_loop(tmp_path / "loop.h5")
    started = time.monotonic()
    with pytest.raises(h5attrs.Unsupported, match="more than 1048576 bytes"):
        h5attrs._parse(path)
    with pytest.raises(TraceError) as caught:
        h5attrs.root_attributes(path)
    assert "unreadable HDF5 root attributes" in caught.value.problem
    assert time.monotonic() - started < 10


def test_a_child_answer_after_other_output_is_still_read(tmp_path, monkeypatch) -> None:
    """A sitecustomize that prints (or a warning on stdout) does not make a valid file unreadable."""
    path = h5_file(tmp_path / "a.h5", {}, {"format": "tracediff", "format_version": 2})
    monkeypatch.setattr(h5attrs, "_CHILD", "print('hello from sitecustomize')\n" + h5attrs._CHILD)
    assert h5attrs._read_in_child(path) == {"format": b"tracediff", "format_version": 2}
