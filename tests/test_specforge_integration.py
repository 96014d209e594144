"""Recording a real SpecForge 0.2.0 EAGLE-3 training step (its own strategy, TTT unroll, loss,
backward and optimizer) on CPU: what every canonical name holds, row by row, for a right-padded
batch of two samples; that recording changes nothing in training and never stops it; and that two
recordings of the same step compare as the same while a perturbed fc is named where it acts."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import SimpleNamespace

import numpy as np
import pytest

import tracediff as td
from testbed.sglang_cpu import prepare, sglang_missing
from tests.conftest import tiny_llama

REASON = sglang_missing() or (None if importlib.util.find_spec("specforge") else "specforge is not installed")
if REASON:
    pytest.skip(REASON, allow_module_level=True)
prepare()  # SpecForge imports triton: the stub goes in first

import torch  # noqa: E402
from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: E402

from testbed import train as reference  # noqa: E402
from testbed.specforge_cpu import (  # noqa: E402
    CpuTrainer,
    build_draft,
    collate,
    hf_sample,
    load_draft,
    reference_loss,
    target_head,
)
from tracediff.eagle3.capture import AuxSpec  # noqa: E402
from tracediff.eagle3.checkpoint import save_draft  # noqa: E402
from tracediff.eagle3.config import DraftConfig  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402
from tracediff.eagle3.vocab import build_vocab_map  # noqa: E402
from tracediff.integrations import specforge as sf  # noqa: E402

pytestmark = pytest.mark.slow  # SpecForge's real training step, recorded and trained for several steps
AUX = (1, 2, 3)
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, draft_vocab_size=384,
              eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX)})
TTT = 3
LENGTHS = {"alpha": 12, "beta": 8}  # beta is right-padded to 12
STEPS = 4  # recorded: the draft learns enough that accuracies are not all zero
DRAFT_NAMES = ("draft.fc_in", "draft.fc_out", "draft.input_ids", "draft.embed", "draft.positions",
               "draft.hidden", "draft.logits", "draft.token", "draft.token_target", "train.loss_mask")
DEPTH0_ONLY = ("draft.fc_in", "draft.fc_out")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4)


def make_model(target, length: int = TTT, fc_noise: float = 0.0) -> OnlineEagle3Model:
    """A SpecForge draft built from CONFIG with a fixed seed, the target's embeddings and a real
    d2t/t2d (fixed token counts), wrapped for TTT."""
    draft = build_draft(CONFIG, seed=3)
    d2t, t2d = build_vocab_map(np.random.default_rng(0).integers(0, 100, 512), 384)
    with torch.no_grad():
        draft.d2t.copy_(torch.from_numpy(d2t))
        draft.t2d.copy_(torch.from_numpy(t2d))
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if fc_noise:
            draft.fc.weight.add_(fc_noise * torch.randn(draft.fc.weight.shape, generator=torch.Generator()
                                                        .manual_seed(9)))
    return OnlineEagle3Model(draft, length=length)


@pytest.fixture(scope="module")
def batch(target):
    """Two samples in SpecForge's offline layout through its own normalizer and padding collator."""
    g = torch.Generator().manual_seed(1)
    samples = [hf_sample(target, torch.randint(0, 512, (n,), generator=g), torch.ones(n, dtype=torch.long),
                         AUX) for n in LENGTHS.values()]
    return collate(samples, sample_ids=list(LENGTHS))


def train(target, batch, path=None, steps: int = 1, model=None, **install) -> list[dict]:
    """SpecForge's metrics for ``steps`` real steps, recorded to ``path`` when given."""
    model = model or make_model(target)
    trainer = CpuTrainer(model, target.lm_head.weight.detach(), lr=3e-3)
    if path is None:
        return [trainer.step(batch) for _ in range(steps)]
    with td.record(path, source="training") as rec:
        handle = sf.install(rec, model, **install)
        metrics = [trainer.step(batch) for _ in range(steps)]
        handle.remove()
    return metrics


