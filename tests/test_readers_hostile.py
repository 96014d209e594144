"""Readers validate before they trust: each hand-made corruption of a real trace is one TraceError
(one line in the CLI, exit 2), never a crash, a traceback, a hang or a silently wrong read. A
closed trace is read strictly (its final metadata is the truth); a killed one up to its last
whole flush."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pytest

import tracediff as td
from tracediff.errors import InputError, TraceError
from tracediff.trace.summary import summarize

H, G = np.arange(24, dtype=np.float32).reshape(2, 12), np.ones((2, 4), np.float16)


def write_trace(path: Path, compression: str | None = None) -> Path:
    """Two tensors over three flushes, one request: 6 records and a token table."""
    with td.record(path, source="training", compression=compression) as rec:
        for step in range(3):
            rec.log("h", H + step, step=step, token_ids=np.arange(2), request="r")
            rec.log("g", G * step, step=step, token_ids=np.arange(2), request="r")
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


def read_everything(path: Path, verify: bool = True) -> None:
    """What show, show --name and convert read: summary, every record, the token table."""
    with td.open_trace(path, verify=verify) as trace:
        summarize(trace)
        for i in range(len(trace.index)):
            trace.read(i)
        for name in trace.names():
            if not trace.index.static[trace.select(name=name)].all():
                trace.rows(name).numpy()
        trace.request_tokens()


def refused(path: Path, *words: str) -> str:
    """The reader's own checks refuse the file (checksums off: they stand behind them, for
    --no-verify and traces written before checksums; tests/test_checksums.py checks those)."""
    with pytest.raises(TraceError) as caught:
        read_everything(path, verify=False)
    problem = caught.value.problem
    assert caught.value.path == str(path) and "\n" not in problem and len(problem) < 400
    for word in words:
        assert word in problem
    return problem


# --- HDF5 edits (through h5py, so HDF5's own checksums stay right) ---------------------------------

def h5_edit(path: Path, **columns) -> None:
    """Set entries of datasets: ``records_n_rows={1: 10**12}`` sets records/n_rows[1]."""
    with h5py.File(path, "r+") as f:
        for key, entries in columns.items():
            dset = f[key.replace("_", "/", 1)]
            for i, value in entries.items():
                dset[i] = value


def h5_set_blob(path: Path, name: str, blob: bytes) -> None:
    with h5py.File(path, "r+") as f:
        f[name].resize((len(blob),))
        f[name][:] = np.frombuffer(blob, np.uint8)


def test_h5_closed_trace_with_rows_past_the_end_is_refused_not_cut(copy) -> None:
    path = copy("h5")
    h5_edit(path, records_n_rows={1: 10**12})
    refused(path, "record 1", "row count")


def test_h5_killed_trace_keeps_its_whole_prefix(copy) -> None:
    """The same tear in a file whose writer never closed it: the records before it are read."""
    path = copy("h5")
    h5_edit(path, records_n_rows={3: 10**12})
    with h5py.File(path, "r+") as f:
        f["final"].resize((0,))
    with td.open_trace(path) as trace:
        assert not trace.complete and trace.names() == ["h", "g"]
        assert trace.rows("h").numpy().tolist() == (H + 0).tolist()  # record 3 is h of step 1: cut there


@pytest.mark.parametrize("column,value", [("records_name", -1), ("records_dtype", -1), ("rows_request", -1),
                                          ("records_name", 99)])
def test_h5_string_ids_outside_the_table_are_refused(copy, column, value) -> None:
    """-1 would take the last string of the table, silently."""
    path = copy("h5")
    h5_edit(path, **{column: {0: value}})
    refused(path, "string")


@pytest.mark.parametrize("column,value,words", [
    ("records_n_rows", -1, ("record 0",)), ("records_row_start", -5, ("rows outside",)),
    ("records_data_offset", -1, ("data bytes outside",)), ("records_data_nbytes", 10**15, ("byte size",)),
    ("records_ndim", 9, ("number of dims",)),
    ("records_shape", [-2, 12, -1, -1, -1, -1, -1, -1], ("negative",)),
])
def test_h5_negative_or_impossible_counts_and_offsets_are_refused(copy, column, value, words) -> None:
    path = copy("h5")
    h5_edit(path, **{column: {0: value}})
    refused(path, *words)


def test_h5_bad_bytes_in_the_string_table_are_refused(copy) -> None:
    path = copy("h5")
    h5_edit(path, strings_bytes={0: 0xFF})
    refused(path, "string table entry 0 is not UTF-8")


def test_h5_contiguous_data_dataset_is_refused(copy) -> None:
    path = copy("h5")
    with h5py.File(path, "r+") as f:
        data = f["data"][:]
        del f["data"]
        f.create_dataset("data", data=data)  # contiguous: no chunks to find bytes in
    refused(path, "'data' is contiguous")


def test_h5_dataset_of_another_type_is_refused_before_it_is_read(copy) -> None:
    """A variable-length dataset would make HDF5 read its global heap (see the hang below)."""
    path = copy("h5")
    with h5py.File(path, "r+") as f:
        n = len(f["records/name"])
        del f["records/name"]
        f.create_dataset("records/name", data=np.array(["x"] * n, dtype=object), dtype=h5py.string_dtype(),
                         maxshape=(None,), chunks=(16,))
    refused(path, "'records/name' is object")


def test_h5_record_count_disagreeing_with_the_final_metadata_is_refused(copy) -> None:
    path = copy("h5")
    with h5py.File(path, "r+") as f:
        final = json.loads(f["final"][:].tobytes())
    h5_set_blob(path, "final", json.dumps({**final, "records": 16}).encode())
    refused(path, "counts 16 records", "indexes 6")


def test_h5_format_version_that_is_not_a_number_is_refused(copy) -> None:
    path = copy("h5")
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = "two"
    refused(path, "format version", "not a positive integer")


def test_h5_data_chunk_past_the_end_of_the_file_is_refused(copy) -> None:
    """HDF5's chunk index (checksummed, so forged with its checksum) says where the bytes lie; a
    read there would run past the end of the file (EOFError, 'Aborted.' in the CLI)."""
    path = copy("h5")
    with h5py.File(path, "r") as f:
        chunk = f["data"].id.get_chunk_info_by_coord((0,)).byte_offset
    forge_chunk_address(path, chunk, path.stat().st_size + 4096)
    refused(path, "data chunk", "outside the file")


def test_h5_corrupt_compressed_chunk_is_refused(tmp_path) -> None:
    """An error HDF5 raises while reading (here: gzip) is a TraceError too."""
    path = write_trace(tmp_path / "gz.h5", compression="gzip")
    with h5py.File(path, "r") as f:
        info = f["data"].id.get_chunk_info_by_coord((0,))
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)
    refused(path, "corrupt trace")


def test_h5_root_attributes_in_dense_storage_are_read_by_a_bounded_child(copy) -> None:
    """A layout our attribute parser does not read is read by h5py in a child process under a time
    limit: a valid trace still opens."""
    path = copy("h5")
    with h5py.File(path, "r+") as f:
        for i in range(20):  # more than 8: HDF5 moves every attribute to dense storage
            f.attrs[f"extra{i}"] = i
    read_everything(path)
    with td.open_trace(path) as trace:
        assert trace.meta["source"] == "training" and trace.complete


@pytest.mark.subprocess
def test_h5_attribute_read_that_hangs_in_the_child_is_bounded(copy, monkeypatch) -> None:
    """Dense storage (read by h5py in a child) and a global heap that makes HDF5 loop: the child is
    stopped at its time limit and the file refused."""
    from tracediff.trace import h5attrs

    path = copy("h5")
    with h5py.File(path, "r+") as f:
        for i in range(20):
            f.attrs[f"extra{i}"] = i
    data = bytearray(path.read_bytes())
    heap = data.find(b"GCOL")
    at = heap + 16
    while int.from_bytes(data[at : at + 2], "little"):  # walk the heap's objects to its free space
        at += 16 + (int.from_bytes(data[at + 8 : at + 16], "little") + 7) // 8 * 8
    data[at + 8 : at + 16] = bytes(8)  # free space of size 0: HDF5 2.0 never leaves its parse loop
    path.write_bytes(bytes(data))
    monkeypatch.setattr(h5attrs, "CHILD_TIMEOUT", 3.0)
    refused(path, "more than 3 s")


# --- metadata (both formats) ------------------------------------------------------------------

def set_run_meta(path: Path, raw: bytes) -> None:
    if path.suffix == ".h5":
        with h5py.File(path, "r+") as f:
            f.attrs.create("meta", data=raw, dtype=h5py.string_dtype())  # the bytes as given
            f.attrs["meta_crc32"] = np.int64(zlib.crc32(raw))  # as a writer of this metadata would
    else:
        arrow_rewrite(path, meta=raw)


def set_final(path: Path, raw: bytes) -> None:
    if path.suffix == ".h5":
        h5_set_blob(path, "final", raw)
    else:
        arrow_rewrite(path, final=raw)


BAD_JSON = [
    (b'{"source": "training",', "not valid JSON"),
    (b'{"source": "\xff"}', "not UTF-8"),
    (b"[1, 2, 3]", "not an object"),
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, "nested more than 32"),
    (b'{"s": "\\ud800"}', "not valid Unicode"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": 1e999}', "out of range"),
]


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
@pytest.mark.parametrize("raw,words", BAD_JSON, ids=["invalid", "not-utf8", "list", "deep", "depth-40",
                                                     "surrogate", "nan", "inf"])
def test_run_metadata_that_is_not_a_sound_json_object_is_refused(copy, fmt, raw, words) -> None:
    path = copy(fmt)
    set_run_meta(path, raw)
    refused(path, "run metadata", words)


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
@pytest.mark.parametrize("raw,words", BAD_JSON[:4], ids=["invalid", "not-utf8", "list", "deep"])
def test_final_metadata_that_is_not_a_sound_json_object_is_refused(copy, fmt, raw, words) -> None:
    path = copy(fmt)
    set_final(path, raw)
    refused(path, "final metadata", words)


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
@pytest.mark.parametrize("key,value", [("torch", [1]), ("rank", "0"), ("host", "vm"), ("contract", None)])
def test_documented_metadata_keys_of_another_type_are_refused(copy, fmt, key, value) -> None:
    """show would call .get on a list; convert would int() a string."""
    path = copy(fmt)
    set_run_meta(path, json.dumps({"format": "tracediff", key: value}).encode())
    refused(path, f"key {key!r}")


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
def test_final_counts_of_another_type_are_refused(copy, fmt) -> None:
    path = copy(fmt)
    set_final(path, json.dumps({"closed": True, "records": 6, "dropped": {"h": "many"}}).encode())
    refused(path, "key 'dropped'")


# --- Arrow edits (rewritten with pyarrow: the file stays a valid IPC file) -------------------------

def arrow_rewrite(path: Path, meta: bytes | None = None, final: bytes | None = None,
                  version: bytes | None = None, batch=None, index=None,
                  compression: str | None = None) -> None:
    """Rewrite an Arrow trace with edits: ``batch(b, pydict)`` and ``index(pydict)`` change rows in place."""
    from tracediff.trace.arrow import INDEX_SCHEMA

    reader = pa.ipc.open_file(str(path))
    schema_meta = dict(reader.schema.metadata)
    schema_meta.update({k: v for k, v in ((b"tracediff.meta", meta), (b"tracediff.format_version", version))
                        if v is not None})
    if meta is not None:  # as a writer of this metadata would
        schema_meta[b"tracediff.meta_crc32"] = str(zlib.crc32(meta)).encode()
    batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
    for b in batches:  # pyarrow itself reads unvalidated batches unsafely: edit valid files only
        b.validate(full=True)
    closing = batches.pop().to_pydict()
    table = pa.ipc.open_stream(pa.py_buffer(closing["data"][0])).read_all()
    table.validate(full=True)
    stream = table.to_pydict()
    if index is not None:
        index(stream)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, INDEX_SCHEMA) as out:
        out.write_table(pa.table(stream, schema=INDEX_SCHEMA))
    closing["data"] = [sink.getvalue().to_pybytes(), final if final is not None else closing["data"][1]]
    schema = reader.schema.with_metadata(schema_meta)
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(path), "wb") as sink_file, pa.ipc.new_file(sink_file, schema, options=options) as out:
        for b, original in enumerate(batches):
            rows = original.to_pydict()
            if batch is not None:
                batch(b, rows)
            out.write_batch(pa.RecordBatch.from_pydict(rows, schema=schema))
        out.write_batch(pa.RecordBatch.from_pydict(closing, schema=schema))


def test_arrow_format_version_that_is_not_a_number_is_refused(copy) -> None:
    path = copy("arrow")
    arrow_rewrite(path, version=b"two")
    refused(path, "format version", "not a positive integer")


@pytest.mark.parametrize("key,value,words", [("batch", 99, "a batch outside"), ("row", 50, "row 50"),
                                             ("row", -1, "negative row")])
def test_arrow_index_pointing_outside_the_file_is_refused(copy, key, value, words) -> None:
    path = copy("arrow")
    arrow_rewrite(path, index=lambda cols: cols[key].__setitem__(0, value))
    refused(path, words)


def test_arrow_record_declaring_more_rows_than_its_data_is_refused(copy) -> None:
    """Shape [4, 12] over two rows of data: a read would run into the next record's bytes."""
    path = copy("arrow")

    def grow(cols: dict) -> None:
        cols["shape"][0] = [4, 12]

    arrow_rewrite(path, batch=lambda b, cols: grow(cols) if b == 0 else None, index=grow)
    refused(path, "holds 96 bytes of data where its shape declares 192")


