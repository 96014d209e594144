"""Capture quirks named from the traces: a slot that holds a layer's branch output, an aux whose slot
count is not what the draft's fc takes (a boundary never captured, flags never cleared), a state
named twice; and an aux difference said with the serving family's id convention. Real traces: a tiny
HF Llama's own states, written with the Recorder, with the contract keys SGLang's recorder writes."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import REPO, tiny_llama  # noqa: E402
from tracediff.eagle3.capture import run_target  # noqa: E402

TOKENS = [3, 17, 250, 9, 88, 41, 7, 300, 12, 5, 99, 64]
DRAFT = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 512, "draft_vocab_size": 384}


@pytest.fixture(scope="module")
def states() -> dict[str, torch.Tensor]:
    """The residual stream of a 6-layer target, and each layer's branch (what it adds to the stream)."""
    got = run_target(tiny_llama(seed=4, layers=6), torch.tensor([TOKENS])).states
    out = {name: value[0] for name, value in got.items()}
    stream = ["target.embed", *(f"target.layer.{i}" for i in range(6))]
    out.update({f"{after}.branch": out[after] - out[before] for before, after in zip(stream, stream[1:])})
    return out


def record(path, states, source: str, slots: list[str], **contract) -> None:
    with td.record(path, source=source) as rec:
        for name, value in states.items():
            if not name.endswith(".branch"):
                rec.log(name, value, token_ids=TOKENS, request="x")
        rec.log("target.aux", torch.cat([states[s] for s in slots], -1), token_ids=TOKENS, request="x")
        rec.update_contract(**contract)


def serving(family: str, cls: str, ids, ltc, captured, slots, measured=None) -> dict:
    """The contract keys SGLang's recorder writes for a target of ``family``."""
    return dict(target_model_class=f"sglang.srt.models.{family}.{cls}", target_family=family,
                target_num_layers=6, aux_layer_ids=ids, layers_to_capture=ltc, aux_capture_layers=captured,
                aux_sources=slots, aux_slot_states=measured or slots, draft_config=DRAFT)


def diagnoses(a, b) -> dict[str, dict]:
    report = json.loads(td.compare(a, b).to_json())
    return {d["kind"]: d for d in report["diagnoses"]}


@pytest.fixture(scope="module")
def training(states, tmp_path_factory):
    """Training fed the outputs of layers 1, 3, 5 (HF hidden_states[i+1] for ids [1, 3, 5])."""
    path = tmp_path_factory.mktemp("train") / "training.h5"
    slots = ["target.layer.1", "target.layer.3", "target.layer.5"]
    record(path, states, "training", slots, aux_layer_ids=[1, 3, 5], aux_sources=slots)
    return path


def test_a_slot_holding_a_layers_branch_output(states, training, tmp_path) -> None:
    """Gemma 3 captures each layer's branch output: the slots equal no recorded stream state; what
    SGLang's recorder measured them to be names them."""
    slots = ["target.layer.1.branch", "target.layer.3.branch", "target.layer.5.branch"]
    record(tmp_path / "s.h5", states, "serving", slots,
           **serving("gemma3_causal", "Gemma3ForCausalLM", [1, 3, 5], [2, 4, 6], [2, 4, 6], slots))
    found = diagnoses(training, tmp_path / "s.h5")
    assert "aux_layer_set" not in found  # the branch is the difference, said once
    quirk = found["aux_branch"]
    assert quirk["message"] == (
        "serving's target.aux holds [layer 1 branch, layer 3 branch, layer 5 branch]: slots 0, 1, 2 a "
        "layer's branch output, not the residual stream (gemma3_causal captures each layer's branch output): "
        "a draft trained on hidden states is fed other inputs")
    assert quirk["evidence"]["side"] == "b" and quirk["evidence"]["slot_states"] == slots


def test_an_id_the_target_cannot_supply_leaves_the_aux_a_slot_short(states, training, tmp_path) -> None:
    """Llama, ids [1, 3, 5] on 6 layers: layers_to_capture [2, 4, 6], the loop never reaches 6. The
    aux cannot be compared (2 slots vs 3): the quirk says why."""
    slots = ["target.layer.1", "target.layer.3"]
    record(tmp_path / "s.h5", states, "serving", slots,
           **serving("llama", "LlamaForCausalLM", [1, 3, 5], [2, 4, 6], [2, 4], slots))
    report = json.loads(td.compare(training, tmp_path / "s.h5").to_json())
    assert {t["name"]: t["status"] for t in report["tensors"]}["target.aux"] == "shape_mismatch"
    (quirk,) = [d for d in report["diagnoses"] if d["kind"] == "aux_slot_count"]
    assert quirk["message"] == (
        "serving (llama: ids + 1) for ids [1, 3, 5]: target.aux holds 2 slots, the draft's fc takes 3 "
        "(layers_to_capture [2, 4, 6]: the input of layer 6 is never captured on 6 layers)")
    assert (quirk["evidence"]["slots"], quirk["evidence"]["slots_expected"]) == (2, 3)


