"""Small files cannot force large memory: what a trace declares is checked before it is allocated.

Hostile layouts (issue 19, built here small on disk: compressed zeros) are one ``error:`` line, exit 2;
sound traces read in memory near their tensors' own size (peak RSS measured in a fresh process).
Full-size figures: scripts/bench_read_bounds.py.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import cli, run_python

from tracediff.trace.arrow import key_table, records_to_batch
from tracediff.trace.checks import MAX_CHUNK_BYTES, MAX_EXPANSION
from tracediff.trace.metarules import MAX_META_VALUES
from tracediff.trace.schema import Record, record_crc
from tracediff.trace.writer import open_writer

MIB = 1 << 20


def write_trace(path: Path, records: list[Record], meta: dict | None = None,
                compression: str | None = None) -> Path:
    writer = open_writer(path, meta or {"source": "test"}, compression=compression)
    writer.write(records)
    writer.close({"closed": True, "records": len(records), "bytes": sum(r.nbytes for r in records)})
    return path


def rows_record(name: str, data: np.ndarray, dtype: str | None = None) -> Record:
    n = len(data)
    return Record(name=name, data=data, dtype=dtype or str(data.dtype),
                  request=np.array(["r"] * n, dtype=object), position=np.arange(n),
                  token_id=np.ones(n, np.int64))


def small_trace(path: Path, meta: dict | None = None) -> Path:
    return write_trace(path, [rows_record("h", np.full((2, 8), i, np.float32)) for i in range(3)], meta)


def one_error_line(done, path: Path, says: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {path}: ") and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def huge_chunk_copy(src: Path, dst: Path, dataset: str, chunk_bytes: int) -> None:
    """``src`` with ``dataset`` given one gzip chunk of ``chunk_bytes`` (its values, then zeros), written
    as a raw compressed chunk: a few hundred KiB on disk."""
    with h5py.File(src, "r") as old, h5py.File(dst, "w", libver="latest") as new:
        for key, value in old.attrs.items():
            new.attrs[key] = value
        names: list[str] = []
        old.visit(lambda n: names.append(n) if isinstance(old[n], h5py.Dataset) else None)
        for name in names:
            d = old[name]
            if name != dataset:
                new.create_dataset(name, data=d[:], maxshape=(None, *d.shape[1:]), chunks=d.chunks)
                continue
            row = int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize
            chunk = chunk_bytes // row
            out = new.create_dataset(name, d.shape, dtype=d.dtype, maxshape=(None, *d.shape[1:]),
                                     chunks=(chunk, *d.shape[1:]), compression="gzip")
            values = d[:].tobytes()
            comp = zlib.compressobj(1)
            pieces, zeros = [comp.compress(values)], bytes(16 * MIB)
            for start in range(len(values), chunk * row, len(zeros)):
                pieces.append(comp.compress(zeros[: min(len(zeros), chunk * row - start)]))
            out.id.write_direct_chunk((0,) * d.ndim, b"".join(pieces) + comp.flush(), 0)


@pytest.fixture(scope="module")
def chunked_h5(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("chunks")
    plain = small_trace(tmp / "plain.h5")
    hostile = tmp / "chunks.h5"
    huge_chunk_copy(plain, hostile, "rows/position", 4 * MAX_CHUNK_BYTES)  # 256 MiB of int64 entries
    return plain, hostile


@pytest.mark.parametrize("command", ["show", "compare", "show --name"])
def test_h5_compressed_chunks_beyond_the_bound_are_one_error_line(chunked_h5, command) -> None:
    """HDF5 decompresses a whole chunk to read any entry of it: a 300 KB trace whose rows/position has
    one 256 MiB gzip chunk took 256 MiB (2 GiB chunks: 2.2 GB, in show and compare). Chunks are
    checked at open, before a byte of them is read."""
    plain, hostile = chunked_h5
    args = {"show": ["show", str(hostile)], "compare": ["compare", str(hostile), str(plain)],
            "show --name": ["show", str(hostile), "--name", "h"]}[command]
    assert hostile.stat().st_size < 2 * MIB
    one_error_line(cli(*args), hostile, "dataset 'rows/position' has compressed chunks of 268435456 bytes")


def test_h5_chunks_within_the_bound_still_read(chunked_h5, tmp_path) -> None:
    """The bound is on what a chunk decompresses to: tracediff's own 1 MiB chunks (and 16 MiB compacted
    ones) are far inside it, as is a compressed chunk at the bound itself."""
    plain, _ = chunked_h5
    at_bound = tmp_path / "at_bound.h5"
    huge_chunk_copy(plain, at_bound, "rows/token_id", MAX_CHUNK_BYTES)
    done = cli("show", str(at_bound), "--name", "h", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 6


def test_h5_compressed_zeros_read_at_their_own_size(tmp_path) -> None:
    """tracediff's own gzip layout (1 MiB chunks) holding a 256 MiB zero record in ~300 KB: zeros
    compress ~1000x, so a bound on the data's size against the file's refused an honest trace. HDF5
    decompresses a chunk at a time (each checked at open, above) into what the read asks for: reading
    the record costs its own bytes, and summing its moments a window of them."""
    zeros = np.zeros((1024, 256 * MIB // 4096), np.float32)
    path = write_trace(tmp_path / "zeros.h5", [rows_record("z", zeros)], compression="gzip")
    assert path.stat().st_size * MAX_EXPANSION < 256 * MIB
    done = cli("show", str(path), "--name", "z", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 1024 and json.loads(done.stdout)["max"] == 0


def test_h5_record_over_chunks_never_written_is_refused_before_it_is_read(tmp_path) -> None:
    """What bounds a compressed HDF5 record is what was written: a 1 MiB gzip trace whose data
    dataset and record declare 1 GiB (its checksums made to agree) has one chunk of it. Every chunk a
    read touches must exist before anything is read; HDF5 would fill the rest with zeros, 1 GiB."""
    path = write_trace(tmp_path / "sparse.h5", [rows_record("z", np.zeros((1, MIB // 4), np.float32))],
                       compression="gzip")
    with h5py.File(path, "a") as f:
        f["data"].resize((1 << 30,))
        f["records/data_nbytes"][0] = 1 << 30
        f["records/shape"][0, :2] = (1, 1 << 28)
        keys = [int(f[f"records/{k}"][0]) for k in ("seq_no", "step", "rank", "depth", "static")]
        f["records/checksums"][0, 1] = record_crc("z", "float32", *keys[:4], bool(keys[4]), [1, 1 << 28])
    assert path.stat().st_size < 2 * MIB
    one_error_line(cli("show", str(path), "--name", "z"), path, "data chunk 1 is missing, yet records point")


def zero_record_arrow(path: Path, nbytes: int) -> Path:
    """One record of ``nbytes`` zeros in a zstd Arrow trace: a few KB on disk."""
    zeros = np.zeros((nbytes // 4096, 1024), np.float32)
    return write_trace(path, [rows_record("z", zeros)], compression="zstd")


def lying_arrow(path: Path, nbytes: int) -> Path:
    """A zstd Arrow trace whose one batch holds ``nbytes`` of zeros under an index (sound in itself,
    checksums and all) that declares a record of 4 KiB there."""
    writer = open_writer(path, {"source": "test"}, compression="zstd")
    held = rows_record("z", np.zeros((nbytes // 4096, 1024), np.float32))
    declared = rows_record("z", np.zeros((1, 1024), np.float32))
    writer._writer.write_batch(records_to_batch([held]))
    writer._index.add(key_table(records_to_batch([declared]), 0))
    writer._batches = 1
    writer.close({"closed": True, "records": 1, "bytes": declared.nbytes})
    return path


@pytest.fixture(scope="module")
def zero_arrow(tmp_path_factory) -> Path:
    return zero_record_arrow(tmp_path_factory.mktemp("zero") / "zero.arrow", 256 * MIB)


@pytest.fixture(scope="module")
def lying(tmp_path_factory) -> Path:
    return lying_arrow(tmp_path_factory.mktemp("lying") / "lying.arrow", 256 * MIB)


@pytest.mark.parametrize("command", ["show", "show --name", "compare"])
def test_arrow_batch_past_what_its_index_declares_is_refused_before_decompressing(lying, command) -> None:
    """A zstd batch is decompressed whole when read: a 1 MB Arrow trace whose index declares 4 KiB
    in a batch of 1 GiB of zeros would take 1 GiB to read 4 KiB. What each compressed buffer of the
    batch declares (its IPC length prefix, read before anything is decompressed) is checked against
    what its index entries declare: the data exactly, the key columns within a bound of its rows."""
    args = {"show": ["show", str(lying)], "show --name": ["show", str(lying), "--name", "z"],
            "compare": ["compare", str(lying), str(lying)]}[command]
    assert lying.stat().st_size < MIB
    one_error_line(cli(*args), lying, "record batch 0 would decompress to 268435456 bytes of data where "
                                      "its index entries declare 4096")


@pytest.mark.subprocess
def test_a_lying_arrow_batch_is_refused_in_small_memory(lying, tmp_path) -> None:
    """Refused before: the process never holds the batch's 256 MiB."""
    tiny = zero_record_arrow(tmp_path / "tiny.arrow", 4096)
    base = peak_rss("show", str(tiny), "--name", "z")
    done = run_python(PEAK, "show", str(lying), "--name", "z")
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["code"] == 2 and result["peak"] - base < 32 * MIB, result


