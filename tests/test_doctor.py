"""doctor: one seeded fault per test, each named by its stable code; nothing on a healthy draft."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.conftest import run_cli  # noqa: E402
from tests.test_eagle3_draft import random_draft, tiny_config  # noqa: E402
from tracediff.eagle3.checkpoint import save_draft  # noqa: E402
from tracediff.eagle3.doctor import doctor  # noqa: E402

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
    out = run_cli("doctor", "--draft", str(healthy[0]), "--target", str(healthy[1]))
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


def test_eagle3_head_in_eagle_mode(healthy) -> None:
    assert codes(*healthy, server_args="--speculative-algorithm EAGLE") == ["algorithm"]


def test_cli_exit_codes(healthy, tmp_path) -> None:
    edit_weights(healthy[0], d2t=torch.zeros(256, dtype=torch.int64))
    out = run_cli("doctor", "--draft", str(healthy[0]), "--json")
    assert out.returncode == 1 and "d2t_zero" in {f["code"] for f in json.loads(out.stdout)}
    missing = run_cli("doctor", "--draft", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'nope'}: no config.json"
