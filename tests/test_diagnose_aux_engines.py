"""compare's aux diagnosis across engines: a vLLM serving trace (its contract says ``draft_engine:
"vllm"``) whose aux slots hold other layers than a SpecForge training trace's or an SGLang serving
trace's is said with each engine's id rule: vLLM feeds the ids as given, SGLang (and SpecForge,
through SGLang's classes) ids + 1. Real traces: a tiny HF Llama's own states, written with the
Recorder, with the contract keys each producer writes."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402
from tracediff.eagle3.capture import run_target  # noqa: E402
from tracediff.eagle3.conventions import aux_state_keys  # noqa: E402

TOKENS = [3, 17, 250, 9, 88, 41, 7, 300, 12, 5, 99, 64]
IDS = [1, 4, 6]
AS_GIVEN = ["target.layer.0", "target.layer.3", "target.layer.5"]  # vLLM: the streams entering layers 1, 4, 6
PLUS_ONE = ["target.layer.1", "target.layer.4", "target.layer.6"]  # SGLang's Llama: entering layers 2, 5, 7
TARGET = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 8, "hidden_size": 64}


@pytest.fixture(scope="module")
def states() -> dict[str, torch.Tensor]:
    """The residual stream of an 8-layer target: embeddings, then each layer's output."""
    return {name: value[0] for name, value in run_target(tiny_llama(seed=4, layers=8),
                                                         torch.tensor([TOKENS])).states.items()}


def record(path, states, source: str, slots: list[str], **contract) -> None:
    with td.record(path, source=source) as rec:
        for name, value in states.items():
            rec.log(name, value, token_ids=TOKENS, request="x")
        rec.log("target.aux", torch.cat([states[s] for s in slots], -1), token_ids=TOKENS, request="x")
        rec.update_contract(**contract)


def vllm(ids=IDS, slots=AS_GIVEN, version="0.32.0") -> dict:
    """The contract keys the vLLM producer writes (integrations/vllm/facts.py, hooks.py)."""
    return {"draft_engine": "vllm", "vllm_version": version, "aux_layer_ids": ids,
            "aux_hidden_state_layers": sorted(set(ids)), "aux_slot_states": slots, "target_config": TARGET,
            **aux_state_keys(slots)}


def specforge(slots=PLUS_ONE) -> dict:
    """SpecForge's trainer contract (integrations/specforge/facts.py), capturing through SGLang."""
    return {"producer_integration": "specforge", "draft_engine": "specforge", "aux_layer_ids": IDS,
            "aux_layer_ids_from": "draft_config", "target_config": TARGET,
            "aux_layer_reading": "specforge 0.2.0 through sglang's LlamaForCausalLM", **aux_state_keys(slots)}


def sglang(slots=PLUS_ONE) -> dict:
    """SGLang's serving contract (integrations/sglang/facts.py)."""
    return {"sglang_version": "0.5.23", "target_model_class": "sglang.srt.models.llama.LlamaForCausalLM",
            "target_family": "llama", "target_num_layers": 8, "aux_layer_ids": IDS,
            "layers_to_capture": [2, 5, 7], "aux_capture_layers": [2, 5, 7], "aux_slot_states": slots,
            **aux_state_keys(slots)}


def diagnoses(a, b) -> dict[str, dict]:
    report = json.loads(td.compare(a, b).to_json())
    return {d["kind"]: d for d in report["diagnoses"]}


def test_vllm_serving_a_specforge_draft_feeds_every_slot_one_layer_early(states, tmp_path) -> None:
    """The same draft config (ids [1, 4, 6]) trained by SpecForge and served by vLLM 0.32."""
    record(tmp_path / "train.h5", states, "training", PLUS_ONE, **specforge())
    record(tmp_path / "serve.h5", states, "serving", AS_GIVEN, **vllm())
    found = diagnoses(tmp_path / "train.h5", tmp_path / "serve.h5")
    assert found["layer_offset"]["message"] == (
        "every target.aux slot is one layer apart: serving: vLLM 0.32 feeds ids [1, 4, 6] as given: "
        "[layer 0, layer 3, layer 5]; training (SpecForge 0.2.0, through SGLang: ids + 1) fed [layer 1, "
        "layer 4, layer 6] (output-of-layer vs input-to-layer convention)")
    assert found["layer_offset"]["evidence"]["slots_a"] == PLUS_ONE
    assert found["layer_offset"]["evidence"]["slots_b"] == AS_GIVEN


