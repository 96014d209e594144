"""vLLM 0.32's reading of an EAGLE-3 draft config (readings.py ``READINGS["vllm"]``): what it computes
of each key next to SGLang 0.5.23 and SpecForge 0.2.0, and that tracediff's draft under that reading
is vLLM's own: vLLM's real engine (``Eagle3LlamaForCausalLM`` in an offline ``LLM``, run by
tests/programs/vllm_draft_numerics.py) drafts on the same weights, and every tensor of its first
propose is reproduced."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REPO, cli
from tests.vllm_programs import run_program
from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.readings import (
    DRAFT,
    READINGS,
    SGLANG,
    SPECFORGE,
    TARGET,
    VLLM,
    differences,
    engine_choice,
)

SAMPLES = REPO / "traces" / "eagle3"
BASE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
        "vocab_size": 512, "draft_vocab_size": 384}


def config(**keys) -> DraftConfig:
    return DraftConfig.from_dict({**BASE, **keys})


def test_the_vllm_reading_is_named_and_chosen_for_a_vllm_trace() -> None:
    reading = READINGS[VLLM]
    assert reading.label == "vLLM 0.32"
    assert engine_choice("vllm").reading is reading
    assert engine_choice("sglang", "vllm") == (reading, "--engine")


def test_a_plain_config_is_one_computation_in_every_engine() -> None:
    plain = config()
    assert len({READINGS[e].numerics(plain).forward for e in (SGLANG, SPECFORGE, VLLM)}) == 1
    assert differences(plain, VLLM, SGLANG) == differences(plain, VLLM, SPECFORGE) == []


def test_norm_output_reads_as_in_sglang() -> None:
    """Absent: false; true hands the normed state to the next depth; logits always from the norm."""
    vllm = READINGS[VLLM].numerics(config(norm_output=True))
    assert (vllm.next_hidden_normed, vllm.logits_normed) == (True, True)
    assert vllm.forward == READINGS[SGLANG].numerics(config(norm_output=True)).forward
    off = READINGS[VLLM].numerics(config(norm_output=False))
    assert (off.next_hidden_normed, off.logits_normed) == (False, True)  # SpecForge: logits un-normed


def test_norm_before_residual_is_read_by_vllm_alone() -> None:
    keyed = config(norm_before_residual=True)
    assert READINGS[VLLM].numerics(keyed).norm_before_residual is True
    assert not READINGS[SGLANG].numerics(keyed).norm_before_residual
    assert not READINGS[SPECFORGE].numerics(keyed).norm_before_residual
    (found,) = differences(keyed, SGLANG, VLLM)
    assert found.key == "norm_before_residual" and found.text == (
        "norm_before_residual true: SGLang 0.5.23 adds the attention output to the un-normed hidden state; "
        "vLLM 0.32 adds the attention output to the normed hidden state (hidden_norm)")


def test_weights_come_from_the_checkpoint_where_it_has_them() -> None:
    """vLLM embeds with the checkpoint's embed_tokens (the target's only without one), takes the
    checkpoint's lm_head even without draft_vocab_size, and reads no tie_word_embeddings; SGLang takes
    the target's embedding, its whole lm_head without a draft vocab, and ties under the key."""
    untied = config(tie_word_embeddings=True)
    vllm, sglang = READINGS[VLLM].numerics(untied), READINGS[SGLANG].numerics(untied)
    assert (vllm.embedding, vllm.lm_head) == (DRAFT, DRAFT)
    assert sglang.embedding == TARGET and sglang.lm_head != DRAFT
    full = DraftConfig.from_dict({k: v for k, v in BASE.items() if k != "draft_vocab_size"})
    assert READINGS[VLLM].numerics(full).lm_head == DRAFT
    assert READINGS[SGLANG].numerics(full).lm_head == TARGET
    keys = {d.key for d in differences(untied, SGLANG, VLLM, checkpoint_has_embedding=True)}
    assert keys == {"embed_tokens.weight", "tie_word_embeddings"}


def test_fc_norms_are_read_from_their_own_keys() -> None:
    """norm_before_fc (eagle_config first) and fc_norm are applied; SGLang's use_aux_norm is not read."""
    assert READINGS[VLLM].numerics(config(eagle_config={"norm_before_fc": True})).norm_before_fc
    assert READINGS[VLLM].numerics(config(fc_norm=True)).fc_norm
    aux_norm = config(use_aux_norm=True)
    assert not READINGS[VLLM].numerics(aux_norm).fc_norm and READINGS[SGLANG].numerics(aux_norm).fc_norm


# -- vLLM's own draft on the same weights ---------------------------------------------------------------

PROMPT = [5, 9, 1, 4, 7, 3]
STEPS = 3
KEYS = {"norm_output": True, "norm_before_residual": True, "fc_norm": True, "norm_before_fc": True,
        "rope_theta": 500000.0}


