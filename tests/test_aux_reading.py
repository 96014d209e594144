"""``--aux-convention sglang``: a draft's aux ids read as SGLang reads them for the trace's target
family (integrations/sglang/aux_reading.py), and replay rebuilding the fc input from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli
from tracediff.integrations.sglang.aux_reading import sglang_aux
from tracediff.integrations.target_summary import TargetShape, target_shape

SAMPLES = Path(__file__).resolve().parents[1] / "traces" / "eagle3"


L0, L1, L2, L3, L4, L5 = (f"target.layer.{i}" for i in range(6))


@pytest.mark.slow
@pytest.mark.parametrize("architecture, ids, states", [
    ("LlamaForCausalLM", [0, 2, 4], [L0, L2, L4]),  # ids + 1: the output of layer i
    ("DeepseekV3ForCausalLM", [0, 2, 4], ["target.embed", L1, L3]),  # kept as given: the input of layer i
    ("DeepseekV3ForCausalLM", [1, 2, 4], [L1, L2, L4]),  # the first id is 1: + 1
    ("GptOssForCausalLM", [1, 3, 6], [L0, L2, L5]),  # the largest id is the layer count: kept as given
])
def test_ids_read_as_the_family_reads_them(architecture, ids, states):
    assert sglang_aux(ids, TargetShape(architecture, 6)).sources() == states


def test_what_no_trace_can_rebuild_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"branch outputs \[layer 1 branch"):
        sglang_aux([1, 2, 3], TargetShape("Gemma3ForCausalLM", 6))  # Gemma 3 captures branches
    with pytest.raises(ValueError, match=r"captures 2 states for ids \[1, 3, 6\] on 6 layers \[layer 1, "
                       r"layer 3\]: layers_to_capture \[2, 4, 7\] names boundary 7"):
        sglang_aux([1, 3, 6], TargetShape("LlamaForCausalLM", 6))
    with pytest.raises(ValueError, match="NoSuchForCausalLM is not an EAGLE-3 target"):
        sglang_aux([1, 2, 3], TargetShape("NoSuchForCausalLM", 6))


def test_the_target_comes_from_the_contract_else_the_checkpoint():
    served = {"target_model_class": "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM",
              "target_num_layers": 61}
    assert target_shape(served) == TargetShape("DeepseekV3ForCausalLM", 61)
    trained = {"target_config": {"architecture": "Qwen3ForCausalLM", "num_hidden_layers": 28}}
    assert target_shape(trained) == TargetShape("Qwen3ForCausalLM", 28)
    config = json.loads((SAMPLES / "target" / "config.json").read_text())
    assert target_shape({}, config) == TargetShape("LlamaForCausalLM", 6)
    assert target_shape({}) is None


def replay(*args: str):
    return cli("replay", str(SAMPLES / "training.h5"), "--draft", str(SAMPLES / "draft"), "--json", *args)


@pytest.mark.slow
def test_replay_feeds_what_sglang_would_feed():
    """On the Llama sample SGLang reads ids [1, 3, 4] as the outputs of layers 1, 3, 4: the replay is
    the one of those layers, to the last digit; the architecture comes from --target's config."""
    by_family = replay("--target", str(SAMPLES / "target"), "--aux", "1,3,4", "--aux-convention", "sglang")
    by_layer = replay("--target", str(SAMPLES / "target"), "--aux", "1,3,4")
    assert by_family.returncode == 0, by_family.stderr
    assert json.loads(by_family.stdout) == json.loads(by_layer.stdout)
    assert json.loads(by_family.stdout)["aux"] == "target.layer.1, target.layer.3, target.layer.4"


@pytest.mark.parametrize("args, problem", [
    (["--aux", "1,3,4", "--aux-convention", "sglang"],  # the sample's contract names no target class
     "training.h5: --aux-convention sglang needs the target's architecture"),
    (["--target", str(SAMPLES / "target"), "--aux", "1,3,6", "--aux-convention", "sglang"],
     "--aux: SGLang's LlamaForCausalLM captures 2 states for ids [1, 3, 6]"),
    (["--target", str(SAMPLES / "target"), "--aux", "1,3"],  # two slots for a fc that takes three
     "--aux: the fc input (target.layer.1, target.layer.3) is 128 wide (2 slots of 64); the draft's fc "
     "takes 192"),
    (["--aux", "embed,1,3", "--aux-convention", "sglang"],
     "--aux: --aux-convention sglang takes a draft's ids"),
])
def test_bad_readings_are_one_error_line(args, problem):
    done = replay(*args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and problem in lines[0], done.stderr
