"""A draft checkpoint is input too: replay, explain, doctor and ``bundle --draft`` on hostile draft
folders (testbed/hostile.py) and on chains deeper than the inputs hold give one ``error:`` line,
or name what is wrong, in bounded memory and time, leaving nothing behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from testbed.hostile import (
    HOSTILE,
    SAMPLE_DRAFT,
    SAMPLES,
    config_edit,
    hostile_draft,
    run_capped,
    with_num_steps,
)
from tests.conftest import cli

TARGET = SAMPLES / "target"
SERVING, TRAINING, BUG = SAMPLES / "serving.h5", SAMPLES / "training.h5", SAMPLES / "serving_aux_bug.h5"
LOADS = ("--target", str(TARGET))
GIB = 1 << 30
# hostile checkpoints no command can use: each is one error line
REFUSED = [name for name in HOSTILE if not name.startswith(("NaN", "inf"))]


def one_error_line(done, *named: str) -> str:
    """The command's stderr: exactly one line, ``error: ...``, naming each of ``named``."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for part in named:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def loading(command: str, draft: Path, tmp_path: Path, *extra: str) -> list[str]:
    """The arguments of ``command`` (replay, explain, bundle --draft) loading ``draft``."""
    return {"replay": ["replay", str(SERVING), "--draft", str(draft), *LOADS, *extra],
            "explain": ["explain", str(TRAINING), str(BUG), "--draft", str(draft), *LOADS, *extra],
            "bundle": ["bundle", str(TRAINING), str(BUG), "-o", str(tmp_path / "out"), "--draft", str(draft),
                       *LOADS, *extra]}[command]


@pytest.mark.parametrize("command", ["replay", "explain", "bundle"])
def test_a_config_claiming_sizes_the_weights_lack_is_refused_before_building(tmp_path, command) -> None:
    """hidden_size 65536 over 64-wide weights: the shapes are checked against the file's header
    before anything is allocated (building that draft first asked for 48 GB and raised)."""
    draft = hostile_draft("hidden_size 65536", tmp_path / "draft")
    done = cli(*loading(command, draft, tmp_path))
    one_error_line(done, str(draft / "model.safetensors"), "fc.weight has shape (64, 192)",
                   "config implies (65536, 196608)")


def test_a_size_only_the_targets_weight_contradicts_names_the_config(tmp_path) -> None:
    """The embedding comes from the target (the draft's file has none): a vocab_size the target's
    embedding does not have names config.json, and gives the target's shape as the target's (the
    draft's model.safetensors holds no such weight to blame)."""
    draft = tmp_path / "draft"
    shutil.copytree(SAMPLE_DRAFT, draft)
    config_edit(vocab_size=2048)(draft)
    weights = draft / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "t2d"}, weights)  # a [2048] t2d
    done = cli("replay", str(SERVING), "--draft", str(draft), *LOADS)
    one_error_line(done, f"error: {draft / 'config.json'}: implies embed_tokens.weight of shape (2048, 64); "
                         "the target's has shape (1024, 64)")


def test_a_symlink_loop_is_not_reported_as_missing(tmp_path) -> None:
    draft = hostile_draft("model.safetensors is a link loop", tmp_path / "draft")
    for args in (["replay", str(SERVING), "--draft", str(draft), *LOADS], ["doctor", "--draft", str(draft)]):
        line = one_error_line(cli(*args), str(draft / "model.safetensors"), "symbolic links")
        assert "no model.safetensors" not in line


def test_doctor_names_each_weight_holding_nan_or_inf(tmp_path) -> None:
    for name, weight, count in (("NaN in lm_head.weight", "lm_head.weight", "64 NaN of 49152 values"),
                                ("inf in fc.weight", "fc.weight", "192 inf of 12288 values")):
        draft = hostile_draft(name, tmp_path / weight)
        done = cli("doctor", "--draft", str(draft), "--target", str(TARGET), "--json")
        assert done.returncode == 1, done.stderr
        found = [f for f in json.loads(done.stdout) if f["code"] == "weights_nonfinite"]
        assert [f["severity"] for f in found] == ["error"]
        assert f"{weight} ({count})" in found[0]["message"]
    healthy = cli("doctor", "--draft", str(SAMPLE_DRAFT), "--target", str(TARGET), "--json")
    assert not [f for f in json.loads(healthy.stdout) if f["code"] == "weights_nonfinite"]


@pytest.mark.slow
def test_replays_self_check_names_nan_weights_before_any_engine_reading(tmp_path) -> None:
    """Every draft token is NaN's argmax: the self-check's suspect is the weights, not the reading."""
    draft = hostile_draft("NaN in lm_head.weight", tmp_path / "draft")
    done = cli("replay", str(SERVING), "--draft", str(draft), *LOADS, "--json")
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["self_check"]
    assert check["first_departure"] is not None
    assert check["suspect"].startswith("the draft's weights hold non-finite values: lm_head.weight (64 NaN")


@pytest.mark.parametrize("depths", [100_000, 2**63])
@pytest.mark.parametrize("command", ["replay", "explain", "bundle"])
def test_a_chain_deeper_than_the_trace_holds_is_one_error_line(tmp_path, command, depths) -> None:
    """The sample's requests record target tokens up to position 21 (training's to 27): no row has
    one to be scored against at depth 21 (10**5 depths ran on without end, 2**63 raised
    OverflowError / ValueError)."""
    done = cli(*loading(command, SAMPLE_DRAFT, tmp_path, "--depths", str(depths)))
    trace = SERVING if command == "replay" else BUG  # explain, bundle: the tighter of the two traces
    one_error_line(done, f"error: {trace}: a chain of {depths} draft depths (--depths) is deeper than the 21 "
                         "it can hold: its requests record the target's token up to position 21 at most")