@pytest.fixture(scope="module")
def recorded(target, batch, tmp_path_factory):
    path = tmp_path_factory.mktemp("sf") / "steps.h5"
    return path, train(target, batch, path, steps=STEPS)


@pytest.fixture(scope="module")
def trace(recorded):
    with td.open_trace(recorded[0]) as opened:
        yield opened


def rows(trace, name: str, depth: int = 0, step: int = 0):
    """(values [B, L, ...], positions [B, L], requests [B], token ids [B, L]) of one step and depth."""
    got = trace.rows(name, step=step, depth=depth)
    batch = len(LENGTHS)
    values = got.numpy().reshape(batch, -1, *got.data.shape[1:])
    return (values, got.position.reshape(batch, -1), list(got.request.reshape(batch, -1)[:, 0]),
            got.token_id.reshape(batch, -1))


def test_every_name_has_the_rows_and_keys_of_a_padded_batch(trace, batch) -> None:
    names = set(trace.names())
    assert names == {*DRAFT_NAMES, "target.token", "draft.d2t", "draft.t2d"}
    assert [len(list(trace.records(name=n))) for n in ("draft.d2t", "draft.t2d")] == [1, 1]
    x = batch.input_ids.numpy()
    for name in DRAFT_NAMES:
        for depth in range(1 if name in DEPTH0_ONLY else TTT):
            _, positions, requests, tokens = rows(trace, name, depth)
            assert requests == list(LENGTHS)
            assert (tokens == x).all()  # every row keyed by its anchor's token x[t], at every depth
            for b, n in enumerate(LENGTHS.values()):  # row t is real while x[t+1+depth] is
                expected = np.where(np.arange(x.shape[1]) < n - 1 - depth, np.arange(x.shape[1]), -1)
                assert positions[b].tolist() == expected.tolist(), (name, depth, b)
        depths = 1 if name in DEPTH0_ONLY else TTT
        assert [r.step for r in trace.records(name=name)] == [s for s in range(STEPS) for _ in range(depths)]
    _, positions, _, _ = rows(trace, "target.token")
    for b, n in enumerate(LENGTHS.values()):  # target rows 1..n-1: position 0's logits are shifted out
        assert positions[b].tolist() == [p if 1 <= p < n else -1 for p in range(x.shape[1])]
    assert trace.request_tokens().sequence("beta")[1].tolist() == x[1, :8].tolist()
    contract = trace.contract
    assert contract["aux_sources"] == ["target.layer.1", "target.layer.2", "target.layer.3"]
    assert contract["aux_layer_convention"] == "output_of_layer"
    assert contract["aux_layer_ids_from"] == "draft_config"
    assert (contract["ttt_length"], contract["source"]) == (TTT, "training")
    assert contract["versions"]["specforge"] == "0.2.0"
    assert contract["draft_config"]["draft_vocab_size"] == 384 and len(contract["d2t_sha256"]) == 64


def test_fc_in_is_the_features_given(trace, batch) -> None:
    values, positions, _, _ = rows(trace, "draft.fc_in")
    real = positions >= 0
    np.testing.assert_array_equal(values[real], batch.aux_hidden.numpy()[real])


def test_each_ttt_step_embeds_the_ids_shifted_once_more(trace, batch, target) -> None:
    x = batch.input_ids.numpy()
    table = target.model.embed_tokens.weight.detach().numpy()  # the draft's frozen copy
    for depth in range(TTT):
        fed, positions, _, _ = rows(trace, "draft.input_ids", depth)
        embedded, _, _, _ = rows(trace, "draft.embed", depth)
        real = positions >= 0
        b, t = np.nonzero(real)
        assert (fed[b, t] == x[b, t + 1 + depth]).all()
        np.testing.assert_array_equal(embedded[real], table[fed[real]])


def test_rope_runs_at_row_plus_depth(trace) -> None:
    """SpecForge's TTT does not reuse positions: step d rotates row t at t + d (``position_ids + lck``),
    as caught at its apply_rotary_pos_emb call."""
    for depth in range(TTT):
        rope, positions, _, _ = rows(trace, "draft.positions", depth)
        real = positions >= 0
        assert (rope[real] == positions[real] + depth).all()


