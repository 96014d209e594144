"""doctor: one seeded fault per test, each named by its stable code; nothing on a healthy draft."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.conftest import REPO, cli  # noqa: E402
from tests.test_eagle3_draft import random_draft, tiny_config  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, save_draft  # noqa: E402
from tracediff.eagle3.doctor import doctor  # noqa: E402
from tracediff.errors import CheckpointError, InputError  # noqa: E402
from tracediff.report.doctor import render_findings  # noqa: E402

TARGET = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512}


@pytest.fixture
def healthy(tmp_path):
    draft, target = tmp_path / "draft", tmp_path / "target"
    save_draft(random_draft(tiny_config()), draft)
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    return draft, target


def edit_config(draft, **changes) -> None:
    config = json.loads((draft / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (draft / "config.json").write_text(json.dumps(config))


def edit_weights(draft, **changes) -> None:
    weights = load_file(draft / "model.safetensors")
    for key, value in changes.items():
        if value is None:
            weights.pop(key)
        else:
            weights[key] = value
    save_file(weights, draft / "model.safetensors")


def codes(draft, target, server_args=None) -> list[str]:
    return [f.code for f in doctor(draft, target, server_args) if f.severity != "info"]


def test_healthy_checkpoint_has_no_problems(healthy) -> None:
    assert codes(*healthy) == []
    out = cli("doctor", "--draft", str(healthy[0]), "--target", str(healthy[1]))
    assert out.returncode == 0 and "no problems found" in out.stdout


def test_d2t_missing(healthy) -> None:
    edit_weights(healthy[0], d2t=None)
    assert "d2t_missing" in codes(*healthy)


def test_d2t_all_zero(healthy) -> None:
    edit_weights(healthy[0], d2t=torch.zeros(256, dtype=torch.int64))
    assert "d2t_zero" in codes(*healthy)


def test_d2t_arange(healthy) -> None:
    edit_weights(healthy[0], d2t=torch.arange(256))
    assert "d2t_arange" in codes(*healthy)


def test_t2d_inconsistent(healthy) -> None:
    t2d = load_file(healthy[0] / "model.safetensors")["t2d"]
    edit_weights(healthy[0], t2d=torch.roll(t2d, 1))
    assert "t2d_inconsistent" in codes(*healthy)


def test_draft_vocab_size_missing(healthy) -> None:
    edit_config(healthy[0], draft_vocab_size=None)
    assert "draft_vocab_size_missing" in codes(*healthy)


def test_fc_width_against_aux_count(healthy) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2, 3]})
    assert "fc_width" in codes(*healthy)


def test_target_hidden_mismatch(healthy) -> None:
    (healthy[1] / "config.json").write_text(json.dumps({**TARGET, "hidden_size": 128}))
    assert "target_hidden" in codes(*healthy)


def test_aux_ids_out_of_range(healthy) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]})
    assert "aux_out_of_range" in codes(*healthy)


def test_aux_ids_not_ascending(healthy) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 0, 1]})
    assert codes(*healthy) == ["aux_order"]


def test_aux_ids_missing(healthy) -> None:
    edit_config(healthy[0], eagle_config=None)
    # on 4 layers both defaults name one state twice: SGLang [2, 2, 1], SpecForge [1, 1, 0] (refused)
    assert codes(*healthy) == ["aux_duplicate", "aux_ids_missing", "aux_specforge_refuses"]
    (finding,) = [f for f in doctor(*healthy) if f.code == "aux_ids_missing"]
    assert "outputs of layers [1, 1, 0]" in finding.message and "inputs of [2, 2, 1]" in finding.message


def test_norm_before_fc_without_weights(healthy) -> None:
    edit_config(healthy[0], norm_before_fc=True)
    assert "norm_before_fc_weights_missing" in codes(*healthy)


def test_fc_norm_weights_ignored(healthy) -> None:
    edit_weights(healthy[0], **{f"fc_norm.{i}.weight": torch.ones(64) for i in range(3)})
    assert "fc_norm_ignored" in codes(*healthy)


def test_topk_one_clamps_num_draft_tokens(healthy) -> None:
    args = "--speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1 " \
           "--speculative-num-draft-tokens 16"
    assert codes(*healthy, server_args=args) == ["num_draft_tokens_clamped"]
    assert codes(*healthy, server_args=args.replace("16", "2")) == []
    # counted as compare's draft_depths counts them: the tokens drafted, not those verified
    (clamp,) = [f for f in doctor(*healthy, args) if f.code == "num_draft_tokens_clamped"]
    assert "drafts 1 token per verify (and verifies 2 with the last accepted one), not 15" in clamp.message


def test_eagle3_head_in_eagle_mode(healthy) -> None:
    assert codes(*healthy, server_args="--speculative-algorithm EAGLE") == ["algorithm"]


def test_cli_exit_codes(healthy, tmp_path) -> None:
    edit_weights(healthy[0], d2t=torch.zeros(256, dtype=torch.int64))
    out = cli("doctor", "--draft", str(healthy[0]), "--json")
    assert out.returncode == 1 and "d2t_zero" in {f["code"] for f in json.loads(out.stdout)}
    missing = cli("doctor", "--draft", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'nope'}: no config.json"


def test_fc_weight_missing(healthy) -> None:
    edit_weights(healthy[0], **{"fc.weight": None})
    assert codes(*healthy) == ["fc_missing"]
    out = cli("doctor", "--draft", str(healthy[0]))
    assert out.returncode == 1 and "fc_missing" in out.stdout and "no problems found" not in out.stdout


def test_zero_attention_heads_is_an_error_not_a_crash_later(healthy) -> None:
    edit_config(healthy[0], num_attention_heads=0)
    findings = [f for f in doctor(*healthy) if f.severity == "error"]
    assert [f.code for f in findings] == ["config_value"]
    assert findings[0].message == "config.json: num_attention_heads is 0: it must be positive"
    with pytest.raises(CheckpointError, match="num_attention_heads is 0"):  # replay: one error line
        load_draft(healthy[0])


@pytest.mark.parametrize("change, problem", [
    ({"hidden_size": 60}, "hidden_size 60 is not a multiple of num_attention_heads 8"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"draft_vocab_size": 1024}, "draft_vocab_size 1024 exceeds vocab_size 512"),
    ({"head_dim": 15}, "the head size 15 is odd"),
    ({"vocab_size": 10**30}, "vocab_size is 1000000000000000000000000000000: larger than any model's"),
])
def test_config_values_no_engine_can_build(healthy, change, problem) -> None:
    edit_config(healthy[0], **({"num_attention_heads": 8} if "hidden_size" in change else {}), **change)
    messages = [f.message for f in doctor(*healthy) if f.code == "config_value"]
    assert len(messages) == 1 and problem in messages[0]


def test_weights_missing_or_of_another_shape(healthy) -> None:
    edit_weights(healthy[0], **{"norm.weight": None, "midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)})
    findings = {f.code: f.message for f in doctor(*healthy) if f.severity == "error"}
    assert findings == {
        "weights_missing": "model.safetensors lacks norm.weight: engines run those weights uninitialised",
        "weight_shape": "midlayer.self_attn.q_proj.weight has shape [64, 64], config.json implies [64, 128]"}


def test_weights_of_the_wrong_rank_are_findings_not_tracebacks(healthy) -> None:
    edit_weights(healthy[0], **{"fc.weight": torch.zeros(192), "lm_head.weight": torch.zeros(()),
                                "d2t": torch.zeros(16, 16, dtype=torch.int64)})
    found = codes(*healthy)
    assert found.count("weight_shape") == 3 and "vocab_map_malformed" in found


@pytest.mark.parametrize("text, problem", [
    ("[1, 2]", "not an EAGLE-3 draft config: expected a JSON object, got a list"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "not an EAGLE-3 draft config: JSON nested too deeply"),
    ('{"a": ' * 40 + "1" + "}" * 40, "not an EAGLE-3 draft config: JSON nested over 32 levels deep"),
    ('{"hidden_size": "64"}', 'not an EAGLE-3 draft config: hidden_size must be an integer, not "64"'),
    (b"\xff\xfe{}", "not an EAGLE-3 draft config: 'utf-8' codec can't decode byte 0xff"),
])
def test_unreadable_configs_are_one_error(healthy, text, problem) -> None:
    path = healthy[0] / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError) as caught:
        doctor(*healthy)
    assert caught.value.path == str(path) and caught.value.problem.startswith(problem)


def test_a_config_with_the_wrong_field_types_gives_one_error_line(healthy) -> None:
    edit_config(healthy[0], eagle_config=[1, 2])
    out = cli("doctor", "--draft", str(healthy[0]))
    assert out.returncode == 2 and out.stdout == "" and out.stderr == (
        f"error: {healthy[0] / 'config.json'}: not an EAGLE-3 draft config: eagle_config must be a JSON "
        "object, not a list\n")


@pytest.mark.parametrize("target, problem", [
    ([4], "not a model config: expected a JSON object, got a list"),
    ({"hidden_size": 64}, "num_hidden_layers must be a positive integer, not null"),
    ({**TARGET, "hidden_size": "64"}, 'hidden_size must be a positive integer, not "64"'),
    ({**TARGET, "vocab_size": "512"}, 'vocab_size must be a positive integer, not "512"'),
])
def test_unusable_target_configs_are_one_error(healthy, target, problem) -> None:
    (healthy[1] / "config.json").write_text(json.dumps(target))
    with pytest.raises(CheckpointError, match=problem):
        doctor(*healthy)


@pytest.mark.parametrize("args, problem", [
    ("--speculative-num-steps 'x", "cannot split into words: No closing quotation"),
    ("--speculative-eagle-topk one", "--speculative-eagle-topk takes a whole number, not 'one'"),
    ("--speculative-num-steps", "--speculative-num-steps has no value: it takes a whole number"),
    ("--speculative-num-steps --speculative-eagle-topk 1",
     "--speculative-num-steps has no value: it takes a whole number"),
    ("--speculative-num-draft-tokens= --speculative-num-steps 3",
     "--speculative-num-draft-tokens has no value: it takes a whole number"),
    ("--speculative-eagle-topk 1 --speculative-algorithm",
     "--speculative-algorithm has no value: it takes an algorithm name"),
])
def test_bad_server_args_are_one_error(healthy, args, problem) -> None:
    with pytest.raises(InputError) as caught:
        doctor(*healthy, server_args=args)
    assert caught.value.path == "--server-args" and caught.value.problem == problem


def test_checkpoint_text_is_printed_as_data(healthy) -> None:
    """Findings quote --server-args and config values: rich markup in them is printed literally,
    terminal escapes escaped."""
    findings = doctor(*healthy, server_args="--speculative-algorithm '[/]x\x1b[2J[bold]'")
    console = Console(file=io.StringIO(), width=400, color_system=None)
    render_findings(console, findings)
    shown = console.file.getvalue()
    assert "--speculative-algorithm [/]x\\x1b[2J[bold] runs an EAGLE-3 head" in shown and "\x1b" not in shown


# -- the target's family: which states the ids select in SGLang and in SpecForge --------------------


def family_target(path, architecture: str, layers: int):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TARGET, "architectures": [architecture],
                                                  "num_hidden_layers": layers}))
    return path


def found(draft, target) -> dict[str, str]:
    return {f.code: f.message for f in doctor(draft, target)}


def test_the_sample_draft_on_its_6_layer_target_names_sglang_s_crash() -> None:
    """traces/eagle3: ids [1, 3, 5] on a 6-layer Llama. layers_to_capture [2, 4, 6]: the loop never
    reaches 6, the aux has 2 slots, and the draft's fc raises (measured with SGLang's real code on
    CPU: 'mat1 and mat2 shapes cannot be multiplied (5x128 and 192x64)' for a 5-token prompt)."""
    out = cli("doctor", "--draft", str(REPO / "traces/eagle3/draft"), "--target",
              str(REPO / "traces/eagle3/target"), "--json")
    assert out.returncode == 1
    (problem,) = [f for f in json.loads(out.stdout) if f["code"] == "aux_out_of_range"]
    assert problem["message"] == (
        "id 5 selects the input of layer 6, which this 6-layer llama target never captures in SGLang "
        "0.5.23 (and SpecForge 0.2.0, through it; layers_to_capture [2, 4, 6]): 2 of the 3 slots the "
        "draft's fc takes; the draft's fc raises "
        "'RuntimeError: mat1 and mat2 shapes cannot be multiplied (Tx128 and 192x64)' at the first prefill "
        "(llama_eagle3.py, LlamaModel.forward)")
    text = cli("doctor", "--draft", str(REPO / "traces/eagle3/draft"), "--target",
               str(REPO / "traces/eagle3/target"))
    assert "aux_out_of_range" in text.stdout and "SGLang (llama: ids + 1)" in text.stdout


def test_default_ids_on_6_layers_select_one_state_twice(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config=None)
    said = found(healthy[0], family_target(tmp_path / "t6", "LlamaForCausalLM", 6))
    assert said["aux_duplicate"].startswith(
        "layers_to_capture [2, 3, 3] (SGLang's default [2, L//2, L-3] on 6 layers) names the input of "
        "layer 3 twice; SGLang captures it once: 2 of the 3 slots the draft's fc takes")
    assert "refuses no ids (the default): resolved offline capture layers must be distinct" in \
        said["aux_specforge_refuses"]


def test_deepseek_ids_select_other_states_than_hf_readers_think(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 3, 4]})
    said = found(healthy[0], family_target(tmp_path / "ds", "DeepseekV3ForCausalLM", 8))
    assert said["aux_meaning"].startswith(
        "ids [2, 3, 4] on this 8-layer DeepseekV3ForCausalLM: SGLang (deepseek_v2: +1 only when the first "
        "id is 1) sets layers_to_capture [2, 3, 4] and feeds [layer 1, layer 2, layer 3]; SpecForge 0.2.0 "
        "trains on [layer 1, layer 2, layer 3]; trainers reading HF hidden_states[i+1] feed [layer 2, "
        "layer 3, layer 4]")
    assert codes(healthy[0], tmp_path / "ds") == ["aux_hf_reading_differs"]  # SpecForge 0.2.0 agrees, HF not


def test_deepseek_short_aux_raises_in_the_target_forward(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    said = found(healthy[0], family_target(tmp_path / "ds6", "DeepseekV3ForCausalLM", 6))
    assert said["aux_out_of_range"].endswith(
        "the target's forward raises 'RuntimeError: captured 2 of 3 aux hidden states' at the first prefill")


def test_gpt_oss_id_equal_to_the_layer_count_is_the_last_pre_norm_state(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]})
    target = family_target(tmp_path / "oss", "GptOssForCausalLM", 8)
    assert "feeds [layer 0, layer 2, layer 7]" in found(healthy[0], target)["aux_meaning"]
    assert "aux_out_of_range" not in codes(healthy[0], target)  # SpecForge refuses 8 (a warning)


def test_flag_family_last_layer_id_stops_the_server(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]})
    said = found(healthy[0], family_target(tmp_path / "next", "Qwen3NextForCausalLM", 8))
    assert said["aux_out_of_range"] == (
        "ids [1, 3, 7]: Qwen3NextForCausalLM.set_eagle3_layers_to_capture raises IndexError: list index out "
        "of range for layers_to_capture [2, 4, 8] on 8 layers: the server does not start")


def test_sglang_and_specforge_selecting_different_states(healthy, tmp_path) -> None:
    """MiniMax-M3 VL adds +1 to SGLang's default too; SpecForge's default goes through the same +1."""
    edit_config(healthy[0], eagle_config=None)
    said = found(healthy[0], family_target(tmp_path / "m3", "MiniMaxM3SparseForConditionalGeneration", 8))
    assert said["aux_engines_differ"] == (
        "for no ids (the default) SGLang feeds [layer 2, layer 4, layer 5], SpecForge 0.2.0 trained on "
        "[layer 1, layer 3, layer 4]: the draft is served other states than it learned")


def test_an_unknown_architecture_keeps_the_generic_reading(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]})
    said = found(healthy[0], family_target(tmp_path / "x", "SomethingElseForCausalLM", 4))
    assert said["aux_out_of_range"] == "aux ids [4] are outside the target's 4 layers"


def test_gemma3_feeds_branch_outputs(healthy, tmp_path) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    said = found(healthy[0], family_target(tmp_path / "g3", "Gemma3ForCausalLM", 8))
    assert said["aux_branch"].startswith(
        "gemma3_causal feeds the draft layer 1 branch, layer 2 branch, layer 3 branch: each layer's branch "
        "output, not the residual stream")


def test_a_vl_target_is_read_through_its_text_config(healthy, tmp_path) -> None:
    """Kimi-K2.5 (the founding story's model) nests its text model's sizes in text_config; its
    wrapper hands the ids to DeepSeek-V3's setter."""
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 3, 4]})
    (tmp_path / "kimi").mkdir()
    text = {**TARGET, "num_hidden_layers": 8}
    (tmp_path / "kimi" / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}))
    said = found(healthy[0], tmp_path / "kimi")
    assert said["aux_meaning"].startswith("ids [2, 3, 4] on this 8-layer KimiK25ForConditionalGeneration: "
                                          "SGLang (kimi_k25: +1 only when the first id is 1)")