@pytest.mark.parametrize("edit,words", [
    (lambda cols: cols["dtype"].__setitem__(0, "complex64"), "unknown dtype"),
    (lambda cols: cols["shape"].__setitem__(0, [2, -12]), "negative dimension"),
    (lambda cols: cols["shape"].__setitem__(0, [2] * 40), "40 dims"),
    (lambda cols: cols["shape"].__setitem__(0, [1 << 40, 1 << 40]), "2^62"),
])
def test_arrow_index_entries_that_cannot_be_tensors_are_refused(copy, edit, words) -> None:
    path = copy("arrow")
    arrow_rewrite(path, index=edit)
    refused(path, words)


def test_arrow_nulls_in_key_columns_are_refused(copy) -> None:
    path = copy("arrow")
    arrow_rewrite(path, batch=lambda b, cols: cols["position"][0].__setitem__(0, None))
    refused(path, "nulls in column 'position'")


def test_arrow_corrupt_compressed_batch_is_refused(copy) -> None:
    """An error pyarrow raises while reading a batch (here: lz4) is a TraceError too."""
    path = copy("arrow")
    arrow_rewrite(path, compression="lz4")
    data = bytearray(path.read_bytes())
    at = data.find(b"\x04\x22\x4d\x18")  # an lz4 frame's magic: corrupt the frame behind it
    assert at > 0
    data[at + 4 : at + 40] = b"\xff" * 36
    path.write_bytes(bytes(data))
    refused(path, "corrupt")