def build(folder, torch, transformers):
    """A tiny random Llama target (heads of 32: vLLM's CPU attention takes no smaller) and two drafts
    on it, as SpecForge exports them: ``plain`` (no embeddings: the target's) and ``keys`` (every key
    the engines read differently, its own embeddings, norms not of unit weight)."""
    from tracediff.eagle3.checkpoint import save_draft
    from tracediff.eagle3.draft import Eagle3Draft
    from tracediff.eagle3.vocab import build_vocab_map

    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)).eval()
    target.save_pretrained(folder / "target")
    for seed, (name, keys) in enumerate((("plain", {}), ("keys", KEYS)), start=1):
        torch.manual_seed(seed)
        ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
        draft_config = DraftConfig.from_dict({**BASE, "max_position_embeddings": 128, **keys, **ids})
        model = Eagle3Draft(draft_config, embed_tokens=target.model.embed_tokens.weight.detach())
        with torch.no_grad():
            for key, weight in model.named_parameters():
                if "norm" in key:
                    weight.copy_(1 + 0.3 * torch.randn_like(weight))
                elif key == "embed_tokens.weight" and keys:
                    weight.copy_(torch.randn_like(weight))
        d2t, t2d = build_vocab_map(np.random.default_rng(seed).integers(0, 1000, 512), 384)
        model.d2t.copy_(torch.from_numpy(d2t))
        model.t2d.copy_(torch.from_numpy(t2d))
        save_draft(model, folder / name, with_embeddings=bool(keys))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """What vLLM's engine computed in its first propose, per draft (the program's safetensors)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("vllm_draft")
    build(folder, torch, transformers)
    drafts = ("--draft", f"plain={folder / 'plain'}", "--draft", f"keys={folder / 'keys'}")
    run_program("vllm_draft_numerics.py", "--target", str(folder / "target"), *drafts, "--prompt",
                json.dumps(PROMPT), "--steps", str(STEPS), "--out", str(folder / "out"),
                scratch=folder / "scratch")
    return folder, {name: load_file(folder / "out" / f"{name}.safetensors") for name in ("plain", "keys")}


def replayed(folder, name: str, got: dict, engine: str) -> dict:
    """tracediff's draft under ``engine``'s reading, fed what vLLM was fed: the aux, the first pass's
    (shifted) tokens and positions, then each step's token; its own hidden states carried over."""
    import torch

    from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor
    from tracediff.eagle3.draft import DraftKV

    draft = load_draft(folder / name, target_embedding(folder / "target"), reading=READINGS[engine],
                       target_head=target_tensor(folder / "target", "lm_head"))
    out = {}
    with torch.no_grad():
        hidden = out["fc_out"] = draft.project(got["fc_in"][None])[0]
        cache, positions = DraftKV(), got["positions.0"][None]
        for depth in range(int(got["forwards"])):
            rows = got["input_ids.0"][None] if depth == 0 else got[f"input_ids.{depth}"][None]
            at = positions if depth == 0 else positions[:, -1:]
            step = draft.step(rows, hidden[None], at, cache, depth)
            out[f"next.{depth}"] = step.hidden[0]
            hidden = step.hidden[0, -1:]  # the proposer carries the sampled (last) row on
            logits = step.logits[0, -1]
            out[f"logits.{depth}"] = logits
            out[f"targets.{depth}"] = torch.arange(len(logits)) + draft.d2t
            out[f"token.{depth}"] = draft.to_target(logits.argmax())
    return out


