"""Replay against the engines' own draft code: on serving traces recorded from SGLang's real
``draft_forward`` (the committed sample's trained target and draft, 7 steps, topk 1, chat prompts
sharing a system prefix), replay's figure is the accept length of the chains SGLang itself
returned, scored as a greedy verify scores them; config keys the engines read differently move
it as much as they moved the server; the self-check reproduces every recorded chain. SpecForge's
real draft class gives what replay computes under SpecForge's reading, on the same weights."""

from __future__ import annotations

import json
import math

import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tracediff as td  # noqa: E402
from testbed.sglang_cpu import SAMPLE, ServedSample, serve_sample  # noqa: E402
from tests.conftest import cli  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor  # noqa: E402
from tracediff.eagle3.readings import READINGS, SGLANG, SPECFORGE, engine_choice  # noqa: E402
from tracediff.eagle3.replay import ReplayReport, replay  # noqa: E402

pytestmark = pytest.mark.slow  # each module fixture serves four requests through SGLang's real code

STEPS = 7


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("healthy"), num_steps=STEPS)


@pytest.fixture(scope="module")
def norm_output(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("norm_output"), config={"norm_output": True}, num_steps=STEPS)


@pytest.fixture(scope="module")
def rope(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("rope"), config={"rope_theta": 500000.0}, num_steps=STEPS)


@pytest.fixture(scope="module")
def norm_output_false(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("norm_output_false"), config={"norm_output": False},
                        num_steps=STEPS)


@pytest.fixture(scope="module")
def no_d2t(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("no_d2t"), without_d2t=True, num_steps=STEPS)


def served(run: ServedSample) -> float:
    return 1 + float(np.mean([a - 1 for a in run.accepted]))


def replayed(run: ServedSample, engine: str | None = None, d2t: str = "offset") -> ReplayReport:
    with td.open_trace(run.trace) as trace:
        choice = engine_choice(trace.engine, engine)
        draft = load_draft(run.draft_dir, target_embedding(run.target_dir), reading=choice.reading,
                           target_head=target_tensor(run.target_dir, "lm_head"))
        return replay(trace, draft, d2t_reading=d2t, engine=choice)


def assert_the_servers_figure(report: ReplayReport, run: ServedSample) -> None:
    """The figure rests on the server's chains and equals theirs, within a few chains' noise."""
    assert report.scored_on == "the server's chains"
    assert abs(report.chains - len(run.accepted)) <= 2
    assert abs(report.expected_accept_len - served(run)) * len(run.accepted) <= 2, \
        (report.expected_accept_len, served(run))


def assert_reproduces_every_chain(report: ReplayReport, run: ServedSample) -> None:
    check = report.self_check
    assert check is not None and check.first_departure is None, check
    assert check.chains == check.reproduced == run.chains


def test_replay_gives_the_accept_length_of_the_chains_sglang_drafted(healthy) -> None:
    report = replayed(healthy)
    assert len(report.depth_accuracy) == STEPS
    assert report.depths_from == f"the trace's speculative num_steps {STEPS}"
    assert report.engine == "SGLang 0.5.23" and report.engine_from == "the engine that recorded the trace"
    assert_the_servers_figure(report, healthy)
    assert served(healthy) > 2.0  # a healthy draft: the figure is not a trivial 1.0 on both sides
    assert_reproduces_every_chain(report, healthy)
    assert report.self_check.hidden_max_rel < 1e-4


@pytest.mark.parametrize(("case", "least_move"), [("norm_output", 0.2), ("rope", 0.05),
                                                  ("norm_output_false", None)])
def test_a_config_key_moves_replay_as_much_as_it_moved_sglang(case, least_move, healthy, request) -> None:
    """SGLang 0.5.23 hands the normed hidden state to the next depth under norm_output: true, and
    rotates with the config's rope_theta (500000 here, trained at 10000); norm_output: false is its
    default (SpecForge's false would take the logits un-normed: not SGLang's reading)."""
    run = request.getfixturevalue(case)
    moved = served(run) - served(healthy)
    if least_move is None:
        assert run.accepted == healthy.accepted  # the same computation as without the key
    else:
        assert abs(moved) > least_move, moved
    report = replayed(run)
    assert_the_servers_figure(report, run)
    assert_reproduces_every_chain(report, run)


def test_under_specforges_reading_norm_output_is_the_healthy_draft_and_the_self_check_says_why(
        healthy, norm_output) -> None:
    """SpecForge hands the pre-norm state on whatever norm_output says: its figure is the healthy
    server's, and the chains SGLang recorded are not reproduced; the self-check names the key."""
    report = replayed(norm_output, engine=SPECFORGE)
    assert report.engine == "SpecForge 0.2.0" and report.engine_from == "--engine"
    assert abs(report.expected_accept_len - served(healthy)) * len(healthy.accepted) <= 2
    check = report.self_check
    assert check is not None and check.reproduced == 0 and check.first_departure is not None
    assert (check.first_departure.depth, check.first_departure.tensor) == (0, "draft.hidden")
    assert check.suspect is not None
    assert "norm_output true" in check.suspect and "--engine sglang" in check.suspect