@pytest.mark.parametrize("command", ["show", "show --name", "compare"])
def test_a_truthful_compressed_zero_record_reads(zero_arrow, command) -> None:
    """A 256 MiB zero record in a few KB of zstd is what its index says: it reads (a ratio of the
    data's size to the file's refused it, and with it the recorder's own traces of zero tensors)."""
    assert zero_arrow.stat().st_size * MAX_EXPANSION < 256 * MIB
    if command == "compare":
        done = cli("compare", str(zero_arrow), str(zero_arrow), "--json")
        assert done.returncode == 0 and json.loads(done.stdout)["verdict"] == "match", done.stderr
        return
    done = cli(*(["show", str(zero_arrow)] + (["--name", "z"] if command == "show --name" else [])), "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["rows"] if command == "show --name" else shown["tensors"][0]["rows"]) == 64 * 1024


@pytest.mark.subprocess
def test_show_of_a_compressed_trace_decompresses_no_tensor_bytes(zero_arrow, tmp_path) -> None:
    """show reads the index and the key columns (request counts): a compressed batch's key columns
    are read without its data column, so show of a 256 MiB zero record takes what show of 4 KiB
    does; show --name decompresses the record's batch (its own size) and reads the rows from it
    (the same again: 2x, where an uncompressed trace reads them from the file's pages)."""
    tiny = zero_record_arrow(tmp_path / "tiny.arrow", 4096)
    assert peak_rss("show", str(zero_arrow)) - peak_rss("show", str(tiny)) < 32 * MIB
    growth = peak_rss("show", str(zero_arrow), "--name", "z") - peak_rss("show", str(tiny), "--name", "z")
    assert growth < 2.5 * 256 * MIB, f"{growth / MIB:.0f} MiB"


def test_killed_compressed_arrow_reads_what_its_stream_holds(zero_arrow, tmp_path) -> None:
    """A killed trace has no index to declare anything: each batch of its stream costs what its
    messages declare (its own size) as it is recovered, a batch at a time (let go past a budget and
    read again from the stream when needed)."""
    killed = tmp_path / "killed.arrow"
    blob = zero_arrow.read_bytes()
    killed.write_bytes(blob[: len(blob) - 600])  # its footer (and closing batch) cut off
    done = cli("show", str(killed), "--name", "z", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 64 * 1024


def test_compressed_arrow_of_real_tensors_reads(tmp_path, monkeypatch) -> None:
    """Tensors compress ~1.1-3x: a zstd trace of them is nowhere near the bound, and reads the same as
    uncompressed; decompressed batches are let go past a budget (here: only the one in use is held)
    and read again when needed."""
    from tracediff.trace import arrow

    monkeypatch.setattr(arrow, "HELD_DECOMPRESSED", 0)
    rng = np.random.default_rng(0)
    path = tmp_path / "real.arrow"
    writer = open_writer(path, {"source": "test"}, compression="zstd")
    data = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(5)]
    for i, x in enumerate(data):
        writer.write([Record(name="x", data=x, dtype="float32", seq_no=i, step=i,
                             request=np.array(["r"] * 4, dtype=object), position=np.arange(4) + 4 * i,
                             token_id=np.ones(4, np.int64))])
    writer.close({"closed": True, "records": 5, "bytes": sum(x.nbytes for x in data)})
    import tracediff as td

    with td.open_trace(path) as trace:
        assert np.array_equal(trace.rows("x").data, np.concatenate(data))
        assert np.array_equal(trace.rows("x", step=1).data, data[1])  # batch 1 read again
        assert (trace.files[0].data_offsets() == -1).all()  # compressed: no bytes to read in place
    assert cli("compare", str(path), str(path)).returncode == 0


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
def test_metadata_of_millions_of_empty_lists_is_refused_before_it_is_parsed(tmp_path, fmt) -> None:
    """16 MiB of ``[]`` run metadata parsed into 5.6M lists: show took 0.92 GB and ~50 s. The JSON
    text is measured first (values, nesting) in one pass over its bytes."""
    path = small_trace(tmp_path / f"lists.{fmt}", meta={"source": "test", "x": [[]] * (2 * MAX_META_VALUES)})
    says = f"run metadata holds more than {MAX_META_VALUES} JSON values"
    one_error_line(cli("show", str(path)), path, says)


@pytest.mark.parametrize("fmt", ["h5", "arrow"])
def test_metadata_strings_full_of_brackets_are_text_not_structure(tmp_path, fmt) -> None:
    """Brackets, commas and colons inside strings are not values nor nesting: only the structure
    counts, and a JSON string may hold anything."""
    text = "[{,:" * (MAX_META_VALUES // 2) + '\\"]'
    path = small_trace(tmp_path / f"text.{fmt}", meta={"source": "test", "note": text, "deep": [[[[1]]]]})
    done = cli("show", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["meta"]["note"] == text


def test_metadata_nesting_is_measured_on_the_text(tmp_path) -> None:
    """32 levels read; 33 are refused with the reader's message, whatever the number of values."""
    def nested(levels: int) -> dict:
        value: object = 0
        for _ in range(levels - 1):
            value = [value]
        return {"source": "test", "x": value}

    assert cli("show", str(small_trace(tmp_path / "ok.arrow", meta=nested(32)))).returncode == 0
    deep = small_trace(tmp_path / "deep.arrow", meta=nested(33))
    one_error_line(cli("show", str(deep)), deep, "run metadata is JSON nested more than 32 deep")


PEAK = r"""
import json, sys
sys.argv = ["tracediff", *sys.argv[1:]]
from tracediff.cli import main
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"peak": peak, "code": code}), file=sys.stderr)
"""


def peak_rss(*args: str) -> int:
    """Peak resident bytes of a fresh ``tracediff`` process running ``args``: its VmHWM, the high-water
    mark of its own memory (``ru_maxrss`` of a child would count the RSS this test process had when it
    forked, which Linux carries across exec)."""
    done = run_python(PEAK, *args)
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["code"] in (0, None), done.stderr
    return int(result["peak"])


@pytest.mark.subprocess
@pytest.mark.parametrize("fmt, dtype, compression", [("h5", "bfloat16", None), ("arrow", "float32", "zstd")])
def test_show_name_needs_about_the_tensors_own_bytes(tmp_path, fmt, dtype, compression) -> None:
    """show --name took ~7-8x the tensor's bytes (decoded, widened to float64, filtered, squared, all
    at once); the moments now run over windows, so the rows read are the cost (in a compressed trace
    also the batch decompressed and the file's pages it was read from), over what the same command
    takes on a tiny trace."""
    rng = np.random.default_rng(0)
    paths = []
    for rows in (4, 16384):
        values = rng.standard_normal((rows, 1024)).astype(np.float32)
        data = (values.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else values
        path = tmp_path / f"t{rows}.{fmt}"
        paths.append(write_trace(path, [rows_record("t", data, dtype)], compression=compression))
    growth = peak_rss("show", str(paths[1]), "--name", "t") - peak_rss("show", str(paths[0]), "--name", "t")
    copies = 3 if compression else 1  # compressed: the file's mapped pages, the batch decompressed, the rows
    assert growth < (copies + 0.75) * data.nbytes, f"{growth / MIB:.0f} MiB for {data.nbytes / MIB:.0f} MiB"


def test_show_prints_a_bounded_contract_line(tmp_path) -> None:
    """Metadata may hold 16 MiB in one string: show rendered all of it through rich (3.6 s, 320 MB for
    15 MiB). The terminal gets the contract's first 64 KiB and how much more there is; --json has all."""
    note = "x" * (1 << 20)
    path = small_trace(tmp_path / "long.arrow", meta={"source": "test", "contract": {"note": note}})
    done = cli("show", str(path))
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("contract: ")]
    assert len(line) < (64 << 10) + 100 and line.endswith("more characters: --json has all)")
    assert json.loads(cli("show", str(path), "--json").stdout)["contract"]["note"] == note


@pytest.mark.slow  # ~3-9 s each: the recorder copies and checksums 200 MB
@pytest.mark.parametrize("suffix, compression", [("arrow", "zstd"), ("arrow", "lz4"), ("h5", "gzip")])
def test_the_recorders_compressed_zero_tensors_read_back(tmp_path, suffix, compression) -> None:
    """The recorder never writes a trace its own reader refuses: a 200 MB zero tensor (a few hundred
    KB compressed) reads with show, show --name and compare against itself (a match)."""
    import torch

    import tracediff as td

    path = tmp_path / f"z.{suffix}"
    rows = 50000
    with td.record(path, compression=compression, on_full="block") as rec:
        rec.log("t.zero", torch.zeros(rows, 1024), step=0, request="r",
                token_ids=torch.zeros(rows, dtype=torch.long))
    assert path.stat().st_size < 4 * MIB
    shown = cli("show", str(path), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["tensors"][0]["rows"] == rows
    named = cli("show", str(path), "--name", "t.zero", "--json")
    assert named.returncode == 0 and json.loads(named.stdout)["max"] == 0, named.stderr
    compared = cli("compare", str(path), str(path), "--json")
    assert compared.returncode == 0 and json.loads(compared.stdout)["verdict"] == "match", compared.stderr
