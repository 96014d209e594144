"""``--aux-convention vllm``: a draft's aux ids read as vLLM 0.32 reads them for the trace's target
(integrations/vllm/aux_reading.py): as given, id k the stream entering layer k, where SGLang's Llama
reads k + 1; and replay rebuilding the fc input from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli
from tracediff.integrations.sglang.aux_reading import sglang_aux
from tracediff.integrations.target_summary import TargetShape
from tracediff.integrations.vllm.aux_reading import reads_aux, vllm_aux

SAMPLES = Path(__file__).resolve().parents[1] / "traces" / "eagle3"
EMBED = "target.embed"
L0, L1, L2, L3, L4, L5 = (f"target.layer.{i}" for i in range(6))


@pytest.mark.parametrize("architecture, ids, vllm, sglang", [
    ("LlamaForCausalLM", [1, 2, 4], [L0, L1, L3], [L1, L2, L4]),  # SGLang: ids + 1
    ("LlamaForCausalLM", [0, 2, 4], [EMBED, L1, L3], [L0, L2, L4]),
    ("LlamaForCausalLM", [4, 1, 2], [L0, L1, L3], [L1, L2, L4]),  # both concatenate ascending
    ("DeepseekV3ForCausalLM", [2, 3, 4], [L1, L2, L3], [L1, L2, L3]),  # SGLang keeps ids not starting at 1
    ("GptOssForCausalLM", [1, 3, 6], [L0, L2, L5], [L0, L2, L5]),  # SGLang keeps ids ending at L
])
def test_ids_read_as_vllm_reads_them_next_to_sglang(architecture, ids, vllm, sglang):
    spec = vllm_aux(ids, TargetShape(architecture, 6))
    assert spec.sources() == vllm
    assert spec.to_dict()["aux_layer_convention"] == "input_to_layer"
    assert sglang_aux(ids, TargetShape(architecture, 6)).sources() == sglang


def test_what_vllm_cannot_feed_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"vLLM's DeepseekV3ForCausalLM refuses ids \[0, 2, 4\] on 6 layers "
                                         r"\(TypeError"):
        vllm_aux([0, 2, 4], TargetShape("DeepseekV3ForCausalLM", 6))
    with pytest.raises(ValueError, match=r"captures 2 states for ids \[1, 3, 7\] on 6 layers \[layer 0, "
                                         r"layer 2\]: aux_hidden_state_layers \[1, 3, 7\] names boundary 7"):
        vllm_aux([1, 3, 7], TargetShape("LlamaForCausalLM", 6))
    with pytest.raises(ValueError, match="Model does not support EAGLE3 interface"):
        vllm_aux([1, 2, 3], TargetShape("Gemma3ForCausalLM", 6))
    with pytest.raises(ValueError, match="NoSuchForCausalLM is not in tracediff's table of vllm"):
        vllm_aux([1, 2, 3], TargetShape("NoSuchForCausalLM", 6))


def test_the_target_comes_from_the_contract_else_the_checkpoint():
    """A vLLM serving contract states the target's config (``target_config``); a training trace may
    name it by class; without either, the target's config.json; with none of them, None."""
    served = {"source": "serving", "draft_engine": "vllm", "vllm_version": "0.32.0",
              "target_config": {"architecture": "Qwen3ForCausalLM", "num_hidden_layers": 6}}
    assert reads_aux(served, None, [1, 3, 5]).sources() == [L0, L2, L4]
    config = json.loads((SAMPLES / "target" / "config.json").read_text())
    assert reads_aux({}, config, [0, 2, 4]).sources() == [EMBED, L1, L3]
    assert reads_aux({}, None, [1, 3, 5]) is None


def replay(*args: str):
    return cli("replay", str(SAMPLES / "training.h5"), "--draft", str(SAMPLES / "draft"), "--json", *args)


@pytest.mark.slow
def test_replay_feeds_what_vllm_would_feed():
    """On the 6-layer Llama sample vLLM reads the draft's ids [1, 3, 5] as the streams entering layers
    1, 3, 5 (the outputs of layers 0, 2, 4): the replay is the one of those layers, to the last
    digit, one layer earlier than SGLang's reading of the same ids."""
    by_vllm = replay("--target", str(SAMPLES / "target"), "--aux", "1,3,5", "--aux-convention", "vllm")
    by_layer = replay("--target", str(SAMPLES / "target"), "--aux", "0,2,4")
    assert by_vllm.returncode == 0, by_vllm.stderr
    assert json.loads(by_vllm.stdout) == json.loads(by_layer.stdout)
    assert json.loads(by_vllm.stdout)["aux"] == "target.layer.0, target.layer.2, target.layer.4"


def test_an_id_vllm_cannot_feed_is_one_error_line():
    done = replay("--target", str(SAMPLES / "target"), "--aux", "1,3,7", "--aux-convention", "vllm")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: --aux: vLLM's LlamaForCausalLM captures 2 states"), done.stderr