def test_arrow_closed_trace_with_an_unreadable_footer_is_refused(copy) -> None:
    """A closing batch is there, so the writer closed the file: not read as a killed one."""
    path = copy("arrow")
    data = bytearray(path.read_bytes())
    data[-10:-6] = b"\xff\xff\xff\x7f"  # the footer's length
    path.write_bytes(bytes(data))
    refused(path, "footer is unreadable")


def test_mixed_records_are_one_input_error_for_a_command_that_needs_the_tensor(tmp_path) -> None:
    path = tmp_path / "mixed.arrow"
    with td.record(path) as rec:
        rec.log("h", np.zeros((2, 3), np.float32), step=0, token_ids=np.arange(2))
        rec.log("h", np.zeros((2, 3), np.float16), step=1, token_ids=np.arange(2))
    with td.open_trace(path) as trace, pytest.raises(InputError) as caught:
        trace.rows("h")
    assert caught.value.path == str(path) and "--step" in caught.value.problem


# --- forging HDF5's checksummed chunk index ------------------------------------------------------

def lookup3(data: bytes) -> int:
    """Bob Jenkins' lookup3 hashlittle (initval 0): HDF5's metadata checksum."""
    mask = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & mask

    a = b = c = (0xDEADBEEF + len(data)) & mask
    words = [int.from_bytes(data[i : i + 4].ljust(4, b"\0"), "little") for i in range(0, len(data), 4)]
    blocks = [words[i : i + 3] + [0] * (3 - len(words[i : i + 3])) for i in range(0, len(words), 3)]
    for x, y, z in blocks[:-1]:
        a, b, c = (a + x) & mask, (b + y) & mask, (c + z) & mask
        for s1, s2, s3 in ((4, 6, 8), (16, 19, 4)):
            a = ((a - c) & mask) ^ rot(c, s1)
            c = (c + b) & mask
            b = ((b - a) & mask) ^ rot(a, s2)
            a = (a + c) & mask
            c = ((c - b) & mask) ^ rot(b, s3)
            b = (b + a) & mask
    if not data:
        return c
    x, y, z = blocks[-1]
    a, b, c = (a + x) & mask, (b + y) & mask, (c + z) & mask
    for k, rotation in enumerate((14, 11, 25, 16, 4, 14, 24)):
        if k % 3 == 0:
            c = (c ^ b) - rot(b, rotation) & mask
        elif k % 3 == 1:
            a = (a ^ c) - rot(c, rotation) & mask
        else:
            b = (b ^ a) - rot(a, rotation) & mask
    return c