def test_token_target_is_token_plus_its_d2t_offset(trace, target) -> None:
    d2t = next(trace.records(name="draft.d2t")).numpy()
    for depth in range(TTT):
        logits, positions, _, _ = rows(trace, "draft.logits", depth)
        token, _, _, _ = rows(trace, "draft.token", depth)
        token_target, _, _, _ = rows(trace, "draft.token_target", depth)
        assert (token == logits.argmax(-1)).all()
        assert (token_target == token + d2t[token]).all()
        assert (d2t[token] != 0).any()  # the offsets matter here: a direct reading would differ


def test_target_token_is_the_target_prediction_at_its_position(trace, target, batch) -> None:
    tokens, positions, _, _ = rows(trace, "target.token")
    with torch.no_grad():
        expected = target(batch.input_ids, attention_mask=batch.attention_mask).logits.argmax(-1).numpy()
    real = positions >= 0
    assert (tokens[real] == expected[real]).all()


def test_accuracy_from_the_trace_is_specforges(trace, recorded) -> None:
    """SpecForge's acc_d: argmax + d2t == the target's token at t+1+d, over loss-mask rows."""
    metrics = recorded[1]
    assert any(m[f"acc_{d}"] > 0 for m in metrics for d in range(TTT))
    for step, reported in enumerate(metrics):
        target_tokens, target_positions, _, _ = rows(trace, "target.token", step=step)
        for depth in range(TTT):
            mask, positions, _, _ = rows(trace, "train.loss_mask", depth, step)
            predicted, _, _, _ = rows(trace, "draft.token_target", depth, step)
            assert not mask[positions < 0].any()  # no loss row hides among the padding
            correct = 0
            for b, t in zip(*np.nonzero(mask)):
                at = np.flatnonzero(target_positions[b] == t + 1 + depth)
                correct += int(predicted[b, t] == target_tokens[b, at[0]])
            assert correct / mask.sum() == pytest.approx(reported[f"acc_{depth}"], abs=1e-7), (step, depth)


def test_recording_changes_nothing_and_the_loss_goes_down(target, batch, recorded) -> None:
    plain = train(target, batch, steps=STEPS + 1)
    assert [(m["loss"], m["acc"]) for m in recorded[1]] == [(m["loss"], m["acc"]) for m in plain[:STEPS]]
    losses = [m["loss"] for m in plain]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_a_failing_recorder_leaves_training_running(target, batch, tmp_path, caplog) -> None:
    (plain,) = train(target, batch)
    closed = td.record(tmp_path / "closed.h5")
    closed.close()
    model = make_model(target)
    sf.install(closed, model)
    (metrics,) = train(target, batch, model=model)
    assert metrics["loss"] == plain["loss"]

    strict = td.record(tmp_path / "strict.h5", strict=True)
    strict.log("draft.logits", np.zeros((1, 3), np.int64), token_ids=[7], request="earlier")  # int rows
    model = make_model(target)
    handle = sf.install(strict, model)
    with caplog.at_level(logging.WARNING, logger="tracediff"):
        runs = train(target, batch, steps=2, model=model)  # float logits now raise in the strict recorder
    strict.close()
    assert [m["loss"] for m in runs][0] == plain["loss"] and not handle.active
    stopped = [r for r in caplog.records if "SpecForge recording stopped" in r.getMessage()]
    assert len(stopped) == 1 and "training continues" in stopped[0].getMessage()
    with td.open_trace(tmp_path / "strict.h5") as written:
        assert len(list(written.records(name="draft.logits"))) == 1


