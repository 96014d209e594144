"""The GPU device check (scripts/gpu_check.py, .sh) on the CPU: the same code path, so it cannot rot before
the next GPU session; and proof that its bit-for-bit comparison can fail."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import REPO
from tracediff.record.recorder import Recorder

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = REPO / "scripts" / "gpu_check.py"
SHELL = REPO / "scripts" / "gpu_check.sh"
QUICK = ["--device", "cpu", "--quick"]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return load_script()


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    """(exit code, output, out folder) of the whole CPU run as a user runs it on the device: the shell
    wrapper (scripts/gpu_check.sh), which runs the script in a subprocess and packs its traces."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHON": sys.executable}
    out = tmp_path_factory.mktemp("run")
    done = subprocess.run(["bash", str(SHELL), *QUICK], env={**env, "OUT": str(out)}, capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr, out


def checks_by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.subprocess
def test_the_shell_wrapper_names_missing_packages_and_stops(tmp_path):
    bare = tmp_path / "python-without-site-packages"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the interpreter's own
    done = subprocess.run(["bash", str(SHELL), *QUICK], env={**env, "OUT": str(tmp_path / "out"),
                                                              "PYTHON": str(bare)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert "gpu_check: needs numpy torch h5py pyarrow; nothing is fetched" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_one_flipped_bit_in_the_reference_copy_fails_the_check(gpu_check, tmp_path, capsys):
    rc = gpu_check.main([*QUICK, "--checks", "bitexact", "--dtypes", "bfloat16", "--corrupt", "draft.hidden",
                         "--out", str(tmp_path)])
    assert rc == 1
    failures = json.loads((tmp_path / "gpu_check.json").read_text())["failures"]
    assert len(failures) == 2  # one record, in each format
    for failure, fmt in zip(failures, ("h5", "arrow")):
        assert failure.startswith(f"bitexact/bfloat16/{fmt}: record ")
        assert "(draft.hidden, step 0, depth 0): raw bits differ in 1 of " in failure
    printed = capsys.readouterr().out
    assert printed.count("FAIL bitexact/bfloat16/") == 2
    assert (tmp_path / "traces" / "reference-bfloat16.h5").is_file()  # kept beside the trace for a look


def test_the_comparison_sees_row_keys_and_dtypes_not_only_bytes(gpu_check, tmp_path):
    values = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for name, tensor, positions in (("a", values, [0, 1]), ("b", values.view(torch.int32), [0, 2])):
        with Recorder(tmp_path / f"{name}.h5") as rec:
            rec.log("draft.hidden", tensor, request="r0", positions=positions, token_ids=[5, 6])
    compared, problems = gpu_check.compare_traces(tmp_path / "a.h5", tmp_path / "b.h5")
    assert compared == 1
    assert any("dtype 'float32' != 'int32'" in p for p in problems)
    assert any("row keys differ in position" in p for p in problems)
    assert any("token tables differ" in p for p in problems)
    assert not any("raw bits" in p for p in problems)  # the same bytes


def test_without_an_hf_target_the_draft_runs_on_synthesized_states(gpu_check, tmp_path):
    rc = gpu_check.main([*QUICK, "--checks", "bitexact", "--dtypes", "float32", "--formats", "arrow",
                         "--no-target", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["environment"]["target"] == "synthetic"
    assert checks_by_name(report)["bitexact/float32/arrow"]["figures"]["records_compared"] > 20



@pytest.mark.slow
@pytest.mark.subprocess
def test_the_cpu_run_passes_and_really_compares_records(script_run):
    rc, text, out = script_run
    assert rc == 0, text
    assert "gpu_check: all checks passed" in text
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and not report["failures"]
    checks = checks_by_name(report)
    for dtype in ("bfloat16", "float32"):
        for fmt in ("h5", "arrow"):
            check = checks[f"bitexact/{dtype}/{fmt}"]
            assert check["status"] == "pass"
            assert check["figures"]["records_compared"] > 20  # every canonical tensor of a target + 3 depths
            with tarfile.open(out / "gpu_check_traces.tgz") as tar:
                assert f"traces/device-{dtype}.{fmt}" in tar.getnames()
        timing = checks[f"timing/{dtype}"]["figures"]
        assert timing["off_ms_per_pass"] > 0 and timing["record_ratio"] > 0 and timing["mb_per_pass"] > 0
        assert timing["dropped"] == 0 and timing["filtered_bytes"] == 0
    assert checks["overwrite/cpu"]["status"] == "pass"
    assert {checks[n]["status"] for n in ("cuda/pinned-non-blocking-copies", "cuda/side-stream-overwrite")} \
        == {"skip"}
    assert "dtype" in text and "filtered" in text  # the figures table


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_shell_wrapper_runs_it_and_packs_the_traces(script_run):
    rc, text, out = script_run
    assert rc == 0, text
    assert "gpu_check: python packages: numpy" in text and "pyarrow" in text
    assert json.loads((out / "gpu_check.json").read_text())["ok"]
    assert "all checks passed" in (out / "gpu_check.log").read_text()
    with tarfile.open(out / "gpu_check_traces.tgz") as tar:
        names = sorted(tar.getnames())
    packed = [f"traces/device-{dtype}.{fmt}" for dtype in ("bfloat16", "float32") for fmt in ("arrow", "h5")]
    assert names == ["traces", *packed]
    assert not (out / "traces").exists()