def gap(ours: dict, got: dict) -> float:
    """The largest difference between ours and vLLM's over every tensor of the first propose."""
    worst = float((ours["fc_out"] - got["fc_out"]).abs().max())
    for depth in range(int(got["forwards"])):
        theirs = got[f"logits.{depth}"][0, ours[f"targets.{depth}"]]  # at the draft vocab's target ids
        worst = max(worst, float((ours[f"next.{depth}"] - got[f"next.{depth}"]).abs().max()),
                    float((ours[f"logits.{depth}"] - theirs).abs().max()))
    return worst


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["plain", "keys"])
def test_vllms_own_draft_computes_what_replay_computes_under_its_reading(served, name) -> None:
    """fc (with the config's fc norms), every depth's next hidden state and logits: vLLM's engine and
    tracediff's draft under vLLM's reading agree to float32 rounding, and draft the same tokens.
    vLLM's steps run at the first pass's last position + depth, as replay rotates them."""
    folder, runs = served
    got = runs[name]
    ours = replayed(folder, name, got, VLLM)
    assert int(got["forwards"]) == STEPS and gap(ours, got) < 1e-4
    last = int(got["positions.0"][-1])
    for depth in range(1, STEPS):
        assert int(got[f"positions.{depth}"][0]) == last + depth
        assert int(got[f"input_ids.{depth}"][0]) == int(got["draft_ids"][0, depth - 1])
    assert [int(ours[f"token.{d}"]) for d in range(STEPS)] == got["draft_ids"][0].tolist()
    for depth in range(STEPS):  # vLLM's logits over the target vocab: -inf off the draft vocab
        assert int(got[f"logits.{depth}"].isinf().sum()) == 512 - 384


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_keys_only_vllm_reads_so_make_another_draft_of_the_other_readings(served) -> None:
    """The plain draft is one computation in every engine; the one with every key the engines read
    differently is reproduced by vLLM's reading only (SGLang: no norm_before_residual, the target's
    embedding; SpecForge: neither, nor norm_before_fc, nor the normed next hidden state)."""
    folder, runs = served
    for engine in (SGLANG, SPECFORGE):
        assert gap(replayed(folder, "plain", runs["plain"], engine), runs["plain"]) < 1e-4
        assert gap(replayed(folder, "keys", runs["keys"], engine), runs["keys"]) > 0.05, engine
    assert int(runs["plain"]["embed_is_target"]) == 1  # no embed_tokens: vLLM shares the target's
    assert int(runs["keys"]["embed_is_target"]) == 0  # its own: kept
    from safetensors.torch import load_file

    own = load_file(folder / "keys" / "model.safetensors")["embed_tokens.weight"]
    assert bool((runs["keys"]["embed"] == own).all())


@pytest.mark.slow
def test_replay_computes_the_draft_as_vllm_does_when_asked(tmp_path) -> None:
    """``tracediff replay --engine vllm``: the sample draft (no key the engines read differently)
    replays as under SGLang's reading; with norm_before_residual true (what a speculators-format config
    defaults to) vLLM's figure moves and SGLang's does not."""
    def replay(draft, engine: str) -> dict:
        done = cli("replay", str(SAMPLES / "training.h5"), "--draft", str(draft), "--target",
                   str(SAMPLES / "target"), "--engine", engine, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    vllm, sglang = replay(SAMPLES / "draft", "vllm"), replay(SAMPLES / "draft", "sglang")
    assert (vllm["engine"], vllm["engine_from"]) == ("vLLM 0.32", "--engine")
    assert vllm["depth_accuracy"] == sglang["depth_accuracy"]
    keyed = tmp_path / "draft"
    keyed.mkdir()
    raw = json.loads((SAMPLES / "draft" / "config.json").read_text())
    (keyed / "config.json").write_text(json.dumps({**raw, "norm_before_residual": True}))
    (keyed / "model.safetensors").write_bytes((SAMPLES / "draft" / "model.safetensors").read_bytes())
    assert replay(keyed, "sglang")["depth_accuracy"] == sglang["depth_accuracy"]
    assert replay(keyed, "vllm")["depth_accuracy"] != vllm["depth_accuracy"]


def test_compare_names_norm_before_residual_between_a_vllm_and_a_specforge_draft(tmp_path) -> None:
    """A vLLM serving trace (its contract states norm_before_residual beside the draft config, as the
    vLLM producer writes it) against a SpecForge training trace: equal fc inputs, other draft hidden
    states: the engine_reading diagnosis names the key only vLLM reads."""
    import tracediff as td
    from tracediff.eagle3.draft_summary import draft_config_summary

    rng = np.random.default_rng(0)
    tokens = [3, 17, 250, 9, 88, 41]
    fc_in = rng.standard_normal((6, 384)).astype(np.float32)
    summary = draft_config_summary(config().to_dict())
    for name, engine, hidden, extra in (
            ("train.h5", "specforge", rng.standard_normal((6, 128)), {"producer_integration": "specforge"}),
            ("serve.h5", "vllm", rng.standard_normal((6, 128)), {"vllm_version": "0.32.0",
                                                                 "norm_before_residual": True})):
        with td.record(tmp_path / name, source="training" if engine == "specforge" else "serving") as rec:
            rec.log("draft.fc_in", fc_in, token_ids=tokens, request="x", depth=0)
            rec.log("draft.hidden", hidden.astype(np.float32), token_ids=tokens, request="x", depth=0)
            rec.update_contract(draft_engine=engine, draft_config=summary, **extra)
    report = td.compare(tmp_path / "train.h5", tmp_path / "serve.h5")
    assert report.first_divergence.name == "draft.hidden"
    (found,) = [d for d in report.diagnoses if d.kind == "engine_reading"]
    assert "norm_before_residual" in found.evidence.keys  # (a summary's norm_output null reads as false too)
    assert any(text.startswith("norm_before_residual true: SpecForge 0.2.0 adds the attention output to the "
                               "un-normed hidden state; vLLM 0.32 adds") for text in found.evidence.readings)
    assert (found.evidence.engine_a, found.evidence.engine_b) == ("SpecForge 0.2.0", "vLLM 0.32")
