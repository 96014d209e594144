"""A trace still being recorded reads up to its last indexed record, whatever its writer appended since.

A reader of a live HDF5 trace may find rows (and records) whose request strings are not yet in its
string table: they belong to a write not yet flushed whole, and are cut off like other unflushed data.
The torn state is made here deterministically, with h5py, on a trace written by tracediff's writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import cli

import tracediff as td
from tracediff.trace.schema import Record
from tracediff.trace.writer import open_writer


def record(i: int, request: str) -> Record:
    return Record(name="t.x", data=np.full((2, 4), i, np.float32), dtype="float32", seq_no=i, step=i,
                  request=np.array([request] * 2, dtype=object), position=np.arange(2),
                  token_id=np.full(2, i, np.int64))


def live_trace(path: Path, n: int = 3) -> Path:
    """A trace of ``n`` records, each of its own request, then made one that was never closed: its
    final metadata emptied (as a live writer's is)."""
    writer = open_writer(path, {"source": "test"})
    writer.write([record(i, f"r{i}") for i in range(n)])
    writer.close({"closed": True, "records": n, "bytes": n * 32})
    with h5py.File(path, "a") as f:
        for name in ("final", "final_crc"):
            f[name].resize((0,))
    return path


def append(f: h5py.File, name: str, values: np.ndarray) -> None:
    dset = f[name]
    start = dset.shape[0]
    dset.resize((start + len(values), *dset.shape[1:]))
    dset[start:] = values


def n_strings(f: h5py.File) -> int:
    return int(f["strings/ends"].shape[0])


def torn_rows(path: Path) -> None:
    """Rows of a write whose strings (and records) were not flushed yet: past the last indexed record."""
    with h5py.File(path, "a") as f:
        append(f, "rows/request", np.full(2, n_strings(f), np.int32))
        append(f, "rows/position", np.arange(2, dtype=np.int64))
        append(f, "rows/token_id", np.zeros(2, np.int64))


def torn_record(path: Path) -> None:
    """The torn rows above and a record pointing at them: its index entry reached the file before the
    strings its rows name (what a reader saw in 2 of 20 reads of a live trace)."""
    torn_rows(path)
    with h5py.File(path, "a") as f:
        cols = {key: f[f"records/{key}"][-1] for key in f["records"] if key not in ("shape", "checksums")}
        cols.update(seq_no=cols["seq_no"] + 1, step=cols["step"] + 1, data_offset=f["data"].shape[0],
                    row_start=f["rows/position"].shape[0] - 2)
        append(f, "data", np.zeros(32, np.uint8))
        for key, value in cols.items():
            append(f, f"records/{key}", np.array([value], dtype=f[f"records/{key}"].dtype))
        append(f, "records/shape", f["records/shape"][-1:])
        append(f, "records/checksums", f["records/checksums"][-1:])


@pytest.mark.parametrize("torn", [torn_rows, torn_record], ids=["rows", "record"])
def test_a_live_h5_trace_reads_up_to_its_last_indexed_record(tmp_path, torn) -> None:
    path = live_trace(tmp_path / "live.h5")
    torn(path)
    shown = cli("show", str(path), "--json")
    assert shown.returncode == 0, shown.stderr
    [tensor] = json.loads(shown.stdout)["tensors"]
    assert (tensor["records"], tensor["rows"], tensor["requests"]) == (3, 6, 3)
    done = cli("show", str(path), "--name", "t.x", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 6
    compared = cli("compare", str(path), str(path))  # what it holds matches; a live trace is partial
    assert compared.returncode == 3, compared.stdout + compared.stderr
    assert compared.stdout.startswith("incomplete: a was never closed by its writer"), compared.stdout
    with td.open_trace(path) as trace:
        rows = trace.rows("t.x")
        assert list(rows.request) == ["r0", "r0", "r1", "r1", "r2", "r2"]
        assert np.array_equal(rows.data[::2, 0], [0, 1, 2])


def test_a_closed_h5_trace_is_held_to_its_string_table(tmp_path) -> None:
    """Cut-off is for traces whose writer may still be writing: a closed one whose record names a
    string its table lacks is refused, one error line."""
    path = tmp_path / "closed.h5"
    writer = open_writer(path, {"source": "test"})
    writer.write([record(i, f"r{i}") for i in range(2)])
    writer.close({"closed": True, "records": 2, "bytes": 64})
    with h5py.File(path, "a") as f:
        request = f["rows/request"]
        request[-1] = n_strings(f)
    done = cli("show", str(path), "--name", "t.x")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {path}: "), done.stderr
    assert "outside the string table" in done.stderr or "checksum" in done.stderr, done.stderr
