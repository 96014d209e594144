"""One compare per diagnosis kind, each on traces of real torch computations: a tiny Llama target
and the reference EAGLE-3 loop (training = the TTT pass, serving = the decoder), with one
convention or one numeric fault changed on one side. Each asserts the first diverging tensor, its
row key and the diagnosis kind."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions, SpeculativeDecoder  # noqa: E402
from testbed.train import greedy_sequences, record_ttt, ttt_pass  # noqa: E402
from tests.conftest import tiny_eagle3, tiny_llama  # noqa: E402
from tracediff.eagle3.capture import INPUT_TO_LAYER, AuxSpec, run_target  # noqa: E402
from tracediff.eagle3.vocab import build_vocab_map  # noqa: E402

SPEC = AuxSpec((0, 1, 2))  # training feeds [layer 0, layer 1, layer 2]
PROMPT = [5, 77, 300, 12, 9, 41]


@pytest.fixture(scope="module")
def models():
    return tiny_eagle3()


@pytest.fixture(scope="module")
def training(models, tmp_path_factory):
    """The baseline: one TTT pass over the target's greedy continuation of PROMPT."""
    target, draft = models
    path = tmp_path_factory.mktemp("train") / "training.h5"
    seqs = greedy_sequences(target, torch.tensor([PROMPT]), 14)  # covers what serving drafts past 10
    with td.record(path, source="training") as rec, torch.no_grad():
        record_ttt(rec, draft, ttt_pass(draft, target, seqs, SPEC, 3), seqs, ["s0"], step=0)
    return path


def serve(models, path, conventions: Conventions, draft=None) -> None:
    target, default_draft = models
    decoder = SpeculativeDecoder(target, draft or default_draft, conventions, num_steps=3)
    with td.record(path, source="serving", meta=decoder.contract()) as rec:
        decoder.rec = rec
        decoder.decode("r0", PROMPT, 10)


def compare(a, b, tol: tuple[str, ...] = ()) -> tuple[int, dict]:
    """In-process compare; the report as its JSON form (what tools downstream read)."""
    report = td.compare(a, b, tol=tol)
    return report.exit_code, json.loads(report.to_json())


def kinds(report: dict) -> list[str]:
    return [d["kind"] for d in report["diagnoses"]]


def first_at(report: dict) -> tuple:
    first = report["first_divergence"]
    return first["name"], first["row"]["position"], first["row"]["depth"]


@pytest.mark.slow
def test_healthy_serving_matches_training(models, training, tmp_path) -> None:
    """Nothing diverges and nothing is diagnosed. The draft is untrained: its chains never draft what
    training was fed at depths 1-2, so those depths hold no comparable row and the verdict says so."""
    serve(models, tmp_path / "serving.h5", Conventions(SPEC))
    code, report = compare(training, tmp_path / "serving.h5")
    assert report["first_divergence"] is None and report["diagnoses"] == []
    assert code == 3 and report["verdict"] == "incomplete"
    assert [r.split(" (")[0] for r in report["reasons"]] == ["depths 1-2: no row comparable"]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "kind", "slots_b"), [
    (AuxSpec((2, 1, 0)), "aux_order", ["target.layer.2", "target.layer.1", "target.layer.0"]),
    (AuxSpec((0, 1, 2), convention=INPUT_TO_LAYER), "layer_offset",
     ["target.embed", "target.layer.0", "target.layer.1"]),
    (AuxSpec((0, 1, 3)), "aux_layer_set", ["target.layer.0", "target.layer.1", "target.layer.3"]),
])
def test_aux_diagnoses(models, training, tmp_path, spec, kind, slots_b) -> None:
    serve(models, tmp_path / "serving.h5", Conventions(spec))
    code, report = compare(training, tmp_path / "serving.h5")
    assert code == 1 and first_at(report) == ("target.aux", 0, 0)
    assert kinds(report) == [kind]
    evidence = report["diagnoses"][0]["evidence"]
    assert evidence["slots_a"] == ["target.layer.0", "target.layer.1", "target.layer.2"]
    assert evidence["slots_b"] == slots_b