@pytest.mark.parametrize("ids, sglang, hf", [
    ([0, 2, 4], "[embed, layer 1, layer 3]", "[layer 0, layer 2, layer 4]"),
    ([2, 3, 4], "[layer 1, layer 2, layer 3]", "[layer 2, layer 3, layer 4]"),
])
def test_deepseek_ids_hf_readers_read_otherwise_are_a_warning(healthy, tmp_path, ids, sglang, hf) -> None:
    """The founding story: DeepSeek-V3 keeps ids not starting at 1 as given (inputs of those layers),
    a trainer reading HF hidden_states[i+1] took the outputs: one layer later each."""
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    target = family_target(tmp_path / "ds", "DeepseekV3ForCausalLM", 8)
    assert codes(healthy[0], target) == ["aux_hf_reading_differs"]
    message = found(healthy[0], target)["aux_hf_reading_differs"]
    assert f"layers_to_capture {ids}, the states {sglang}" in message
    assert f"trainers reading HF hidden_states[i+1] (older SpecForge, hand-written loops) fed {hf}" in message
    assert "deepseek_v2: +1 only when the first id is 1" in message
    out = cli("doctor", "--draft", str(healthy[0]), "--target", str(target))
    assert out.returncode == 0 and "1 warning found" in out.stdout and "no problems found" not in out.stdout


