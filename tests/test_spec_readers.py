"""docs/FORMAT.md is a contract: read traces with h5py, pyarrow and polars alone, by the spec."""

from __future__ import annotations

import json
import zlib

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import tracediff as td


@pytest.fixture
def logged(tmp_path):
    """A bfloat16 tensor (raw bits), an int tensor and a static one, written in both formats."""
    torch = pytest.importorskip("torch")
    hidden = torch.randn(5, 4).to(torch.bfloat16)
    tokens = np.array([7, 8, 9, 10, 11])
    paths = {}
    for fmt in ("h5", "arrow"):
        paths[fmt] = tmp_path / f"spec.{fmt}"
        with td.record(paths[fmt], source="serving", meta={"aux_layer_ids": [1]}) as rec:
            rec.log("draft.hidden", hidden, step=3, depth=2, token_ids=tokens, positions=tokens - 7,
                    request="r9")
            rec.log_static("draft.d2t", np.array([0, 0, 5], np.int64))
    bits = hidden.view(torch.int16).numpy().view(np.uint16)
    return paths, bits, tokens


def test_hdf5_by_the_spec(logged) -> None:
    paths, bits, tokens = logged
    with h5py.File(paths["h5"], "r") as f:
        assert f.attrs["format"] == "tracediff" and f.attrs["format_version"] == 3
        assert json.loads(f.attrs["meta"])["contract"] == {"aux_layer_ids": [1]}
        assert f.attrs["meta_crc32"] == zlib.crc32(f.attrs["meta"].encode())
        ends = f["strings/ends"][:]
        blob = f["strings/bytes"][:].tobytes()
        strings = [blob[s:e].decode() for s, e in zip(np.concatenate([[0], ends[:-1]]), ends)]
        rec = {key: f[f"records/{key}"][:] for key in f["records"] if key != "shape"}
        i = [strings[n] for n in rec["name"]].index("draft.hidden")
        assert strings[rec["dtype"][i]] == "bfloat16"
        assert (rec["step"][i], rec["depth"][i], rec["static"][i]) == (3, 2, 0)
        shape = f["records/shape"][i, : rec["ndim"][i]]
        start, n = rec["data_offset"][i], rec["data_nbytes"][i]
        raw = f["data"][start : start + n].view(np.uint16).reshape(shape)
        assert np.array_equal(raw, bits)
        data_crc, record_crc, rows_crc = f["records/checksums"][i]
        assert data_crc == zlib.crc32(f["data"][start : start + n].tobytes())
        fields = [rec["seq_no"][i], 3, rec["rank"][i], 2, 0, *shape]
        assert record_crc == zlib.crc32(np.array(fields, "<i8").tobytes() + b"draft.hidden\0bfloat16\0")
        rows = slice(rec["row_start"][i], rec["row_start"][i] + rec["n_rows"][i])
        assert f["rows/token_id"][rows].tolist() == tokens.tolist()
        assert f["rows/position"][rows].tolist() == list(range(5))
        assert {strings[r] for r in f["rows/request"][rows]} == {"r9"}
        keys = np.concatenate([f["rows/position"][rows], f["rows/token_id"][rows]]).astype("<i8").tobytes()
        assert rows_crc == zlib.crc32(keys + b"\0".join([b"r9"] * 5))
        assert f["final_crc"][0] == zlib.crc32(f["final"][:].tobytes())
        assert json.loads(f["final"][:].tobytes())["records"] == 2


def test_arrow_by_the_spec(logged) -> None:
    paths, bits, tokens = logged
    reader = pa.ipc.open_file(str(paths["arrow"]))
    meta = reader.schema.metadata
    assert meta[b"tracediff.format"] == b"tracediff" and meta[b"tracediff.format_version"] == b"3"
    assert int(meta[b"tracediff.meta_crc32"]) == zlib.crc32(meta[b"tracediff.meta"])
    table = reader.read_all()
    row = table.filter(pc.equal(table["name"], "draft.hidden")).to_pylist()[0]
    assert (row["dtype"], row["step"], row["depth"], row["static"]) == ("bfloat16", 3, 2, False)
    raw = np.frombuffer(row["data"], dtype=np.uint16).reshape(row["shape"])
    assert np.array_equal(raw, bits)
    assert row["data_crc"] == zlib.crc32(row["data"])
    fields = np.array([row["seq_no"], 3, row["rank"], 2, 0, *row["shape"]], "<i8").tobytes()
    assert row["record_crc"] == zlib.crc32(fields + b"draft.hidden\0bfloat16\0")
    keys = np.array(row["position"] + row["token_id"], "<i8").tobytes()
    assert row["rows_crc"] == zlib.crc32(keys + b"\0".join([b"r9"] * 5))
    assert row["token_id"] == tokens.tolist() and row["request"] == ["r9"] * 5
    reserved = {r["name"]: r["data"] for r in table.to_pylist() if r["name"].startswith("__")}
    assert json.loads(reserved["__final__"])["closed"] is True
    index = pa.ipc.open_stream(pa.py_buffer(reserved["__index__"])).read_all().to_pylist()
    assert [(r["name"], r["batch"], r["row"]) for r in index] == [("draft.hidden", 0, 0), ("draft.d2t", 0, 1),
                                                                       ("__tokens__", 0, 2)]


def test_polars_reads_arrow_traces(logged) -> None:
    pl = pytest.importorskip("polars")
    frame = pl.read_ipc(logged[0]["arrow"])
    hidden = frame.filter(pl.col("name") == "draft.hidden")
    assert hidden["token_id"].to_list() == [logged[2].tolist()]
    assert hidden["shape"].to_list() == [[5, 4]]