def forge_chunk_address(path: Path, old: int, new: int) -> None:
    """Point the extensible-array index block entry holding chunk address ``old`` at ``new``."""
    data = bytearray(path.read_bytes())
    at = data.find(b"EAIB")
    while at >= 0:
        if int.from_bytes(data[at + 14 : at + 22], "little") == old:  # signature, version, class, header
            end = next(n for n in range(22, 4096) if lookup3(bytes(data[at : at + n]))
                       == int.from_bytes(data[at + n : at + n + 4], "little"))
            data[at + 14 : at + 22] = new.to_bytes(8, "little")
            data[at + end : at + end + 4] = lookup3(bytes(data[at : at + end])).to_bytes(4, "little")
            path.write_bytes(bytes(data))
            return
        at = data.find(b"EAIB", at + 1)
    raise AssertionError("no extensible array index block holds that chunk")


# --- the storage interface ---------------------------------------------------------------------

def test_formats_are_known_by_name_suffix_and_magic(originals) -> None:
    from tracediff.trace.storage import TraceFile, by_magic, by_name, by_suffix

    for fmt, path in originals.items():
        assert by_suffix(path).name == fmt and by_magic(path.read_bytes()[:8]) is by_name(fmt)
        with td.open_trace(path) as trace:
            assert isinstance(trace.files[0], TraceFile)  # each reader provides the declared interface
    assert by_suffix("x.hdf5").name == "h5" and by_suffix("x.feather").name == "arrow"
    with pytest.raises(ValueError, match="use .h5 or .arrow"):
        by_suffix("x.csv")
    assert by_magic(b"PAR1....") is None


