"""Checksums (format version 3): a flipped byte in a record's tensor bytes, its key columns or the
metadata of a real trace is refused with one error line naming it; ``--no-verify`` reads it; a trace
written before checksums opens and says it is unverified; convert and slice write valid checksums.

The byte to flip is found from the file itself: the record's exact bytes searched for in the file,
HDF5's chunk index for a dataset's bytes (h5py), pyarrow's buffer addresses in a memory map."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pytest
import torch

import tracediff as td
from tests.conftest import REPO, cli
from tracediff.errors import TraceError
from tracediff.trace.convert import convert

H = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)


def write_trace(path: Path) -> Path:
    """Two tensors over three flushes, one request; every record's bytes unique in the file."""
    with td.record(path, source="training") as rec:
        for step in range(3):
            rec.log("h", H + 10 * step, step=step, token_ids=np.arange(2) + 1000 * step,
                    positions=np.arange(2) + 2 * step, request="r")
            rec.log("g", H * (step + 2) + 0.5, step=step, token_ids=np.arange(2) + 1000 * step,
                    positions=np.arange(2) + 2 * step, request="r")
            rec.flush()
    return path


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("originals")
    return {fmt: write_trace(root / f"t.{fmt}") for fmt in ("h5", "arrow")}


@pytest.fixture
def copy(originals, tmp_path):
    def make(fmt: str) -> Path:
        return Path(shutil.copy(originals[fmt], tmp_path / f"mutant.{fmt}"))
    return make


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x01]))


def the_record(path: Path, name: str, step: int) -> tuple[int, np.ndarray]:
    """(file slot, raw bytes) of one record, read without checksums."""
    with td.open_trace(path, verify=False) as trace:
        i = int(trace.select(name=name, step=step)[0])
        return int(trace.index.slot[i]), trace.read(i).data.reshape(-1).view(np.uint8).copy()


def data_byte(path: Path, name: str, step: int) -> int:
    """A byte of the record's tensor: its exact bytes are found once in the file."""
    raw = path.read_bytes()
    wanted = the_record(path, name, step)[1].tobytes()
    at = raw.find(wanted)
    assert at >= 0 and raw.find(wanted, at + 1) < 0
    return at + len(wanted) // 2