@pytest.mark.slow
def test_ids_not_shifted_left_is_a_position_shift(models, training, tmp_path) -> None:
    """Serving embeds token t at row t instead of token t + 1: its draft.input_ids at position p + 1
    hold what training holds at p."""
    serve(models, tmp_path / "serving.h5", Conventions(SPEC, input_shift=0))
    code, report = compare(training, tmp_path / "serving.h5")
    assert code == 1 and first_at(report) == ("draft.input_ids", 0, 0)
    assert kinds(report) == ["position_shift"]
    assert report["diagnoses"][0]["evidence"]["shift"] == 1
    assert "serving at position p+1 equals training at position p" in report["diagnoses"][0]["message"]


@pytest.mark.slow
def test_draft_rope_positions_off_by_one(models, training, tmp_path) -> None:
    """A server change runs chain drafts (depth >= 1) one RoPE position later. (Against training
    this tiny random draft's depth > 0 rows are not comparable: it never drafts the true token.)"""
    serve(models, tmp_path / "before.h5", Conventions(SPEC))
    serve(models, tmp_path / "after.h5", Conventions(SPEC, position_offset=1))
    code, report = compare(tmp_path / "before.h5", tmp_path / "after.h5")
    name, _, depth = first_at(report)
    assert code == 1 and (name, depth) == ("draft.positions", 1)
    assert kinds(report) == ["position_shift", "config"]  # the data's offset, and the contract key stating it
    assert report["diagnoses"][0]["evidence"]["value_offset"] == 1
    assert report["diagnoses"][1]["evidence"]["key"] == "draft_position_offset"
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert statuses["draft.input_ids"] == "match" and statuses["draft.hidden"] == "downstream"


@pytest.mark.slow
def test_d2t_read_as_a_direct_map(models, training, tmp_path) -> None:
    serve(models, tmp_path / "serving.h5", Conventions(SPEC, d2t_reading="direct"))
    code, report = compare(training, tmp_path / "serving.h5")
    assert code == 1 and first_at(report) == ("draft.token_target", 0, 0)
    assert kinds(report) == ["vocab_map"]
    assert report["diagnoses"][0]["evidence"]["direct_side"] == "b"
    assert report["contract"]["only_b"]["d2t_reading"] == "direct"


@pytest.mark.slow
def test_a_regenerated_d2t_differs(models, training, tmp_path) -> None:
    """Serving pairs the draft with a d2t rebuilt from other token counts (re-generated on fine-tune)."""
    target, draft = models
    other = type(draft)(draft.config, embed_tokens=target.model.embed_tokens.weight.detach())
    other.load_state_dict(draft.state_dict())
    d2t, t2d = build_vocab_map(np.random.default_rng(1).integers(0, 100, 512), 384)
    other.d2t.copy_(torch.from_numpy(d2t))
    other.t2d.copy_(torch.from_numpy(t2d))
    serve(models, tmp_path / "serving.h5", Conventions(SPEC), draft=other.eval())
    code, report = compare(training, tmp_path / "serving.h5")
    assert code == 1 and first_at(report) == ("draft.token_target", 0, 0)
    assert kinds(report) == ["vocab_map"]
    evidence = report["diagnoses"][0]["evidence"]
    assert evidence["entries_differing"] == int((d2t != draft.d2t.numpy()).sum()) > 0


def record_target(path, model, tokens, request: str, states=None, **meta) -> None:
    states = states or run_target(model, torch.tensor([tokens]))
    with td.record(path, **meta) as rec:
        for name, value in states.states.items():
            rec.log(name, value[0], token_ids=tokens, request=request)
        rec.log("target.logits", states.logits[0], token_ids=tokens, request=request)


TOKENS = [3, 17, 250, 9, 88, 41, 7, 300, 12, 5, 99, 64]


def test_bf16_vs_float32_matches_and_a_strict_tolerance_says_precision(tmp_path) -> None:
    model = tiny_llama(seed=1)
    record_target(tmp_path / "f32.h5", model, TOKENS, "x")
    record_target(tmp_path / "bf16.h5", tiny_llama(seed=1).to(torch.bfloat16), TOKENS, "y")
    code, report = compare(tmp_path / "f32.h5", tmp_path / "bf16.h5")
    assert code == 0 and report["verdict"] == "match", report["tensors"]
    code, report = compare(tmp_path / "f32.h5", tmp_path / "bf16.h5", tol=("target.*:max_rel<=1e-4",))
    assert code == 1 and first_at(report) == ("target.embed", 0, 0)
    assert kinds(report) == ["precision"]
    assert report["diagnoses"][0]["evidence"]["dtype"] == "bfloat16"