def test_page_cache_warming_is_asked_for_not_scheduled_by_callers(originals) -> None:
    """compare says whether to warm; trace/ decides what and how much, and stops it."""
    from tracediff.trace.warm import warming

    with td.open_trace(originals["h5"]) as a, td.open_trace(originals["arrow"]) as b:
        with warming([a, b], enabled=False) as warmer:
            assert not warmer.running
        with warming([a, b]) as warmer:
            pass
        assert warmer._stop.is_set()  # told to stop on leaving
        warmer.join()


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
def test_any_bits_are_data_for_show_stats(tmp_path, fmt) -> None:
    """Signalling NaNs and float64 extremes are values a tensor may hold: stats, no warning (a
    warning is a second stderr line after show's output)."""
    import warnings

    from tracediff.trace.summary import tensor_stats

    path = tmp_path / f"odd.{fmt}"
    with td.record(path) as rec:
        rec.log("s", np.array([[0x7FA00000, 0]], np.uint32).view(np.float32), token_ids=np.arange(1))
        rec.log("d", np.array([[1e308, 1e308, -1e308]]), token_ids=np.arange(1))
    with td.open_trace(path) as trace, warnings.catch_warnings():
        warnings.simplefilter("error")
        signalling, extreme = tensor_stats(trace.rows("s")), tensor_stats(trace.rows("d"))
    assert signalling.nan == 1 and signalling.max == 0.0 and extreme.max == 1e308


@pytest.mark.subprocess
def test_h5_killed_trace_with_a_bad_checksum_fails_at_once_instead_of_hanging(tmp_path) -> None:
    """A killed trace (it opens only in SWMR mode) with one byte of its root object header flipped:
    HDF5 retries the bad checksum, sleeping, for minutes (show hung for 10+ minutes on it). The
    reader asks for few attempts, so it is one error line."""
    path = tmp_path / "killed_bad_checksum.h5"
    packed = Path(__file__).parent / "data" / "killed_bad_checksum.h5.gz"
    path.write_bytes(gzip.decompress(packed.read_bytes()))
    shown = subprocess.run([sys.executable, "-m", "tracediff.cli", "show", str(path)], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 2 and shown.stderr.startswith(f"error: {path}: ")
    assert "checksum" in shown.stderr and len(shown.stderr.strip().splitlines()) == 1