@pytest.mark.parametrize("architecture, ids", [
    ("DeepseekV3ForCausalLM", [1, 2, 3]),  # the first id is 1: +1, as HF reads it
    ("LlamaForCausalLM", [0, 2, 4]),
    ("Qwen3ForCausalLM", [2, 3, 4]),
])
def test_no_hf_reading_warning_where_the_readings_agree(healthy, tmp_path, architecture, ids) -> None:
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    assert codes(healthy[0], family_target(tmp_path / "t", architecture, 8)) == []


def test_empty_aux_ids_are_their_own_error(healthy, tmp_path) -> None:
    """[] is not the default in SGLang 0.5.23: it reaches the setter as [] (measured with SGLang's
    real Qwen3 code on CPU: the forward raises 'ValueError: too many values to unpack (expected 2)')."""
    edit_config(healthy[0], eagle_config={"eagle_aux_hidden_state_layer_ids": []})
    for target in (healthy[1], family_target(tmp_path / "ds", "DeepseekV3ForCausalLM", 8), None):
        (finding,) = [f for f in doctor(healthy[0], target) if f.severity != "info"]
        assert finding.code == "aux_ids_empty" and finding.severity == "error"
        assert "passes it to set_eagle3_layers_to_capture as given, not as the default" in finding.message
        assert "layers_to_capture []" in finding.message
        assert "'ValueError: too many values to unpack'" in finding.message


