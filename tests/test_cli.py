"""The CLI as a user meets it: show, convert, and one clear line for every bad input."""

from __future__ import annotations

import hashlib
import json
import shutil

import h5py
import numpy as np
import pyarrow as pa
import pytest

import tracediff as td
from tests.conftest import REPO, cli, run_cli, step_tensor


@pytest.fixture
def small_trace(tmp_path, fmt):
    path = tmp_path / f"small.{fmt}"
    with td.record(path, source="serving", meta={"aux_layer_ids": [2, 5]}) as rec:
        for step in range(3):
            rec.log("draft.fc_in", step_tensor(step), step=step, token_ids=np.arange(16), request="r7")
            rec.log("draft.logits", step_tensor(step, (16, 8)) * np.nan, step=step, token_ids=np.arange(16))
    return path


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_show_table_and_json(small_trace) -> None:
    out = cli("show", str(small_trace))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "draft.fc_in" in line]
    assert len(lines) == 1 and "float32" in lines[0] and "(32,)" in lines[0] and "48" in lines[0]
    assert '"aux_layer_ids": [2, 5]' in out.stdout and "serving" in out.stdout
    data = json.loads(cli("show", str(small_trace), "--json").stdout)
    fc = data["tensors"][0]
    assert (fc["name"], fc["rows"], fc["records"], fc["steps"], fc["requests"], fc["bytes"]) == (
        "draft.fc_in", 48, 3, 3, 1, 3 * 16 * 32 * 4)
    assert data["complete"] and data["meta"]["source"] == "serving"


@pytest.mark.parametrize("measured, said", [
    (["target.layer.1", "target.layer.3", "target.layer.4"],
     "aux ids [2, 4, 5] fed [layer 1, layer 3, layer 4]"),
    (None, "aux ids [2, 4, 5]: no forward measured what the aux held"),
])
def test_show_says_which_target_served_and_what_each_aux_slot_held(tmp_path, measured, said) -> None:
    """A serving trace names its target class and family and what the fc-input slots were fed, in one
    line above the contract (the contract, the writer's updates included, stays below it)."""
    with td.record(tmp_path / "serve.h5", source="serving",
                   meta={"target_model_class": "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM",
                         "target_family": "deepseek_v2", "target_num_layers": 6, "aux_layer_ids": [2, 4, 5],
                         "aux_capture_set": [2, 4, 5]}) as rec:
        rec.update_contract(aux_slot_states=measured)
        rec.log("target.aux", np.zeros((2, 6), np.float32), token_ids=[5, 6])
    out = cli("show", str(tmp_path / "serve.h5"))
    assert out.returncode == 0, out.stderr
    [line] = [line for line in out.stdout.splitlines() if line.startswith("target: ")]
    assert line == f"target: DeepseekV3ForCausalLM (family deepseek_v2, 6 layers) · {said}"
    shown = json.loads(cli("show", str(tmp_path / "serve.h5"), "--json").stdout)
    assert shown["contract"]["aux_slot_states"] == measured


def test_show_stats_of_one_tensor(small_trace) -> None:
    out = cli("show", str(small_trace), "--name", "draft.fc_in", "--step", "1", "--json")
    stats = json.loads(out.stdout)
    x = step_tensor(1)
    assert stats["rows"] == 16 and stats["nan"] == 0
    assert stats["mean"] == pytest.approx(float(x.mean()), rel=1e-6)
    assert stats["head"] == pytest.approx(x[0, :8].tolist())
    nan = json.loads(cli("show", str(small_trace), "--name", "draft.logits", "--json").stdout)
    assert nan["nan"] == 3 * 16 * 8


def test_convert_cli(small_trace, tmp_path) -> None:
    other = tmp_path / ("out.arrow" if small_trace.suffix == ".h5" else "out.h5")
    done = cli("convert", str(small_trace), str(other))
    assert done.returncode == 0, done.stderr
    with td.open_trace(small_trace) as a, td.open_trace(other) as b:
        assert a.rows("draft.fc_in").data.tobytes() == b.rows("draft.fc_in").data.tobytes()


def foreign_h5(path):
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    return "not a tracediff trace"


def foreign_arrow(path):
    table = pa.table({"a": [1, 2]})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return "not a tracediff trace"


def text_file(path):
    path.write_text("hello\n")
    return "not a trace file"


def empty_file(path):
    path.write_bytes(b"")
    return "empty file"


@pytest.mark.parametrize("make", [foreign_h5, foreign_arrow, text_file, empty_file])
def test_foreign_files_give_one_line(tmp_path, make) -> None:
    path = tmp_path / "bad.h5"
    expected = make(path)
    before = digest(path)
    out = cli("show", str(path))
    assert out.returncode == 2
    assert out.stderr.strip() == out.stderr.strip().splitlines()[0]
    assert out.stderr.startswith(f"error: {path}: ") and expected in out.stderr
    assert "Traceback" not in out.stderr and digest(path) == before