def h5_dataset_byte(path: Path, dataset: str, entry: int) -> int:
    """File offset of entry ``entry`` of a 1-D chunked, unfiltered HDF5 dataset (HDF5's chunk index)."""
    with h5py.File(path, "r") as f:
        dset = f[dataset]
        chunk = dset.chunks[0]
        info = dset.id.get_chunk_info_by_coord(((entry // chunk) * chunk,))
        return info.byte_offset + (entry % chunk) * dset.dtype.itemsize


def arrow_value_byte(path: Path, column: str, name: str, step: int) -> int:
    """File offset of the first value of ``column`` (a list column) in the batch row of one record."""
    with pa.memory_map(str(path), "r") as source:
        base = source.read_buffer(1).address  # the map's first byte: a buffer's address - base is its offset
        source.seek(0)
        reader = pa.ipc.open_file(source)
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            names, steps = batch.column("name").to_pylist(), batch.column("step").to_pylist()
            for row, (n, s) in enumerate(zip(names, steps)):
                if (n, s) == (name, step):
                    values = batch.column(column)
                    first = values.offsets[row].as_py()
                    buffer = values.values.buffers()[1]
                    return buffer.address - base + (values.values.offset + first) * 8
    raise AssertionError(f"no record {name} step {step}")


def key_byte(path: Path, name: str, step: int) -> int:
    """A byte of the record's first token id (its key columns)."""
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            with td.open_trace(path, verify=False) as trace:
                slot = int(trace.index.slot[trace.select(name=name, step=step)[0]])
            row = int(f["records/row_start"][slot])
        return h5_dataset_byte(path, "rows/token_id", row)
    return arrow_value_byte(path, "token_id", name, step)


def one_error_line(stderr: str, path: Path, slot: int, name: str, step: int) -> None:
    assert stderr.strip().splitlines() == [
        f"error: {path}: corrupt trace: record {slot} ({name}, step {step}) fails its checksum"]


def test_a_trace_written_now_carries_checksums_and_reads_whole(originals, fmt) -> None:
    with td.open_trace(originals[fmt]) as trace:
        assert trace.checksummed and trace.files[0].version == td.trace.FORMAT_VERSION
        for i in range(len(trace.index)):
            trace.read(i)
        trace.rows("g")
        assert len(trace.request_tokens()) == 6


@pytest.mark.parametrize("where", ["tensor", "keys"])
def test_a_flipped_byte_of_a_record_fails_compare_and_show_naming_it(originals, copy, fmt, where) -> None:
    path = copy(fmt)
    slot, _ = the_record(path, "g", 1)
    flip(path, data_byte(path, "g", 1) if where == "tensor" else key_byte(path, "g", 1))
    compared = cli("compare", str(originals[fmt]), str(path))
    assert compared.returncode == 2
    one_error_line(compared.stderr, path, slot, "g", 1)
    shown = cli("show", str(path), "--name", "g")
    assert shown.returncode == 2
    one_error_line(shown.stderr, path, slot, "g", 1)
    with pytest.raises(TraceError, match=f"record {slot} \\(g, step 1\\) fails its checksum"):
        with td.open_trace(path) as trace:
            trace.rows("g")


@pytest.mark.parametrize("where", ["tensor", "keys"])
def test_no_verify_reads_the_flipped_record(copy, fmt, where) -> None:
    path = copy(fmt)
    flip(path, data_byte(path, "g", 1) if where == "tensor" else key_byte(path, "g", 1))
    shown = cli("show", str(path), "--name", "g", "--no-verify")
    assert shown.returncode == 0 and shown.stderr == ""
    with td.open_trace(path, verify=False) as trace:
        assert trace.rows("g").data.shape == (6, 64)
    summary = cli("show", str(path), "--no-verify")
    assert summary.returncode == 0 and "unverified: --no-verify" in summary.stdout
    assert json.loads(cli("show", str(path), "--no-verify", "--json").stdout)["unverified"] == "--no-verify"
    with pytest.raises(TraceError), td.open_trace(path) as trace:  # the command's option stayed its own
        trace.rows("g")
    assert cli("compare", str(path), str(path)).returncode == 2  # verified: the flipped record fails
    assert "checksum" not in cli("compare", str(path), str(path), "--no-verify").stderr


def test_a_flipped_step_of_a_record_fails_at_open(copy) -> None:
    """A record's own key columns are checked when the index is loaded: show lists nothing wrong."""
    path = copy("h5")
    slot, _ = the_record(path, "g", 1)
    flip(path, h5_dataset_byte(path, "records/step", slot))  # step 1 -> 0
    shown = cli("show", str(path))
    assert shown.returncode == 2
    one_error_line(shown.stderr, path, slot, "g", 0)


def test_flipped_run_metadata_fails_at_open(copy, fmt) -> None:
    """The metadata still parses (training -> traininf): only its checksum tells. An Arrow file
    holds its schema twice, at its head and in its footer, which readers of a closed file use."""
    path = copy(fmt)
    raw, text = path.read_bytes(), b'"source": "training"'
    at = raw.rfind(text)
    assert raw.count(text) == (1 if fmt == "h5" else 2)
    flip(path, at + len(text) - 2)
    shown = cli("show", str(path))
    assert shown.returncode == 2
    assert shown.stderr.strip().splitlines() == [
        f"error: {path}: corrupt trace: its run metadata fails its checksum"]
    with td.open_trace(path, verify=False) as trace:
        assert trace.meta["source"] == "traininf"


def test_a_trace_written_before_checksums_opens_unverified() -> None:
    old = REPO / "tests" / "data" / "format_v1_serving.h5"
    with td.open_trace(old) as trace:
        assert not trace.checksummed
        for i in range(len(trace.index)):
            trace.read(i)
    shown = cli("show", str(old))
    assert shown.returncode == 0 and "unverified: written before checksums" in shown.stdout
    assert json.loads(cli("show", str(old), "--json").stdout)["unverified"] == "written before checksums"
    assert json.loads(cli("show", str(REPO / "traces" / "eagle3" / "serving.h5"), "--json").stdout)[
        "unverified"] is None


@pytest.mark.parametrize("route", ["h5>arrow>h5", "arrow>h5>arrow"])
def test_convert_and_slice_keep_checksums_valid(originals, tmp_path, route) -> None:
    first, second, third = route.split(">")
    a, b = tmp_path / f"a.{second}", tmp_path / f"b.{third}"
    convert(originals[first], a)
    convert(a, b)
    sliced = tmp_path / f"s.{first}"
    assert cli("slice", str(b), "--out", str(sliced), "--steps", "1:3").returncode == 0
    with td.open_trace(originals[first]) as source:
        crcs = {(n, s): source.files[0].data_crcs[slot]
                for n, s, slot in zip(source.index.name, source.index.step, source.index.slot)}
    for path in (a, b, sliced):
        with td.open_trace(path) as trace:
            assert trace.checksummed
            for i in range(len(trace.index)):
                trace.read(i)
            trace.rows("g")
            trace.request_tokens()
            file = trace.files[0]
            for n, s, slot in zip(trace.index.name, trace.index.step, trace.index.slot):
                assert file.data_crcs[slot] == crcs[(n, s)]
        assert cli("compare", str(originals[first]), str(path)).returncode != 2


# --- every byte that holds a trace's content: a flip is refused or changes nothing ----------------

def snapshot(path: Path) -> tuple:
    """Everything a trace says: metadata, final metadata, each record whole, the token table."""
    with td.open_trace(path) as trace:
        records = []
        for i in range(len(trace.index)):
            r = trace.read(i)
            records.append((r.name, r.dtype, r.seq_no, r.step, r.rank, r.depth, r.static, r.data.shape,
                            r.data.tobytes(), r.request.tolist(), r.position.tolist(), r.token_id.tolist()))
        tokens = trace.request_tokens()
        return (trace.meta, trace.finals, records, tokens.request.tolist(), tokens.position.tolist(),
                tokens.token_id.tolist())


def content_ranges(path: Path) -> list[tuple[int, int]]:
    """(file offset, length) of the bytes that hold the trace's content, as the libraries place them:
    the chunks of every HDF5 dataset (h5py's chunk index; HDF5's own structures are fuzzed by
    tests/test_fuzz.py in child processes), or every buffer of every Arrow batch (pyarrow), the
    closing batch's ``__index__`` stream included."""
    found: list[tuple[int, int]] = []
    if path.suffix == ".h5":
        with h5py.File(path, "r") as f:
            def visit(_name: str, obj) -> None:
                if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                    obj.id.chunk_iter(lambda info: found.append((info.byte_offset, info.size)))
            f.visititems(visit)
        return found
    with pa.memory_map(str(path), "r") as source:
        base = source.read_buffer(1).address
        source.seek(0)
        reader = pa.ipc.open_file(source)
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            for column in batch.columns:
                arrays = [column] + ([column.values] if isinstance(column, pa.ListArray) else [])
                found += [(buffer.address - base, buffer.size) for array in arrays
                          for buffer in array.buffers() if buffer is not None and buffer.size]
    return found


@pytest.mark.parametrize("seed", range(3))
def test_a_flipped_content_byte_is_refused_or_changes_nothing(originals, tmp_path, fmt, seed) -> None:
    """Seeded flips anywhere in a trace's content (tensor bytes, key columns, string table, index,
    metadata): never read differently without an error."""
    import random

    rng = random.Random(f"checksums:{fmt}:{seed}")
    original = originals[fmt]
    expected = snapshot(original)
    ranges = content_ranges(original)
    meta_at = original.read_bytes().rfind(b'"source": "training"')
    refused = 0
    for k in range(40):
        path = Path(shutil.copy(original, tmp_path / f"m{k}.{fmt}"))
        if k % 8 == 0:
            at = meta_at + rng.randrange(len(b'"source": "training"'))
        else:
            start, size = rng.choice(ranges)
            at = start + rng.randrange(size)
        flip(path, at)
        try:
            got = snapshot(path)
        except TraceError as exc:
            assert "\n" not in exc.problem
            refused += 1
            continue
        assert got == expected, f"byte {at} flipped: read without error, but differently"
    assert refused >= 10  # most content bytes matter


def test_a_flipped_byte_of_a_large_record_fails_compare(tmp_path, fmt) -> None:
    """Records of a MiB or more are checked over the file's mapping, where compare reads them in place."""
    big = np.linspace(-1, 1, 512 * 1024, dtype=np.float32).reshape(512, 1024)
    original = tmp_path / f"big.{fmt}"
    with td.record(original, source="training") as rec:
        for step in range(2):
            rec.log("h", big + step, step=step, token_ids=np.arange(512),
                    positions=np.arange(512) + 512 * step, request="r")
            rec.flush()
    path = Path(shutil.copy(original, tmp_path / f"mutant.{fmt}"))
    slot, _ = the_record(path, "h", 1)
    flip(path, data_byte(path, "h", 1))
    compared = cli("compare", str(original), str(path))
    assert compared.returncode == 2
    one_error_line(compared.stderr, path, slot, "h", 1)
    assert cli("compare", str(original), str(path), "--no-verify").returncode != 2


@pytest.mark.parametrize("layout", ["many small records", "a record compared in part"])
def test_a_flipped_byte_of_a_bfloat16_record_read_in_place_fails_compare(tmp_path, fmt, layout) -> None:
    """compare reads bfloat16 rows in place from the file's mapping and checks each record there, as
    its window is mapped: whole records inside the window in one call, a record that reaches past
    the window (only part of its rows are compared) a window at a time. Either way a flipped byte of
    a record compared is one error line naming it."""
    rng = np.random.default_rng(7)
    rows = torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).to(torch.bfloat16)
    original, mutant, other = (tmp_path / f"{stem}.{fmt}" for stem in ("original", "mutant", "other"))
    for path, kept in ((original, 64), (other, 64 if layout == "many small records" else 16)):
        with td.record(path, source="training") as rec:
            if layout == "many small records":  # one row a record: 64 records a side
                for step in range(kept):
                    rec.log("h", rows[step : step + 1] + step, step=step, token_ids=[step],
                            positions=[step], request="r")
            else:  # one record of 64 rows; the other side holds 16 of them
                rec.log("h", rows[:kept], step=0, token_ids=np.arange(kept), positions=np.arange(kept),
                        request="r")
    shutil.copy(original, mutant)
    step = 40 if layout == "many small records" else 0
    slot, raw = the_record(mutant, "h", step)
    flip(mutant, data_byte(mutant, "h", step) - (len(raw) // 2 if layout != "many small records" else 0))
    assert cli("compare", str(other), str(original)).returncode in (0, 3)  # sound: no error
    compared = cli("compare", str(other), str(mutant))
    assert compared.returncode == 2, (compared.stdout, compared.stderr)
    one_error_line(compared.stderr, mutant, slot, "h", step)


def test_the_writers_batch_checksums_are_the_specs_per_record_checksums() -> None:
    """Writers take a faster path (buffers in place, names encoded once); it must agree with the
    definition record by record: non-contiguous and big-endian arrays, 0-d and empty tensors,
    numpy scalars as keys, several requests, non-ASCII names."""
    from tracediff.trace.schema import Record, batch_checksums, record_checksums

    rng = np.random.default_rng(0)
    records = [
        Record("x\u00e9", rng.integers(0, 9, (3, 4, 5)).astype(np.uint16)[:, ::2], "bfloat16",
               seq_no=np.int64(5), step=-1, rank=2, depth=3, static=np.bool_(False),
               request=np.array(["a", "b\u00e9", "c"], dtype=object), position=np.array([1, 2, 3], np.int32),
               token_id=np.array([7, 8, 9], ">i8")),
        Record("s", np.array(3.5, np.float32), "float32", static=True),
        Record("e", np.zeros((0, 4), np.float32), "float32"),
        Record("t", rng.standard_normal((2, 1000)).T, "float64", request=np.array(["r", "r"], dtype=object),
               position=np.arange(2)[::-1], token_id=np.arange(2)),
        Record("x\u00e9", np.ones((1, 2), np.uint16), "bfloat16", request=np.array(["r"], dtype=object),
               position=np.array([0]), token_id=np.array([1])),
    ]
    expected = np.array([record_checksums(r) for r in records], dtype=np.uint32)
    assert np.array_equal(batch_checksums(records), expected)
    assert batch_checksums([]).shape == (0, 3)
