"""doctor: one seeded fault per test, each named by its stable code; nothing on a healthy draft."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.conftest import cli  # noqa: E402
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
    assert codes(*healthy) == ["aux_ids_missing"]
    (finding,) = doctor(*healthy)
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
])
def test_unusable_target_configs_are_one_error(healthy, target, problem) -> None:
    (healthy[1] / "config.json").write_text(json.dumps(target))
    with pytest.raises(CheckpointError, match=problem):
        doctor(*healthy)


@pytest.mark.parametrize("args, problem", [
    ("--speculative-num-steps 'x", "cannot split into words: No closing quotation"),
    ("--speculative-eagle-topk one", "--speculative-eagle-topk takes a whole number, not 'one'"),
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
