"""Rank files are one run's: ``convert`` refuses an output that would hide rank files or join
another trace's (the check ``slice`` makes, one home: trace/copies.py), and a reader refuses a rank
set whose files' own metadata contradicts their names or each other, with one error line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

import tracediff as td
from tests.conftest import cli


def ranked(tmp_path: Path, fmt: str, stem: str = "rk") -> Path:
    """``stem.rank0`` / ``stem.rank1`` of a two-rank run; the stem path."""
    for rank in (0, 1):
        with td.record(tmp_path / f"{stem}.{fmt}", source="serving", rank=rank, world_size=2) as rec:
            rec.log("target.h", np.ones((1, 4), np.float32), request="r", positions=[0], token_ids=[1])
    return tmp_path / f"{stem}.{fmt}"


def one_line(done, path: Path, problem: str) -> None:
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr == f"error: {path}: {problem}\n", done.stderr


def test_convert_refuses_the_stem_of_existing_rank_files(tmp_path, fmt) -> None:
    stem = ranked(tmp_path, fmt)
    done = cli("convert", str(tmp_path / f"rk.rank0.{fmt}"), str(stem))
    one_line(done, stem, f"is the stem of the rank files rk.rank0.{fmt}, rk.rank1.{fmt}: a trace written "
                         "there would hide them (choose another name)")
    assert not stem.exists()


def test_convert_refuses_to_add_a_rank_file_to_an_existing_set(tmp_path, fmt) -> None:
    ranked(tmp_path, fmt)
    single = tmp_path / f"one.{fmt}"
    with td.record(single, source="training") as rec:
        rec.log("target.h", np.ones((1, 4), np.float32), request="r", positions=[0], token_ids=[1])
    out = tmp_path / f"rk.rank2.{fmt}"
    done = cli("convert", str(single), str(out))
    one_line(done, out, f"would join the rank files rk.rank0.{fmt}, rk.rank1.{fmt} (read with them as one "
                        "trace): choose another name")
    assert not out.exists()


def test_reader_refuses_a_file_whose_rank_contradicts_its_name(tmp_path, fmt) -> None:
    stem = ranked(tmp_path, fmt)
    shutil.copyfile(tmp_path / f"rk.rank0.{fmt}", tmp_path / f"rk.rank1.{fmt}")  # rank 0 named rank 1
    one_line(cli("show", str(stem)), tmp_path / f"rk.rank1.{fmt}",
             "its metadata says rank 0 but its name says rank 1: not a rank file of this trace")


def test_reader_refuses_a_file_of_another_run_in_the_set(tmp_path, fmt) -> None:
    stem = ranked(tmp_path, fmt)
    with td.record(tmp_path / f"four.{fmt}", source="serving", rank=2, world_size=4) as rec:
        rec.log("target.h", np.ones((1, 4), np.float32), request="r", positions=[0], token_ids=[1])
    shutil.copyfile(tmp_path / f"four.rank2.{fmt}", tmp_path / f"rk.rank2.{fmt}")
    one_line(cli("show", str(stem)), tmp_path / f"rk.rank2.{fmt}",
             f"its metadata says world_size 4 but rk.rank0.{fmt} says 2: not a rank file of the same run")


def test_a_consistent_rank_set_reads_as_one_trace(tmp_path, fmt) -> None:
    stem = ranked(tmp_path, fmt)
    with td.open_trace(stem) as trace:
        assert len(trace.files) == 2
    out = tmp_path / f"copy.{fmt}"
    assert cli("convert", str(stem), str(out)).returncode == 0
    with td.open_trace(out) as trace:
        assert [f.meta["rank"] for f in trace.files] == [0, 1]