@pytest.mark.subprocess
def test_missing_file(tmp_path) -> None:
    """At the real entry point, as a user meets it (tests/test_fuzz.py runs it on files that crashed it)."""
    out = run_cli("show", str(tmp_path / "nope.h5"))
    assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / 'nope.h5'}: no such file"


def test_truncated_files(small_trace, tmp_path) -> None:
    cut = tmp_path / f"cut{small_trace.suffix}"
    cut.write_bytes(small_trace.read_bytes()[:200])
    out = cli("show", str(cut))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "truncated or corrupt" in out.stderr and "Traceback" not in out.stderr


def test_newer_format_version_is_refused(small_trace, tmp_path) -> None:
    newer = tmp_path / f"newer{small_trace.suffix}"
    if small_trace.suffix == ".h5":
        shutil.copy(small_trace, newer)
        with h5py.File(newer, "a") as f:
            f.attrs["format_version"] = 99
    else:
        table = pa.ipc.open_file(str(small_trace)).read_all()
        meta = {**table.schema.metadata, b"tracediff.format_version": b"99"}
        with pa.ipc.new_file(str(newer), table.schema.with_metadata(meta)) as w:
            w.write_table(table)
    out = cli("show", str(newer))
    assert out.returncode == 2 and "format version 99" in out.stderr and "upgrade tracediff" in out.stderr


def test_unknown_tensor_name(small_trace) -> None:
    out = cli("show", str(small_trace), "--name", "draft.nope")
    assert out.returncode == 2 and "no rows of tensor 'draft.nope'" in out.stderr


def test_convert_refuses_bad_output(small_trace, tmp_path) -> None:
    out = cli("convert", str(small_trace), str(tmp_path / "x.csv"))
    assert out.returncode == 2 and "cannot tell the trace format" in out.stderr
    before = digest(small_trace)
    out = cli("convert", str(small_trace), str(small_trace))
    assert out.returncode == 2 and "overwrite the input" in out.stderr and digest(small_trace) == before


def test_show_stats_of_a_static_tensor() -> None:
    out = cli("show", str(REPO / "traces" / "eagle3" / "serving.h5"), "--name", "draft.d2t", "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["shape"] == [768] and stats["rows"] == 0 and len(stats["head"]) == 8


@pytest.mark.parametrize("option", [["--position", "3"], ["--request-b", "q"], ["--depth", "1"],
                                    ["--step-b", "0"], ["--top", "5"]])
def test_show_of_one_trace_refuses_options_that_need_two(small_trace, option) -> None:
    """Options of the side-by-side view (tracediff show A B) are not silently ignored on one trace."""
    from typer.testing import CliRunner

    from tracediff.cli import app

    out = CliRunner().invoke(app, ["show", str(small_trace), "--name", "draft.fc_in", *option])
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr.strip() == f"error: {option[0]}: needs two traces: tracediff show A B --name NAME ..."


def test_a_mistyped_tensor_name_gets_the_closest_names(small_trace) -> None:
    """``show --name`` and ``compare --map`` with a name the trace lacks: one error line that names
    the closest names it holds (difflib); a name like none of them gets no guess."""
    from typer.testing import CliRunner

    from tracediff.cli import app

    runner = CliRunner()
    done = runner.invoke(app, ["show", str(small_trace), "--name", "draft.fc_inn"])
    assert done.exit_code == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.strip() == f"error: {small_trace}: no rows of tensor 'draft.fc_inn'; did you mean " \
                                  "'draft.fc_in'? (list: tracediff show)"
    done = runner.invoke(app, ["show", str(small_trace), "--name", "draft.logit"])
    assert "; did you mean 'draft.logits'? (list" in done.stderr  # not draft.fc_in: only its prefix is alike
    done = runner.invoke(app, ["show", str(small_trace), "--name", "zzz"])
    assert done.exit_code == 2 and "did you mean" not in done.stderr
    # a name it holds, at a step it lacks: the name is right, nothing to guess
    done = runner.invoke(app, ["show", str(small_trace), "--name", "draft.fc_in", "--step", "9"])
    assert done.exit_code == 2 and "did you mean" not in done.stderr
    done = runner.invoke(app, ["compare", str(small_trace), str(small_trace), "--map",
                               "draft.fc_in=draft.fcin"])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1
    assert "a has no tensor named 'draft.fcin' (did you mean 'draft.fc_in'?): the map would hide" \
        in done.stderr


@pytest.mark.subprocess
@pytest.mark.parametrize("args, said", [
    (("compare", "a.h5"), "error: tracediff compare: Missing argument 'b'. (see --help)"),
    (("show", "a.h5", "--name", "h", "--step", "abc"), "error: tracediff show: Invalid value for '--step'"),
    (("nosuch",), "error: tracediff: No such command 'nosuch'. (see --help)"),
])
def test_a_usage_error_is_one_error_line_at_the_real_entry_point(args, said) -> None:
    """A missing argument, a value of the wrong kind or an unknown command is bad input like any
    other: one ``error:`` line, exit 2, no box drawn around it (the console script's main)."""
    done = run_cli(*args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(said), done.stderr