def test_a_forward_without_its_unshifted_ids_is_not_recorded(target, batch, tmp_path, caplog) -> None:
    """A custom loop calls the model itself: it says which ids the forward trains on."""
    model = make_model(target)
    head = target_head(target.lm_head.weight.detach())
    ids, last, mask = head.preprocess(batch.input_ids, batch.last_hidden, batch.loss_mask)
    inputs = dict(input_ids=ids, attention_mask=batch.attention_mask, target=head(last), loss_mask=mask,
                  hidden_states=batch.aux_hidden)
    with td.record(tmp_path / "loop.h5") as rec, reference_loss(), caplog.at_level(logging.WARNING):
        handle = sf.install(rec, model, sample_ids=lambda n, b: f"mine{n}.{b}")
        model(**inputs)
        handle.next_batch(batch.input_ids, step=41)
        model(**inputs)
        handle.remove()
    assert sum("without its unshifted input_ids" in r.getMessage() for r in caplog.records) == 1
    with td.open_trace(tmp_path / "loop.h5") as written:
        fed = written.rows("draft.input_ids", depth=0)
        assert set(fed.step) == {41} and sorted(set(fed.request)) == ["mine0.0", "mine0.1"]


def test_an_unsupported_specforge_fails_at_install_in_one_line(target, monkeypatch, tmp_path) -> None:
    import specforge.modeling.draft.llama3_eagle as llama3_eagle

    with td.record(tmp_path / "x.h5") as rec:
        with pytest.raises(sf.SpecForgeUnsupported, match="not SpecForge's OnlineEagle3Model"):
            sf.install(rec, torch.nn.Linear(2, 2))
        monkeypatch.delattr(llama3_eagle, "apply_rotary_pos_emb")
        with pytest.raises(sf.SpecForgeUnsupported) as raised:
            sf.install(rec, make_model(target))
    message = str(raised.value)
    assert "\n" not in message and "SpecForge 0.2.0" in message and "apply_rotary_pos_emb" in message


def test_same_step_matches_and_a_perturbed_fc_diverges_at_fc_out(target, batch, recorded, tmp_path) -> None:
    train(target, batch, tmp_path / "again.h5", steps=STEPS)
    same = td.compare(recorded[0], tmp_path / "again.h5")
    assert same.verdict == "match" and same.coverage.fraction == 1.0 and same.first_divergence is None
    train(target, batch, tmp_path / "perturbed.h5", steps=STEPS, model=make_model(target, fc_noise=1e-2))
    report = td.compare(recorded[0], tmp_path / "perturbed.h5")
    assert report.verdict == "diverged" and report.first_divergence.name == "draft.fc_out"
    statuses = {t.name: t.status for t in report.tensors}
    assert statuses["draft.fc_in"] == statuses["draft.input_ids"] == "match"


def test_reference_trainer_computes_and_logs_what_specforge_does(target, tmp_path) -> None:
    """Our reference TTT (testbed.train) and SpecForge's, on the same weights (ours,
    exported as SpecForge exports a draft, loaded into SpecForge's model) and the same features:
    every draft tensor matches, but ours logs draft.positions = t at every depth while both
    rotate at t + d."""
    torch.manual_seed(3)
    embed = target.model.embed_tokens.weight.detach()
    ours = Eagle3Draft(DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=512, draft_vocab_size=384,
                                   max_position_embeddings=128, aux_layer_ids=AUX), embed_tokens=embed)
    d2t, t2d = build_vocab_map(np.random.default_rng(0).integers(0, 100, 512), 384)
    ours.d2t.copy_(torch.from_numpy(d2t))
    ours.t2d.copy_(torch.from_numpy(t2d))
    save_draft(ours, tmp_path / "export", with_embeddings=False)
    model = OnlineEagle3Model(load_draft(tmp_path / "export", embed_tokens=embed), length=TTT)
    seqs = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(5))
    equal = collate([hf_sample(target, s, torch.ones(10, dtype=torch.long), AUX) for s in seqs], ["r0", "r1"])
    train(target, equal, tmp_path / "specforge.h5", model=model)
    with td.record(tmp_path / "reference.h5", source="training") as rec:
        ttt = reference.ttt_pass(ours.eval(), target, seqs, AuxSpec(AUX), TTT)
        reference.record_ttt(rec, ours, ttt, seqs, ["r0", "r1"], step=0)
    report = td.compare(tmp_path / "reference.h5", tmp_path / "specforge.h5")
    statuses = {t.name: t.status for t in report.tensors}
    computed = [n for n in DRAFT_NAMES if n != "train.loss_mask"]  # no loss mask in ours
    for name in (*computed, "target.token", "draft.d2t", "draft.t2d"):
        assert statuses[name] == "match", name
    assert report.first_divergence is None


