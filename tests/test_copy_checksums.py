"""A copy keeps its source's checksums: ``convert`` and ``slice`` (and bundles, built on slices) of a
trace read with --no-verify carry each record's stored checksums, so a corrupt record stays one that
fails its check in the copy; a slice that keeps part of a record's rows checks it before it copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tracediff as td
from tests.conftest import cli

PATTERN = np.full((4, 16), 3.25, np.float32)  # the bytes of the record the tests corrupt


def corrupt_trace(tmp_path: Path, fmt: str) -> Path:
    """A trace whose ``target.logits`` record has one byte flipped (its stored checksums kept)."""
    path = tmp_path / f"bad.{fmt}"
    with td.record(path, source="serving") as rec:
        rec.log("target.logits", PATTERN, request="r", positions=[0, 1, 2, 3], token_ids=[5, 6, 7, 8])
        rec.log("target.token", np.arange(4, dtype=np.int64), request="r", positions=[0, 1, 2, 3],
                token_ids=[5, 6, 7, 8])
    raw = bytearray(path.read_bytes())
    at = bytes(raw).index(PATTERN.tobytes())
    raw[at + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    return path


def fails_check(path: Path) -> str:
    done = cli("show", str(path), "--name", "target.logits", "--request", "r")
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.stdout, done.stderr)
    return done.stderr


@pytest.mark.parametrize("out_fmt", ["h5", "arrow"])
def test_convert_no_verify_carries_the_stored_checksums(tmp_path, fmt, out_fmt) -> None:
    bad = corrupt_trace(tmp_path, fmt)
    assert "target.logits, step 0) fails its checksum" in fails_check(bad)
    out = tmp_path / f"copy.{out_fmt}"
    done = cli("convert", str(bad), str(out), "--no-verify")
    assert done.returncode == 0, done.stderr
    assert fails_check(out) == f"error: {out}: corrupt trace: record 0 (target.logits, step 0) fails its " \
                               "checksum\n"
    with td.open_trace(out) as trace:  # the sound record is copied sound
        assert trace.read(int(trace.select("target.token")[0])).numpy().tolist() == [0, 1, 2, 3]


def test_convert_checked_still_refuses_the_corrupt_record(tmp_path, fmt) -> None:
    bad = corrupt_trace(tmp_path, fmt)
    done = cli("convert", str(bad), str(tmp_path / "copy.h5"))
    assert done.returncode == 2 and "fails its checksum" in done.stderr
    assert not (tmp_path / "copy.h5").exists()


def test_slice_no_verify_of_whole_records_carries_the_stored_checksums(tmp_path, fmt) -> None:
    bad = corrupt_trace(tmp_path, fmt)
    out = tmp_path / f"small.{fmt}"
    done = cli("slice", str(bad), "-o", str(out), "--names", "target.logits", "--no-verify")
    assert done.returncode == 0, done.stderr
    assert "fails its checksum" in fails_check(out)


def test_slice_no_verify_of_some_rows_checks_the_record_first(tmp_path, fmt) -> None:
    bad = corrupt_trace(tmp_path, fmt)
    out = tmp_path / f"small.{fmt}"
    done = cli("slice", str(bad), "-o", str(out), "--positions", "0:2", "--no-verify")
    assert done.returncode == 2 and not out.exists()
    assert done.stderr == f"error: {bad}: corrupt trace: record 0 (target.logits, step 0) fails its " \
                          "checksum\n"


def test_a_sound_copy_unverified_is_a_sound_trace(tmp_path, fmt) -> None:
    path = tmp_path / f"good.{fmt}"
    with td.record(path, source="serving") as rec:
        rec.log("target.logits", PATTERN, request="r", positions=[0, 1, 2, 3], token_ids=[5, 6, 7, 8])
    for command in (["convert", str(path), str(tmp_path / "c.arrow"), "--no-verify"],
                    ["slice", str(path), "-o", str(tmp_path / "s.h5"), "--positions", "1:3", "--no-verify"]):
        assert cli(*command).returncode == 0
    for out in ("c.arrow", "s.h5"):
        done = cli("show", str(tmp_path / out), "--name", "target.logits", "--request", "r")
        assert done.returncode == 0, done.stderr


def test_no_verify_lasts_one_command(tmp_path, fmt) -> None:
    """--no-verify of one in-process command leaves the API's reads (and the next command) checked."""
    bad = corrupt_trace(tmp_path, fmt)
    assert cli("convert", str(bad), str(tmp_path / "copy.h5"), "--no-verify").returncode == 0
    with td.open_trace(bad) as trace, pytest.raises(td.TraceError, match="fails its checksum"):
        trace.read(int(trace.select("target.logits")[0]))
    assert "fails its checksum" in fails_check(bad)


@pytest.mark.parametrize("command", ["convert", "slice"])
def test_a_copy_read_unchecked_refuses_corrupt_metadata(tmp_path, fmt, command) -> None:
    """A copy writes the metadata anew, with new checksums: read with --no-verify, it checks the
    stored ones first, so corrupt metadata (training -> traininf, still parses) never becomes sound."""
    path = tmp_path / f"t.{fmt}"
    with td.record(path, source="training") as rec:
        rec.log("h", np.ones((2, 4), np.float32), request="r", positions=[0, 1], token_ids=[5, 6])
    raw, text = bytearray(path.read_bytes()), b'"source": "training"'
    raw[bytes(raw).rfind(text) + len(text) - 2] ^= 0x01
    path.write_bytes(bytes(raw))
    out = tmp_path / f"copy.{fmt}"
    args = [str(path), str(out)] if command == "convert" else [str(path), "-o", str(out)]
    done = cli(command, *args, "--no-verify")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [
        f"error: {path}: corrupt trace: its run metadata fails its checksum"]
    assert not out.exists()
