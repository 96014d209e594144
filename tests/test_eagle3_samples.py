"""The committed EAGLE-3 sample: replay tells the aux bug from the healthy wiring, and the
generator reproduces every file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from safetensors.numpy import load_file

import tracediff as td
from tests.conftest import REPO, cli

SAMPLES = REPO / "traces" / "eagle3"
FIGURES = json.loads((SAMPLES / "figures.json").read_text())

pytest.importorskip("torch")


def replay(trace: str, *extra: str) -> dict:
    out = cli("replay", str(SAMPLES / trace), "--draft", str(SAMPLES / "draft"), "--target",
                  str(SAMPLES / "target"), "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_replaying_the_training_trace_gives_the_training_accuracy() -> None:
    report = replay("training.h5")
    assert report["depth_accuracy"] == pytest.approx(FIGURES["training_acc_per_depth"], abs=1e-6)


def test_replay_shows_the_aux_bug_and_its_fix() -> None:
    training = FIGURES["training_acc_per_depth"][0]
    healthy = replay("serving.h5")
    broken = replay("serving_aux_bug.h5")
    fixed = replay("serving_aux_bug.h5", "--aux", "embed,1,3")
    assert healthy["depth_accuracy"][0] > training - 0.1
    assert broken["depth_accuracy"][0] < 0.15 and broken["expected_accept_len"] < 1.2
    assert fixed["depth_accuracy"][0] > training - 0.1 and fixed["aux"].startswith("target.embed")
    # the same fix under SGLang's numbering: inputs of layers 2 and 4 are outputs of 1 and 3
    sglang = replay("serving_aux_bug.h5", "--aux", "embed,2,4", "--aux-convention", "input_to_layer")
    assert sglang["depth_accuracy"] == fixed["depth_accuracy"]


def test_replay_bad_inputs(tmp_path) -> None:
    no_target_tokens = tmp_path / "t.h5"
    with td.record(no_target_tokens) as rec:
        rec.log("draft.fc_in", np.zeros((2, 192), np.float32), token_ids=np.arange(2))
    for args, expected in (
        ([str(no_target_tokens), "--target", str(SAMPLES / "target")], "replay needs recorded target.token"),
        ([str(SAMPLES / "serving.h5")], "no embed_tokens.weight in the checkpoint"),
        ([str(SAMPLES / "serving.h5"), "--aux", "1,embed"], "--aux takes 'embed' (first)"),
    ):
        out = cli("replay", *args, "--draft", str(SAMPLES / "draft"))
        assert out.returncode == 2 and expected in out.stderr and "Traceback" not in out.stderr, out.stderr


VOLATILE = {"created": "the time the file was written", "host": "hostname and pid of the writing process",
            "versions": "versions of the libraries the writing process had loaded"}


def layout(tensors: dict[str, np.ndarray]) -> dict[str, tuple]:
    return {name: (value.dtype, value.shape) for name, value in tensors.items()}


@dataclass
class Generation:
    """The generator's run into a folder of its own; its stderr in a file (a pipe could fill and stall it)."""

    process: subprocess.Popen
    out: Path
    stderr: IO[str]


GENERATED: list[Generation] = []