@pytest.mark.parametrize("num_steps", [100_000, 2**63])
def test_a_trace_stating_more_steps_than_it_holds_is_one_error_line(tmp_path, num_steps) -> None:
    trace = with_num_steps(SERVING, tmp_path / "serving.h5", num_steps)
    done = cli("replay", str(trace), "--draft", str(SAMPLE_DRAFT), *LOADS)
    one_error_line(done, f"error: {trace}: a chain of {num_steps} draft depths (the trace's speculative "
                         f"num_steps {num_steps})")


def test_a_chain_deeper_than_the_drafts_positions_names_its_config(tmp_path) -> None:
    """max_position_embeddings 8 is the tighter bound (the traces hold 21 and 27): the draft's
    config.json is named."""
    draft = tmp_path / "draft"
    shutil.copytree(SAMPLE_DRAFT, draft)
    config_edit(max_position_embeddings=8)(draft)
    for command in ("replay", "explain"):
        one_error_line(cli(*loading(command, draft, tmp_path, "--depths", "9")),
                       f"error: {draft / 'config.json'}: a chain of 9 draft depths (--depths) is deeper than "
                       "the 8 it can hold: max_position_embeddings is 8")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("name", REFUSED)
def test_each_unusable_checkpoint_is_one_error_line_within_1_gib(tmp_path, name) -> None:
    """Its own process (a FIFO blocked every command, /dev/zero was read without end, a lying
    config allocated GBs): one error line, no hang, peak RSS under 1 GiB (an address-space cap of 4
    GiB keeps a regression from taking the machine)."""
    draft = hostile_draft(name, tmp_path / "draft")
    commands = [loading("replay", draft, tmp_path)]
    if "FIFO" in name or "/dev/zero" in name:
        commands.append(["doctor", "--draft", str(draft)])
    for args in commands:
        done = run_capped(args, tmp_path, limit=90)
        assert done.exit == 2, (args[0], done.exit, done.first_line)
        assert len(done.stderr) == 1 and done.stderr[0].startswith(f"error: {draft}"), done.stderr
        assert done.peak_rss_mb < 1024, done


@pytest.mark.slow
@pytest.mark.subprocess
def test_doctor_leaves_nothing_in_tmpdir(tmp_path) -> None:
    """Laying the draft out on the meta device once imported torch._dynamo, which created
    $TMPDIR/torchinductor_$USER."""
    done = run_capped(["doctor", "--draft", str(SAMPLE_DRAFT), "--target", str(TARGET)], tmp_path, limit=90)
    assert done.exit == 1, done.first_line  # the sample draft's known errors
    assert done.tmp_left == []


def _rewritten(draft: Path, **tensors) -> None:
    """model.safetensors with ``tensors`` (name -> tensor) replacing or adding its own."""
    weights = draft / "model.safetensors"
    save_file({**load_file(weights), **tensors}, weights)


@pytest.mark.parametrize(("key", "kind", "stored"), [
    ("fc.weight", "int32", "I32"), ("d2t", "float32", "F32"), ("lm_head.weight", "int8", "I8"),
    ("fc.weight", "bool", "BOOL")])
def test_a_tensor_stored_in_a_type_it_cannot_be_is_refused(tmp_path, key, kind, stored) -> None:
    """From an adversarial review: integer weights were read as numbers (a figure at exit 0); a float
    d2t as offsets. Each is one error line naming the file, the tensor and its type."""
    import torch

    draft = tmp_path / "draft"
    shutil.copytree(SAMPLE_DRAFT, draft)
    _rewritten(draft, **{key: load_file(draft / "model.safetensors")[key].to(getattr(torch, kind))})
    done = cli("replay", str(SERVING), "--draft", str(draft), *LOADS)
    one_error_line(done, str(draft / "model.safetensors"), f"{key} is stored as {stored}: expected")


@pytest.mark.parametrize(("shift", "outside"), [(10**6, 768), (-5, 3)])
def test_a_vocab_map_outside_the_targets_vocab_is_refused(tmp_path, shift, outside) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(SAMPLE_DRAFT, draft)
    d2t = load_file(draft / "model.safetensors")["d2t"]
    _rewritten(draft, d2t=d2t + shift)
    done = cli("replay", str(SERVING), "--draft", str(draft), *LOADS)
    line = one_error_line(done, str(draft / "model.safetensors"),
                          f"d2t maps {outside} draft ids outside the target's vocab [0, 1024): draft id 0 ")
    assert line.endswith(f"-> {int(d2t[0]) + shift}")


def test_an_activation_replay_does_not_compute_is_refused_and_rope_scaling_is_said(tmp_path) -> None:
    """gelu was computed as silu (the same figure at exit 0); a rope_scaling was left out in silence."""
    draft = tmp_path / "draft"
    shutil.copytree(SAMPLE_DRAFT, draft)
    config_edit(hidden_act="gelu")(draft)
    refused = cli("replay", str(SERVING), "--draft", str(draft), *LOADS)
    one_error_line(refused, str(draft / "config.json"), 'hidden_act is "gelu": replay computes the draft')
    config_edit(hidden_act="silu", rope_scaling={"rope_type": "linear", "factor": 4.0})(draft)
    done = cli("replay", str(SERVING), "--draft", str(draft), *LOADS, "--json")
    assert done.returncode == 0, done.stderr
    said = 'config.json sets rope_scaling {"rope_type": "linear", "factor": 4.0}'
    notes = json.loads(done.stdout)["engine_notes"]
    assert f"{said}: replay rotates by rope_theta alone, without it" in notes