def test_a_draft_for_another_vocab_is_an_error(healthy) -> None:
    """The tiny draft's vocab is 512 (its d2t maps into [0, 512)); a target of 256 tokens lacks half."""
    (healthy[1] / "config.json").write_text(json.dumps({**TARGET, "vocab_size": 256}))
    said = {f.code: f.message for f in doctor(*healthy) if f.severity == "error"}
    assert set(said) == {"vocab_size_mismatch", "d2t_beyond_target"}
    assert said["vocab_size_mismatch"].startswith("the draft's vocab_size is 512, the target's 256")
    d2t = load_file(healthy[0] / "model.safetensors")["d2t"]
    high = int((torch.arange(len(d2t)) + d2t).max())
    assert f"target ids {int(d2t[0])}..{high}, outside the target's vocab [0, 256)" in \
        said["d2t_beyond_target"]
    (healthy[1] / "config.json").write_text(json.dumps({**TARGET, "vocab_size": 1024}))
    assert codes(*healthy) == ["vocab_size_mismatch"]  # a larger target: d2t stays inside it


def test_a_vl_target_s_vocab_is_read_from_its_text_config(healthy, tmp_path) -> None:
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {**TARGET, "vocab_size": 1024}}))
    assert codes(healthy[0], tmp_path / "vl") == ["vocab_size_mismatch"]


