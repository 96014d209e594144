"""Every dtype through both formats, read back bit-identical; convert round-trips."""

from __future__ import annotations

import numpy as np
import pytest

import tracediff as td
from tracediff.trace.convert import convert

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(7)


def bf16_bits() -> np.ndarray:
    """Random bfloat16 bit patterns plus the awkward ones: +-0, +-Inf, NaNs, subnormals."""
    bits = RNG.integers(0, 1 << 16, size=(6, 5), dtype=np.uint16)
    bits[0, :5] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1]
    bits[1, :2] = [0x0001, 0x807F]
    return bits


def all_dtype_tensors() -> dict[str, object]:
    floats = RNG.standard_normal((6, 5))
    floats[0, 0], floats[0, 1], floats[0, 2] = np.nan, np.inf, -0.0
    return {
        "t.float32": floats.astype(np.float32),
        "t.float64": floats,
        "t.float16": floats.astype(np.float16),
        "t.bfloat16": torch.from_numpy(bf16_bits().view(np.int16)).view(torch.bfloat16),
        "t.float32_torch": torch.from_numpy(floats.astype(np.float32)),
        "t.int64": RNG.integers(-(1 << 62), 1 << 62, size=(6, 5), dtype=np.int64),
        "t.int32": RNG.integers(-(1 << 30), 1 << 30, size=(6, 5), dtype=np.int32),
        "t.int16": RNG.integers(-(1 << 14), 1 << 14, size=(6, 5), dtype=np.int16),
        "t.int8": RNG.integers(-100, 100, size=(6, 5), dtype=np.int8),
        "t.uint8": RNG.integers(0, 255, size=(6, 5), dtype=np.uint8),
        "t.bool": RNG.integers(0, 2, size=(6, 5)).astype(bool),
        "t.rank4": RNG.standard_normal((6, 2, 3, 4)).astype(np.float32),
        "t.rank1": RNG.standard_normal(6).astype(np.float32),
    }