def start_generator() -> subprocess.Popen:
    """The generator, as a user runs it: ~2.5 min of training on one core."""
    if not GENERATED:
        out, stderr = Path(tempfile.mkdtemp(prefix="tracediff-samples-")), tempfile.TemporaryFile("w+")
        script = REPO / "scripts" / "make_eagle3_samples.py"
        process = subprocess.Popen([sys.executable, str(script), "--out", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        GENERATED.append(Generation(process, out, stderr))
    return GENERATED[0].process


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.start_early(start=start_generator)
def test_generator_reproduces_the_samples() -> None:
    """Training rounds differently on another CPU (its SIMD width changes the order of sums in
    torch's kernels), so a regenerated sample matches the committed one in everything but the
    trained numbers, and in its figures to within what that rounding moves them."""
    start_generator()  # started when the suite's collection ended (conftest), unless run on its own
    run = GENERATED[0]
    tmp_path = run.out  # what the checks below compare with the committed sample
    run.process.wait(timeout=900)
    run.stderr.seek(0)
    assert run.process.returncode == 0, run.stderr.read()
    assert (tmp_path / "draft/config.json").read_bytes() == (SAMPLES / "draft/config.json").read_bytes()
    for model in ("draft", "target"):  # the same tensors, trained values aside
        old, new = (load_file(str(root / model / "model.safetensors")) for root in (SAMPLES, tmp_path))
        assert layout(old) == layout(new), model
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["training_acc_per_depth"] == pytest.approx(FIGURES["training_acc_per_depth"], abs=0.05)
    assert figures["serving_mean_accept_len"] == pytest.approx(FIGURES["serving_mean_accept_len"], abs=0.25)
    assert figures["serving_aux_bug_mean_accept_len"] < 1.2
    for name in ("training.h5", "serving.h5", "serving_aux_bug.h5"):
        with td.open_trace(SAMPLES / name) as old, td.open_trace(tmp_path / name) as new:
            differ = {k for k in old.meta.keys() | new.meta.keys() if old.meta.get(k) != new.meta.get(k)}
            allowed = {*VOLATILE, "contract", "format_version"}  # the committed samples are format v1
            assert differ <= allowed, f"{name}: metadata differs in {differ - set(VOLATILE)}"
            assert old.meta["contract"].keys() == new.meta["contract"].keys()  # d2t hash, figures: trained
            assert old.names() == new.names()
            assert set(zip(old.index.dtype, old.index.name)) == set(zip(new.index.dtype, new.index.name))
    # the training data is fixed: the training trace differs only in trained values
    with td.open_trace(SAMPLES / "training.h5") as old, td.open_trace(tmp_path / "training.h5") as new:
        assert len(old.index) == len(new.index)
        for i in range(len(old.index)):
            a, b = old.read(i), new.read(i)
            assert (a.name, a.step, a.depth, a.seq_no, a.data.shape) == (b.name, b.step, b.depth, b.seq_no,
                                                                         b.data.shape)
            assert a.position.tolist() == b.position.tolist() and a.request.tolist() == b.request.tolist()
            assert a.token_id.tolist() == b.token_id.tolist()
    shutil.rmtree(tmp_path)


def test_replay_out_is_written_whole_and_never_over_an_existing_file(tmp_path) -> None:
    """replay --out follows every writer's rule: an existing path needs --force, the input never."""
    args = [str(SAMPLES / "serving.h5"), "--draft", str(SAMPLES / "draft"),
            "--target", str(SAMPLES / "target"), "--json", "--depths", "2"]
    out = tmp_path / "replayed.h5"
    assert cli("replay", *args, "--out", str(out)).returncode == 0
    with td.open_trace(out) as trace:
        assert trace.complete and trace.names()
    before = out.read_bytes()
    again = cli("replay", *args, "--out", str(out))
    assert again.returncode == 2 and "exists: pass --force" in again.stderr and out.read_bytes() == before
    assert cli("replay", *args, "--out", str(out), "--force").returncode == 0
    link = tmp_path / "input.h5"
    shutil.copy(SAMPLES / "serving.h5", link)
    onto_input = cli("replay", str(link), *args[1:], "--out", str(link), "--force")
    assert onto_input.returncode == 2 and "input" in onto_input.stderr
    assert link.read_bytes() == (SAMPLES / "serving.h5").read_bytes()
    draft = tmp_path / "draft"
    shutil.copytree(SAMPLES / "draft", draft)
    weights = tmp_path / "weights.h5"
    weights.hardlink_to(draft / "model.safetensors")  # an output that is the draft's weights
    with_draft = [args[0], "--draft", str(draft), *args[3:]]
    onto_weights = cli("replay", *with_draft, "--out", str(weights), "--force")
    assert onto_weights.returncode == 2 and "input" in onto_weights.stderr
    assert weights.read_bytes() == (SAMPLES / "draft" / "model.safetensors").read_bytes()
    shutil.rmtree(draft)
    weights.unlink()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