@pytest.mark.parametrize("config, named", [
    ({**TARGET, "architectures": ["FooBarForCausalLM"]},
     "FooBarForCausalLM is not an EAGLE-3 target class of sglang 0.5.23"),
    ({k: v for k, v in TARGET.items() if k != "architectures"},
     "the target's config.json names no architecture"),
])
def test_an_unknown_architecture_says_its_reading_is_assumed(healthy, config, named) -> None:
    (healthy[1] / "config.json").write_text(json.dumps(config))
    assert codes(*healthy) == ["aux_family_unknown"]
    (finding,) = [f for f in doctor(*healthy) if f.code == "aux_family_unknown"]
    assert finding.severity == "warning" and finding.message.startswith(named)
    assert "assumed (SGLang's Llama-like families: ids + 1)" in finding.message
    out = cli("doctor", "--draft", str(healthy[0]), "--target", str(healthy[1]))
    assert out.returncode == 0 and "1 warning found" in out.stdout


def test_the_headline_counts_errors_and_warnings() -> None:
    from tracediff.eagle3.vocab import Finding

    def shown(*severities: str) -> str:
        console = Console(file=io.StringIO(), width=200, color_system=None)
        render_findings(console, [Finding(s, "c", "m", "f") for s in severities])
        return console.file.getvalue().splitlines()[0]

    assert shown() == shown("info") == "no problems found"
    assert shown("warning", "info") == "1 warning found"
    assert shown("error", "error", "warning", "warning") == "2 errors, 2 warnings found"