def test_a_draft_exported_without_d2t_costs_replay_what_it_cost_sglang(healthy, no_d2t) -> None:
    """Without d2t SGLang takes each draft id for the target id (no hot_token_id); replay reads
    the missing map the same way (offsets of 0). The drafts themselves are unchanged."""
    assert served(no_d2t) < served(healthy) - 0.5
    report = replayed(no_d2t)
    assert_the_servers_figure(report, no_d2t)
    assert_reproduces_every_chain(report, no_d2t)


def test_the_cli_reports_the_engine_and_the_self_check_in_json(norm_output) -> None:
    done = cli("replay", str(norm_output.trace), "--draft", str(norm_output.draft_dir), "--target",
               str(norm_output.target_dir), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["engine"] == "SGLang 0.5.23" and out["self_check"]["first_departure"] is None
    assert math.isclose(out["expected_accept_len"], replayed(norm_output).expected_accept_len)
    text = cli("replay", str(norm_output.trace), "--draft", str(norm_output.draft_dir), "--target",
               str(norm_output.target_dir), "--engine", "specforge")
    assert text.returncode == 0, text.stderr
    assert "draft computed as SpecForge 0.2.0 computes it (--engine)" in text.stdout
    said = " ".join(text.stdout.split())
    assert "norm_output true: SpecForge 0.2.0 hands the pre-norm hidden state" in said


@pytest.mark.parametrize("norm_output", [None, True, False])
def test_specforges_own_draft_class_computes_what_replay_computes_under_its_reading(norm_output,
                                                                                   tmp_path) -> None:
    """SpecForge 0.2.0's LlamaForCausalLMEagle3 (backbone + compute_logits, two TTT depths) on the
    sample draft's weights, and ours under SpecForge's reading: the same logits and hidden states.
    Its norm_output false takes logits from the un-normed state (our SGLang reading does not)."""
    from specforge.modeling.draft.llama3_eagle import prepare_decoder_attention_mask

    from testbed import specforge_cpu

    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    raw = json.loads((SAMPLE / "draft" / "config.json").read_text())
    if norm_output is not None:
        raw["norm_output"] = norm_output
    (draft_dir / "config.json").write_text(json.dumps(raw))
    (draft_dir / "model.safetensors").write_bytes((SAMPLE / "draft" / "model.safetensors").read_bytes())
    embed = target_embedding(SAMPLE / "target")
    theirs = specforge_cpu.load_draft(draft_dir, embed_tokens=embed).eval()
    ours = load_draft(draft_dir, embed, reading=READINGS[SPECFORGE])
    other = load_draft(draft_dir, embed, reading=READINGS[SGLANG])
    g = torch.Generator().manual_seed(0)
    t = 6
    fc_in = torch.randn(1, t, ours.fc.in_features, generator=g)
    ids = torch.randint(0, ours.config.vocab_size, (1, t + 1), generator=g)
    positions = torch.arange(t)[None]
    with torch.no_grad():
        mine = ours.unroll(fc_in, ids[:, :t], 2, positions=positions)
        sglang = other.unroll(fc_in, ids[:, :t], 2, positions=positions)
        mask = prepare_decoder_attention_mask(torch.ones(1, t, dtype=torch.bool), (1, t), fc_in, 0)
        hidden, cache = theirs.project_hidden_states(fc_in), [[], []]
        for depth in range(2):
            fed = torch.cat([ids[:, depth : t], torch.zeros(1, depth, dtype=ids.dtype)], dim=1)[:, :t]
            hidden = theirs.backbone(theirs.embed_input_ids(fed), hidden, cache, mask, positions,
                                     use_cache=False)
            logits = theirs.compute_logits(hidden)
            torch.testing.assert_close(mine[depth].logits, logits, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine[depth].hidden, hidden, rtol=1e-4, atol=1e-5)
    same = torch.allclose(sglang[0].logits, mine[0].logits, rtol=1e-4, atol=1e-5)
    assert same == (norm_output is not False)  # only SpecForge's norm_output false skips the logits norm


def test_compare_names_the_engines_reading_when_sglangs_draft_meets_specforges(norm_output, tmp_path) -> None:
    """The server's trace against replay's output computed as SpecForge computes the same draft
    (its contract states draft_engine specforge): compare diverges at draft.hidden, downstream of
    equal inputs, and the engine_reading diagnosis names norm_output."""
    out = tmp_path / "specforge.h5"
    done = cli("replay", str(norm_output.trace), "--draft", str(norm_output.draft_dir), "--target",
               str(norm_output.target_dir), "--engine", "specforge", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = td.compare(norm_output.trace, out)
    assert report.verdict == "diverged" and report.first_divergence.name == "draft.hidden"
    statuses = {t.name: t.status for t in report.tensors}
    assert statuses["draft.fc_in"] == statuses["draft.fc_out"] == statuses["draft.embed"] == "match"
    (found,) = [d for d in report.diagnoses if d.kind == "engine_reading"]
    assert found.severity == "error" and found.evidence.keys == ["norm_output"]
    assert (found.evidence.engine_a, found.evidence.engine_b) == ("SGLang 0.5.23", "SpecForge 0.2.0")


def test_no_engine_reading_where_the_engines_compute_the_config_alike(healthy, tmp_path) -> None:
    """Without norm_output the two readings are one computation: SpecForge's replay of the healthy
    server's trace matches it wherever both computed the same rows."""
    out = tmp_path / "specforge.h5"
    done = cli("replay", str(healthy.trace), "--draft", str(healthy.draft_dir), "--target",
               str(healthy.target_dir), "--engine", "specforge", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = td.compare(healthy.trace, out)
    assert report.verdict == "match", [(t.name, t.status) for t in report.tensors]
    assert not [d for d in report.diagnoses if d.kind == "engine_reading"]


def test_a_one_step_server_is_scored_on_its_chains(tmp_path) -> None:
    """num_steps 1 drafts no depth 1: the chains are the draft.token_target rows draft_forward returned."""
    run = serve_sample(tmp_path, num_steps=1, requests=2, new_tokens=8)
    report = replayed(run)
    assert len(report.depth_accuracy) == 1
    assert_the_servers_figure(report, run)
    assert_reproduces_every_chain(report, run)


def test_a_trace_whose_chains_all_reach_past_its_text_is_one_error_line(tmp_path) -> None:
    run = serve_sample(tmp_path, num_steps=3, requests=1, new_tokens=1)
    assert run.accepted == [] and run.chains == 1
    done = cli("replay", str(run.trace), "--draft", str(run.draft_dir), "--target", str(run.target_dir))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: {run.trace}: replay has no server chain to score: all 1 of them "
                                  "reach past the recorded text")


def test_replay_completes_a_checkpoint_as_sglang_does(tmp_path) -> None:
    """fc_norm asked for without its weights (SGLang normalises with unit weights) and a tied
    lm_head (SGLang's logits: the embedding's first draft-vocab rows): replay computes the same,
    says so, and reproduces every chain."""
    run = serve_sample(tmp_path, config={"fc_norm": True, "tie_word_embeddings": True}, requests=2,
                       new_tokens=8)
    report = replayed(run)
    assert_the_servers_figure(report, run)
    assert_reproduces_every_chain(report, run)
    notes = " ".join(report.engine_notes)
    assert "no fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight: SGLang 0.5.23 normalises with unit " \
        "weights" in notes and "tie_word_embeddings" in notes


@pytest.mark.parametrize("order", ["serving first", "replay first"])
def test_a_config_that_differs_is_never_blamed_on_the_engines(healthy, tmp_path, order) -> None:
    """Replayed with another config (norm_output true and rope_theta 500000) where the server ran
    none of them: the configs differ, so engine_reading stays silent whichever side comes first."""
    draft = tmp_path / "draft"
    draft.mkdir()
    raw = json.loads((healthy.draft_dir / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**raw, "norm_output": True, "rope_theta": 500000.0}))
    (draft / "model.safetensors").write_bytes((healthy.draft_dir / "model.safetensors").read_bytes())
    out = tmp_path / "specforge.h5"
    done = cli("replay", str(healthy.trace), "--draft", str(draft), "--target", str(healthy.target_dir),
               "--engine", "specforge", "--out", str(out))
    assert done.returncode == 0, done.stderr
    a, b = (healthy.trace, out) if order == "serving first" else (out, healthy.trace)
    report = td.compare(a, b)
    assert report.verdict == "diverged"
    assert not [d for d in report.diagnoses if d.kind == "engine_reading"]
    causes = [d.evidence.key for d in report.diagnoses if d.kind == "config" and d.severity == "error"]
    assert "draft_config.rope_theta" in causes


def test_the_trace_s_own_acceptance_is_the_servers(healthy, norm_output) -> None:
    """Without a checkpoint: the drafts SGLang recorded, scored against the target's tokens, are
    the chains' figure the test took from SGLang itself."""
    from tracediff.eagle3.acceptance import recorded_acceptance

    for run in (healthy, norm_output):
        with td.open_trace(run.trace) as trace:
            acc = recorded_acceptance(trace)
        assert acc is not None and acc.scored_on == "the server's chains"
        assert_the_servers_figure(acc, run)