def test_the_launcher_plugin_records_models_built_after_startup(target, batch, tmp_path, monkeypatch) -> None:
    launch = pytest.importorskip("tracediff.record.child")
    import specforge.algorithms.model_providers as providers

    monkeypatch.setattr(OnlineEagle3Model, "__init__", OnlineEagle3Model.__init__)  # restored afterwards
    monkeypatch.setattr(providers, "resolve_eagle_capture_layers", providers.resolve_eagle_capture_layers)
    stated = importlib.import_module("tracediff.integrations.specforge.facts")
    monkeypatch.setattr(stated, "resolved_aux", None)  # what an earlier test's resolver call noted
    from tracediff.record.plugin import LaunchConfig

    config = LaunchConfig(out=str(tmp_path / "run.h5"), plugins=("tracediff.integrations.specforge",),
                                 requests=1)
    factory = launch._ProcessRecorder(config)
    sf.at_startup(config, factory)
    run_override = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=[0, 2, 3]))
    assert providers.resolve_eagle_capture_layers(run_override, CONFIG, None) == [0, 2, 3]
    train(target, batch, model=make_model(target))  # built after startup: recorded with no code change
    factory.close()
    with td.open_trace(tmp_path / "run.h5") as written:
        assert written.meta["source"] == "training"
        assert set(written.rows("draft.logits", depth=0).request) == {"alpha"}  # --requests 1
        contract = written.contract
        assert contract["aux_layer_ids"] == [0, 2, 3]
        assert contract["aux_layer_ids_from"] == "specforge_resolver"


def test_the_ids_are_read_as_the_target_family_captures_them(target, batch, tmp_path) -> None:
    """SpecForge captures through the target family's own SGLang setter: given SGLang's target
    class, the contract identifies it and reads the ids as that family does (a DeepSeek-V3 keeps ids
    that do not start at 1: [2, 3, 4] trains on the outputs of layers 1, 2, 3); given the HF model,
    the features are its hidden_states[i+1], the outputs of layers 2, 3, 4; without a target, as most
    families read them. The ids themselves stay as configured, as serving's contract states them."""
    from testbed.sglang_families import family_bed

    bed = family_bed("deepseek_v2")
    for given, sources, reading in (
            (bed.load(), [1, 2, 3], "specforge 0.2.0 through sglang's DeepseekV3ForCausalLM"),
            (bed.hf, [2, 3, 4], "output of layer i (HF hidden_states[i+1] of DeepseekV3ForCausalLM)"),
            (None, [2, 3, 4], "output of layer i (the target's family not given)")):
        path = tmp_path / f"{type(given).__module__.split('.')[0]}.h5"
        model = make_model(target)
        trainer = CpuTrainer(model, target.lm_head.weight.detach(), lr=3e-3)
        with td.record(path, source="training") as rec:
            handle = sf.install(rec, model, aux_layer_ids=[2, 3, 4], target=given)
            trainer.step(batch)
            handle.remove()
        with td.open_trace(path) as trace:
            stated = trace.contract
        assert stated["aux_layer_ids"] == [2, 3, 4] and stated["aux_layer_reading"] == reading
        assert stated["aux_sources"] == [f"target.layer.{i}" for i in sources]
        assert stated["aux_layer_ids_resolved"] == sources
        if given is None:
            assert "target_config" not in stated
        else:
            assert stated["target_config"]["architecture"] == "DeepseekV3ForCausalLM"