ABSENT = object()  # a key left out of config.json


@pytest.mark.parametrize(("changes", "said"), [
    ({"norm_output": True}, "norm_output true: SGLang 0.5.23 hands the normed hidden state to the next "
                            "draft depth"),
    ({"norm_output": False}, "norm_output false: SGLang 0.5.23 takes logits from the normed hidden state; "
                             "SpecForge 0.2.0 takes logits from the un-normed hidden state"),
    ({"use_aux_norm": True}, "use_aux_norm true: SGLang 0.5.23 normalises each aux chunk before fc"),
    ({"draft_vocab_size": ABSENT}, "draft_vocab_size absent: SGLang 0.5.23 uses the target's whole lm_head"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings true: SGLang 0.5.23 ties lm_head to the embedding"),
    ({"norm_output": None}, "norm_output null: SGLang 0.5.23 takes logits from the normed hidden state; "
                              "SpecForge 0.2.0 takes logits from the un-normed hidden state"),
])
def test_config_keys_the_engines_read_differently(healthy, changes, said) -> None:
    """One warning per key SGLang and SpecForge compute differently (tracediff/eagle3/readings.py);
    a null norm_output is false to both (SpecForge's getattr finds it: no default)."""
    raw = json.loads((healthy[0] / "config.json").read_text())
    raw.update(changes)
    (healthy[0] / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not ABSENT}))
    found = [f for f in doctor(*healthy) if f.code == "engine_reading" and f.severity == "warning"]
    assert len(found) == 1 and said in found[0].message, [f.message for f in found]


def test_no_engine_reading_warning_where_the_engines_agree(healthy) -> None:
    """Absent norm_output both hand on the pre-norm state and norm the logits; an own embedding is
    only an info (SGLang embeds with the target's: the same where training froze it)."""
    found = [f for f in doctor(*healthy) if f.code == "engine_reading"]
    assert [f.severity for f in found] == ["info"] and "embed_tokens.weight" in found[0].message


@pytest.mark.parametrize(("key", "value", "read_as"), [("norm_output", "false", "true"),
                                                      ("fc_norm", 0, "false"),
                                                      ("tie_word_embeddings", "yes", "true")])
def test_a_config_flag_that_is_not_a_boolean_says_how_the_engines_read_it(healthy, key, value,
                                                                          read_as) -> None:
    edit_config(healthy[0], **{key: value})
    (found,) = [f for f in doctor(*healthy) if f.code == "config_flag"]
    assert found.message == (f"config.json: {key} is {json.dumps(value)}, not true or false: the engines "
                             f"read it as {read_as}")


def test_the_library_call_returns_what_the_command_prints(healthy) -> None:
    """``td.doctor`` is the command: the same findings, errors first, and the same exit code."""
    import tracediff as td

    draft, target = healthy
    edit_weights(draft, d2t=torch.zeros(256, dtype=torch.int64))  # an error: a vocab map of zeros
    report = td.doctor(draft, target=target)
    assert report.exit_code == 1 and report.findings[0] == report.errors[0]
    assert [f.code for f in report.findings if f.severity != "info"] == codes(draft, target)
    printed = cli("doctor", "--draft", str(draft), "--target", str(target), "--json")
    assert printed.returncode == 1 and json.loads(printed.stdout) == report.to_list()