def test_the_vllm_side_is_said_first_whichever_side_it_is(states, tmp_path) -> None:
    record(tmp_path / "serve.h5", states, "serving", AS_GIVEN, **vllm())
    record(tmp_path / "train.h5", states, "training", PLUS_ONE, **specforge())
    message = diagnoses(tmp_path / "serve.h5", tmp_path / "train.h5")["layer_offset"]["message"]
    assert message.startswith(
        "every target.aux slot is one layer apart: serving: vLLM 0.32 feeds ids [1, 4, 6] as given: "
        "[layer 0, layer 3, layer 5]; training (SpecForge 0.2.0, through SGLang")


def test_vllm_against_sglang_serving_names_both_rules(states, tmp_path) -> None:
    record(tmp_path / "vllm.h5", states, "serving", AS_GIVEN, **vllm())
    record(tmp_path / "sglang.h5", states, "serving", PLUS_ONE, **sglang())
    message = diagnoses(tmp_path / "sglang.h5", tmp_path / "vllm.h5")["layer_offset"]["message"]
    assert "vLLM 0.32 feeds ids [1, 4, 6] as given: [layer 0, layer 3, layer 5]" in message
    assert "(SGLang 0.5.23, llama: ids + 1) fed [layer 1, layer 4, layer 6]" in message


def test_other_ids_on_the_other_side_are_named(states, tmp_path) -> None:
    """Written for vLLM (ids [2, 5, 7] at the top level): vLLM then feeds SGLang's states; a training
    run on other ids is said with its own."""
    record(tmp_path / "serve.h5", states, "serving", PLUS_ONE, **vllm(ids=[2, 5, 7], slots=PLUS_ONE))
    shifted = ["target.layer.0", "target.layer.3", "target.layer.6"]
    record(tmp_path / "train.h5", states, "training", shifted,
           **{**specforge(shifted), "aux_layer_ids": [0, 3, 6]})
    message = diagnoses(tmp_path / "train.h5", tmp_path / "serve.h5")["aux_layer_set"]["message"]
    assert message == (
        "aux layer set differs: serving: vLLM 0.32 feeds ids [2, 5, 7] as given: [layer 1, layer 4, "
        "layer 6]; training (SpecForge 0.2.0, through SGLang: ids + 1) fed [layer 0, layer 3, layer 6] for "
        "ids [0, 3, 6]")


def test_no_aux_finding_where_vllm_feeds_what_training_fed(states, tmp_path) -> None:
    record(tmp_path / "serve.h5", states, "serving", PLUS_ONE, **vllm(ids=[2, 5, 7], slots=PLUS_ONE))
    record(tmp_path / "train.h5", states, "training", PLUS_ONE, **specforge())
    found = diagnoses(tmp_path / "train.h5", tmp_path / "serve.h5")
    assert not {"layer_offset", "aux_layer_set", "aux_order"} & set(found)


def test_a_server_that_read_no_eagle_config_ids_is_said_so(states, tmp_path) -> None:
    """vLLM 0.32's V2 model runner (CUDA's default) reads no eagle_config ids: the server captured the
    default [2, 4, 5] where the draft config says [1, 4, 6] (its contract states both)."""
    default = ["target.layer.1", "target.layer.3", "target.layer.4"]
    record(tmp_path / "serve.h5", states, "serving", default,
           **{**vllm(slots=default), "aux_hidden_state_layers": [2, 4, 5]})
    record(tmp_path / "train.h5", states, "training", PLUS_ONE, **specforge())
    message = diagnoses(tmp_path / "train.h5", tmp_path / "serve.h5")["aux_layer_set"]["message"]
    assert message == (
        "aux layer set differs: serving: vLLM 0.32 feeds ids [2, 4, 5] as given (its "
        "aux_hidden_state_layers, not the draft config's ids [1, 4, 6]: vLLM's V2 model runner reads no "
        "eagle_config ids): [layer 1, layer 3, layer 4]; training (SpecForge 0.2.0, through SGLang: ids + 1) "
        "fed [layer 1, layer 4, layer 6]")