def test_capture_flags_never_cleared_add_a_slot(states, training, tmp_path) -> None:
    """Qwen3-MoE after a second set_eagle3_layers_to_capture: layers_to_capture [2, 4, 6] says 3, the
    flags of the first call ([1, 2, 3] + 1) still capture: 5 slots."""
    slots = ["target.layer.1", "target.layer.2", "target.layer.3", "target.layer.4", "target.layer.5"]
    record(tmp_path / "s.h5", states, "serving", slots,
           **serving("qwen3_moe", "Qwen3MoeForCausalLM", [1, 3, 5], [2, 4, 6], [2, 3, 4, 5, 6], slots))
    quirk = diagnoses(training, tmp_path / "s.h5")["aux_slot_count"]
    assert quirk["message"].endswith(
        "target.aux holds 5 slots, the draft's fc takes 3 (it captures [2, 3, 4, 5, 6] where "
        "layers_to_capture says [2, 4, 6]: per-layer flags an earlier set_eagle3_layers_to_capture left set, "
        "never cleared)")


def test_default_ids_naming_one_state_twice(states, training, tmp_path) -> None:
    """No ids on 6 layers: SGLang's default [2, 3, 3] names the input of layer 3 twice, captured once."""
    slots = ["target.layer.1", "target.layer.2"]
    record(tmp_path / "s.h5", states, "serving", slots,
           **serving("llama", "LlamaForCausalLM", None, [2, 3, 3], [2, 3], slots))
    found = diagnoses(training, tmp_path / "s.h5")
    assert "aux_slot_count" not in found  # the duplicate is why the aux is short: one cause, said once
    assert found["aux_duplicate"]["message"] == (
        "serving (llama: ids + 1): layers_to_capture [2, 3, 3] (no ids: SGLang's default [2, L//2, L-3]) "
        "names the input of layer 3 twice; SGLang captures it once: target.aux holds 2 slots, the draft's fc "
        "takes 3")


def test_an_aux_difference_is_said_with_the_family_s_convention(states, tmp_path) -> None:
    """The founding story's class: ids [2, 3, 4] read as HF hidden_states[i+1] in training; served by
    DeepSeek-V3, which adds +1 only when the first id is 1: every slot one layer earlier."""
    trained = ["target.layer.2", "target.layer.3", "target.layer.4"]
    record(tmp_path / "t.h5", states, "training", trained, aux_layer_ids=[2, 3, 4], aux_sources=trained)
    served = ["target.layer.1", "target.layer.2", "target.layer.3"]
    record(tmp_path / "s.h5", states, "serving", served,
           **serving("deepseek_v2", "DeepseekV3ForCausalLM", [2, 3, 4], [2, 3, 4], [2, 3, 4], served))
    found = diagnoses(tmp_path / "t.h5", tmp_path / "s.h5")
    assert found["layer_offset"]["message"] == (
        "every target.aux slot is one layer apart: serving (deepseek_v2: +1 only when the first id is 1) fed "
        "[layer 1, layer 2, layer 3] for ids [2, 3, 4]; training fed [layer 2, layer 3, layer 4] "
        "(output-of-layer vs input-to-layer convention)")
    assert not {"aux_branch", "aux_slot_count", "aux_duplicate"} & set(found)


def test_a_matching_aux_names_no_quirk(states, training, tmp_path) -> None:
    """gpt-oss keeps ids whose largest is the layer count: [2, 4, 6] captures layers 1, 3, 5."""
    slots = ["target.layer.1", "target.layer.3", "target.layer.5"]
    record(tmp_path / "s.h5", states, "serving", slots,
           **serving("gpt_oss", "GptOssForCausalLM", [2, 4, 6], [2, 4, 6], [2, 4, 6], slots))
    assert not {"aux_branch", "aux_slot_count", "aux_duplicate"} & set(diagnoses(training, tmp_path / "s.h5"))