def test_a_float32_bug_is_not_called_precision(tmp_path) -> None:
    model = tiny_llama(seed=1)
    record_target(tmp_path / "a.h5", model, TOKENS, "x")
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: out * 1.001)
    record_target(tmp_path / "b.h5", model, TOKENS, "x")
    handle.remove()
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and first_at(report) == ("target.layer.1", 0, 0)
    assert "precision" not in kinds(report)


def test_scaled_embeddings(tmp_path) -> None:
    """One producer multiplies embeddings by sqrt(hidden) (the Gemma normalizer), the other not."""
    model = tiny_llama(seed=2)
    record_target(tmp_path / "a.h5", model, TOKENS, "x")
    factor = math.sqrt(model.config.hidden_size)
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, out: out * factor)
    record_target(tmp_path / "b.h5", model, TOKENS, "x")
    handle.remove()
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and first_at(report) == ("target.embed", 0, 0)
    assert kinds(report) == ["scale"]
    assert report["diagnoses"][0]["evidence"]["norm_ratio_b_over_a"] == pytest.approx(factor, rel=1e-5)
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert statuses["target.layer.3"] == "downstream"


def test_last_layer_after_the_final_norm(tmp_path) -> None:
    """HF's hidden_states[-1] is after the final norm; a producer that takes it as the last layer's
    output records RMSNorm(layer 3) where the other records layer 3 itself."""
    model = tiny_llama(seed=2)
    with torch.no_grad():
        weight = torch.rand(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        model.model.norm.weight.copy_(weight + 0.5)
    states = run_target(model, torch.tensor([TOKENS]))
    record_target(tmp_path / "a.h5", model, TOKENS, "x", states=states)
    with torch.no_grad():
        hidden = model(torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
    states.states["target.layer.3"] = hidden[-1]
    record_target(tmp_path / "b.h5", model, TOKENS, "x", states=states)
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and first_at(report) == ("target.layer.3", 0, 0)
    assert kinds(report) == ["norm"]
    evidence = report["diagnoses"][0]["evidence"]
    assert evidence["normed_side"] == "b"
    assert evidence["weight_mean"] == pytest.approx(float(model.model.norm.weight.detach().mean()), rel=1e-3)


@pytest.mark.slow
def test_first_nan_is_named(tmp_path) -> None:
    """A NaN produced inside layer 2 at one position; later layers and logits carry it on."""
    model = tiny_llama(seed=3)
    record_target(tmp_path / "a.h5", model, TOKENS, "x")

    def poison(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        hidden[0, 4, 1] = float("nan")
        return out

    handle = model.model.layers[2].register_forward_hook(poison)
    record_target(tmp_path / "b.h5", model, TOKENS, "x")
    handle.remove()
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and first_at(report) == ("target.layer.2", 4, 0)
    nan = next(d for d in report["diagnoses"] if d["kind"] == "nan_inf")
    assert nan["evidence"]["tensor"] == "target.layer.2" and nan["evidence"]["side"] == "b"
    assert nan["evidence"]["position"] == 4 and nan["evidence"]["rows_non_finite"] == 1


def test_draft_positions_that_do_not_advance_with_depth(tmp_path) -> None:
    """A producer that runs every depth of row t at RoPE position t, against one that runs depth d
    at t + d (SpecForge's TTT and SGLang's chain): named as positions off by one per depth."""
    tokens = [5, 6, 7, 8, 9]
    for name, advance in (("a", 1), ("b", 0)):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.request_tokens("r", tokens)
            for depth in range(3):
                rows = list(range(len(tokens) - 1 - depth))
                keys = dict(token_ids=[tokens[t] for t in rows], positions=rows, request="r", depth=depth)
                rec.log("draft.input_ids", np.array([tokens[t + 1 + depth] for t in rows]), **keys)
                rec.log("draft.positions", np.array([t + advance * depth for t in rows]), **keys)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged" and report.first_divergence.name == "draft.positions"
    [found] = report.diagnoses
    assert found.kind == "position_shift" and "x depth" in found.message
    assert (found.evidence.value_offset, found.evidence.per_depth) == (-1, True)