def raw_bits(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()
    return x


def write_all(path, tensors, compression=None) -> None:
    with td.record(path, source="training", meta={"aux_layer_ids": [1, 3]}, flush_interval=0.01,
                   compression=compression) as rec:
        for step in range(2):
            for name, x in tensors.items():
                rec.log(name, x, step=step, token_ids=np.arange(6) + 100, positions=np.arange(6) + 3,
                        request=[f"req{i % 2}" for i in range(6)])
        rec.log_static("draft.d2t", np.arange(10, dtype=np.int64) * 2)
    assert rec.stopped is None


def assert_same_trace(a: td.Trace, tensors: dict) -> None:
    assert a.complete
    assert a.meta["contract"] == {"aux_layer_ids": [1, 3]}
    assert a.names() == [*tensors, "draft.d2t"]
    for name, x in tensors.items():
        rows = a.rows(name)
        expect = np.concatenate([raw_bits(x)] * 2)
        assert rows.data.dtype == expect.dtype, name
        assert rows.data.tobytes() == expect.tobytes(), name
        assert rows.token_id.tolist() == list(range(100, 106)) * 2
        assert rows.position.tolist() == list(range(3, 9)) * 2
        assert rows.request.tolist() == ["req0", "req1"] * 6
        assert rows.step.tolist() == [0] * 6 + [1] * 6
    bf16 = a.read(a.select(name="t.bfloat16")[0])
    assert bf16.dtype == "bfloat16"
    assert torch.equal(bf16.torch().view(torch.int16), tensors["t.bfloat16"].view(torch.int16))
    static = a.read(a.select(name="draft.d2t")[0])
    assert static.static and static.n_rows == 0 and static.data.tolist() == list(range(0, 20, 2))


def test_every_dtype_bit_identical(tmp_path, fmt) -> None:
    tensors = all_dtype_tensors()
    path = tmp_path / f"t.{fmt}"
    write_all(path, tensors)
    with td.open_trace(path) as trace:
        assert_same_trace(trace, tensors)


@pytest.mark.parametrize(("name", "compression"), [("c.h5", "gzip"), ("c.h5", "lzf"), ("c.arrow", "zstd"),
                                                  ("c.arrow", "lz4")])
def test_compressed_traces_read_back_bit_identical(tmp_path, name, compression) -> None:
    tensors = all_dtype_tensors()
    write_all(tmp_path / name, tensors, compression)
    with td.open_trace(tmp_path / name) as trace:
        assert_same_trace(trace, tensors)


def test_bfloat16_decodes_exactly_to_float32(tmp_path, fmt) -> None:
    x = torch.randn(8, 4).to(torch.bfloat16)
    with td.record(tmp_path / f"b.{fmt}") as rec:
        rec.log("b", x, token_ids=np.arange(8))
    with td.open_trace(tmp_path / f"b.{fmt}") as trace:
        assert np.array_equal(trace.rows("b").numpy(), x.float().numpy())


def test_convert_round_trips(tmp_path) -> None:
    tensors = all_dtype_tensors()
    write_all(tmp_path / "a.h5", tensors)
    convert(tmp_path / "a.h5", tmp_path / "b.arrow")
    convert(tmp_path / "b.arrow", tmp_path / "c.h5")
    with td.open_trace(tmp_path / "a.h5") as a, td.open_trace(tmp_path / "c.h5") as c:
        assert_same_trace(c, tensors)
        assert a.meta == c.meta and a.finals == c.finals
        for i in range(len(a.index)):
            ra, rc = a.read(i), c.read(i)
            assert (ra.name, ra.seq_no, ra.step, ra.rank, ra.depth) == (rc.name, rc.seq_no, rc.step, rc.rank,
                                                                        rc.depth)
            assert ra.data.tobytes() == rc.data.tobytes()


def test_rows_of_one_step_and_request(tmp_path, fmt) -> None:
    with td.record(tmp_path / f"s.{fmt}") as rec:
        for step in range(5):
            rec.log("h", np.full((3, 2), step, np.float32), step=step, token_ids=np.arange(3),
                    request=["a", "b", "c"])
    with td.open_trace(tmp_path / f"s.{fmt}") as trace:
        rows = trace.rows("h", step=3, request="b")
        assert rows.data.tolist() == [[3.0, 3.0]]
        assert rows.position.tolist() == [1]
        with pytest.raises(KeyError):
            trace.rows("h", step=9)


def test_the_last_static_record_of_a_name(tmp_path, fmt) -> None:
    """A static tensor logged again (a weight after an update) reads as its last record, or the last
    at one step; a name with rows only, or none at all, has no static record."""
    with td.record(tmp_path / f"w.{fmt}") as rec:
        for step in range(3):
            rec.log_static("fc.weight", np.full(4, step, np.float32), step=step)
        rec.log("h", np.zeros((2, 4), np.float32), token_ids=[5, 6])
    with td.open_trace(tmp_path / f"w.{fmt}") as trace:
        assert trace.last_static("fc.weight").numpy().tolist() == [2.0] * 4
        assert trace.last_static("fc.weight", step=1).numpy().tolist() == [1.0] * 4
        assert trace.last_static("fc.weight", step=7) is None
        assert trace.last_static("h") is None and trace.last_static("nothing") is None


def test_closed_arrow_trace_opens_from_its_index_without_visiting_batches(tmp_path) -> None:
    import pyarrow as pa

    from tracediff.trace.arrow import INDEX_COLUMNS, key_columns

    path = tmp_path / "many.arrow"
    with td.record(path) as rec:
        for step in range(6):
            rec.log("h", np.full((2, 3), step, np.float32), step=step, token_ids=np.arange(2), request="r")
            rec.log_static("w", np.arange(step + 1), step=step)
            rec.flush()
    reader = pa.ipc.open_file(str(path))
    assert reader.num_record_batches == 7  # six flushes and the closing batch
    scanned = {key: [] for key in INDEX_COLUMNS}
    for b in range(reader.num_record_batches):
        for key, values in key_columns(reader.get_batch(b), b).items():
            scanned[key].extend(values)
    tensors = [i for i, name in enumerate(scanned["name"]) if name != "__tokens__"]
    with td.open_trace(path) as trace:
        file = trace.files[0]
        assert list(file._batches) == [6]  # only the closing batch was read
        assert file._locations == list(zip(scanned["batch"], scanned["row"]))  # __tokens__ records too
        assert trace.index.name.tolist() == [scanned["name"][i] for i in tensors]
        assert trace.index.step.tolist() == [scanned["step"][i] for i in tensors]
        assert [tuple(scanned["shape"][i]) for i in tensors] == trace.index.shape
        assert trace.index.slot.tolist() == tensors
        assert file.token_slots.tolist() == [2]  # learned at the first flush; later ones add nothing new
        assert trace.rows("h", step=4).data.tolist() == [[4.0] * 3] * 2
        assert trace.read(trace.select(name="w", step=5)[0]).data.tolist() == list(range(6))


def test_convert_into_a_missing_directory_is_one_line(tmp_path) -> None:
    from tests.conftest import cli

    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", np.zeros((2, 2), np.float32), token_ids=np.arange(2))
    target = tmp_path / "missing_dir" / "b.arrow"
    out = cli("convert", str(tmp_path / "a.h5"), str(target))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"error: {target}: output directory {target.parent} does not exist"
    assert not target.parent.exists()