@pytest.mark.slow
def test_a_real_sglang_serving_trace_of_the_sample_draft(tmp_path) -> None:
    """SGLang's real Llama and EAGLE-3 classes on CPU serve the committed sample draft (ids [1, 3, 5])
    on its 6-layer target: the draft's fc raises at the first prefill, the trace keeps the 2-slot aux
    and SGLang's recorder's contract, and compare names why against the committed training trace."""
    from safetensors.torch import load_file

    from testbed.sglang_cpu import CpuServer, sglang_missing

    if sglang_missing():
        pytest.skip(sglang_missing())
    sample = REPO / "traces" / "eagle3"
    with td.record(tmp_path / "serving.h5", source="serving") as rec:
        server = CpuServer(str(sample / "target"), load_file(sample / "target" / "model.safetensors"),
                           str(sample / "draft"), load_file(sample / "draft" / "model.safetensors"),
                           num_steps=2, recorder=rec)
        crash = r"mat1 and mat2 shapes cannot be multiplied \(8x128 and 192x64\)"  # the draft's fc
        with pytest.raises(RuntimeError, match=crash):
            server.serve([[1, 2, 3, 4, 5, 6, 7, 8]], 2)
    found = diagnoses(sample / "training.h5", tmp_path / "serving.h5")
    assert found["aux_slot_count"]["message"] == (
        "serving (llama: ids + 1) for ids [1, 3, 5]: target.aux holds 2 slots, the draft's fc takes 3 "
        "(layers_to_capture [2, 4, 6]: the input of layer 6 is never captured on 6 layers)")


# -- on SGLang's real family code (testbed.sglang_families): the quirks as SGLang's recorder records them


def served_and_trained(tmp_path, family: str, calls: list, trained_ids: list[int]) -> tuple:
    """A real SGLang target of ``family`` recorded with ``install`` (ids handed to
    set_eagle3_layers_to_capture in order, the draft's config stated as a draft's contract states it),
    and a training trace of HF's own states on the same weights and tokens, fed ``trained_ids``
    as HF hidden_states[i+1]."""
    from testbed.sglang_cpu import sglang_missing

    if sglang_missing():
        pytest.skip(sglang_missing())
    from testbed.sglang_families import family_bed
    from tracediff.eagle3.draft_summary import draft_config_summary
    from tracediff.integrations.sglang import install

    bed = family_bed(family)
    model = bed.load()
    with td.record(tmp_path / "serving.h5", source="serving") as rec:
        installed = install(rec, target=model)
        for ids in calls:
            model.set_eagle3_layers_to_capture(ids)
        rec.update_contract(draft_config=draft_config_summary(DRAFT))
        served = bed.serve(model)
        installed.remove()
    ref = bed.reference(served.tokens)
    layers = [*ref.hidden_states[1:-1], ref.pre_norm]  # the outputs of layers 0 .. L-1, before the final norm
    with td.record(tmp_path / "training.h5", source="training") as rec:
        for name, value in [("target.embed", ref.hidden_states[0]),
                            *((f"target.layer.{i}", v) for i, v in enumerate(layers))]:
            rec.log(name, value, token_ids=served.tokens, request="req0")
        rec.log("target.aux", torch.cat([layers[i] for i in trained_ids], -1), token_ids=served.tokens,
                request="req0")
        rec.update_contract(aux_layer_ids=trained_ids, draft_config=draft_config_summary(DRAFT))
    return tmp_path / "training.h5", tmp_path / "serving.h5"


@pytest.mark.slow
def test_gemma3_serving_feeds_branch_outputs(tmp_path) -> None:
    training, serving_trace = served_and_trained(tmp_path, "gemma3_causal", [[1, 2, 3]], [1, 2, 3])
    found = diagnoses(training, serving_trace)
    assert found["aux_branch"]["message"].startswith(
        "serving's target.aux holds [layer 1 branch, layer 2 branch, layer 3 branch]: slots 0, 1, 2 a "
        "layer's branch output, not the residual stream (gemma3_causal captures")
    assert "aux_layer_set" not in found


@pytest.mark.slow
def test_qwen3_moe_second_capture_call_feeds_the_union(tmp_path) -> None:
    training, serving_trace = served_and_trained(tmp_path, "qwen3_moe", [[1, 2, 3], [2, 3, 4]], [2, 3, 4])
    assert diagnoses(training, serving_trace)["aux_slot_count"]["message"] == (
        "serving (qwen3_moe: ids + 1) for ids [2, 3, 4]: target.aux holds 4 slots, the draft's fc takes 3 "
        "(it captures [2, 3, 4, 5] where layers_to_capture says [3, 4, 5]: per-layer flags an earlier "
        "set_eagle3_layers_to_capture left set, never cleared)")


@pytest.mark.slow
def test_llama_default_ids_on_6_layers_capture_one_state_once(tmp_path) -> None:
    training, serving_trace = served_and_trained(tmp_path, "llama", [None], [1, 2, 3])
    found = diagnoses(training, serving_trace)
    assert found["aux_duplicate"]["message"] == (
        "serving (llama: ids + 1): layers_to_capture [2, 3, 3] (no ids: SGLang's default [2, L//2, L-3]) "
        "names the input of layer 3 twice; SGLang captures it once: target.aux holds 2 slots, the draft's fc "
        "takes 3")
