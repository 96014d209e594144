"""explain on traces from the real producers: SGLang's serving code (the committed sample's trained
target and draft through ``draft_forward`` on CPU, 7 steps, topk 1, chat prompts sharing a system
prefix) and a SpecForge 0.2.0 training step on features from SGLang's target code. An aux-layer
bug is the fc input's, a draft exported without d2t the vocab map's, and a second checkpoint with
another rope_theta the draft computation's, each with its cost; training and a healthy server have
nothing to explain."""

from __future__ import annotations

import json

import pytest

from testbed.sglang_cpu import sglang_missing

if sglang_missing():
    pytest.skip(sglang_missing(), allow_module_level=True)

import tracediff as td  # noqa: E402
from testbed.sglang_cpu import ServedSample, serve_sample, train_sample  # noqa: E402
from tests.conftest import cli  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding  # noqa: E402
from tracediff.eagle3.explain import explain_traces  # noqa: E402
from tracediff.eagle3.explanation import Explanation  # noqa: E402
from tracediff.eagle3.readings import READINGS, SGLANG, engine_choice  # noqa: E402

pytestmark = pytest.mark.slow  # each fixture serves four requests through SGLang's real code

SERVED = dict(num_steps=7, requests=4, new_tokens=16)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("healthy"), **SERVED)


@pytest.fixture(scope="module")
def aux_bug(tmp_path_factory) -> ServedSample:
    """Outputs of layers 0, 2, 4 where the draft was trained on [embed, layer 1, layer 3]."""
    return serve_sample(tmp_path_factory.mktemp("aux_bug"), aux_ids=(0, 2, 4), **SERVED)


@pytest.fixture(scope="module")
def no_d2t(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("no_d2t"), without_d2t=True, **SERVED)


@pytest.fixture(scope="module")
def rope(tmp_path_factory) -> ServedSample:
    return serve_sample(tmp_path_factory.mktemp("rope"), config={"rope_theta": 10.0}, **SERVED)


@pytest.fixture(scope="module")
def training(healthy, tmp_path_factory):
    return train_sample(tmp_path_factory.mktemp("training"), healthy.texts)


def explained(a: ServedSample, b: ServedSample) -> Explanation:
    embed = target_embedding(a.target_dir)
    drafts = {side: load_draft(run.draft_dir, embed, reading=READINGS[SGLANG])
              for side, run in (("a", a), ("b", b))}
    with td.open_trace(a.trace) as ta, td.open_trace(b.trace) as tb:
        return explain_traces(ta, tb, drafts)


@pytest.mark.parametrize(("case", "group"), [
    ("aux_bug", "fc input"), ("no_d2t", "vocab map (d2t)"), ("rope", "draft computation")])
def test_each_bug_is_attributed_to_its_input(healthy, request, case, group) -> None:
    """Each server's own checkpoint on its side (--draft-b)."""
    broken = request.getfixturevalue(case)
    ex = explained(healthy, broken)
    a, b = ex.run("A's inputs"), ex.run("B's inputs")
    assert a.expected_accept_len - b.expected_accept_len > 0.5 and ex.cost > ex.noise
    said = f"B's {group} costs {ex.cost:.2f} accepted tokens per verify"
    assert ex.conclusion.startswith(said), ex.conclusion
    fixed = ex.run(f"B with A's {group}")
    assert abs(fixed.expected_accept_len - a.expected_accept_len) <= ex.noise
    assert ex.recorded_agreement == {"a": 1.0, "b": 1.0}  # each server ran the checkpoint it was given


def test_two_healthy_servings_have_nothing_to_explain(healthy, tmp_path) -> None:
    again = serve_sample(tmp_path, **{**SERVED, "requests": 2})
    done = cli("explain", str(healthy.trace), str(again.trace), "--draft", str(healthy.draft_dir), "--target",
               str(healthy.target_dir), "--json")
    assert done.returncode == 0, done.stderr
    plain = json.loads(done.stdout)
    assert plain["differing"] == [] and "nothing to explain" in plain["conclusion"]


@pytest.mark.parametrize(("served", "said"), [
    ("healthy", "A and B give the draft the same inputs"),
    ("aux_bug", "B's fc input costs"),
])
def test_specforge_training_against_sglang_serving(training, request, served, said) -> None:
    """A's draft ran in SpecForge (its training trace says so), B's in SGLang: each is replayed as
    its engine computes it (the sample's config reads alike in both)."""
    run = request.getfixturevalue(served)
    embed = target_embedding(run.target_dir)
    with td.open_trace(training) as ta, td.open_trace(run.trace) as tb:
        assert (ta.engine, tb.engine) == ("specforge", "sglang")
        drafts = {side: load_draft(run.draft_dir, embed, reading=engine_choice(t.engine).reading)
                  for side, t in (("a", ta), ("b", tb))}
        ex = explain_traces(ta, tb, drafts)
    assert ex.conclusion.startswith(said), ex.conclusion
    assert ex.requests == 4 and ex.scored_on == "the server's chains"
    assert ex.recorded_agreement == {"a": 1.0, "b": 1.0}



def explained_with(a, b, run: ServedSample, *extra: str) -> Explanation:
    """The CLI's explanation with one checkpoint, the healthy one, as a user diagnosing B would give."""
    done = cli("explain", str(a), str(b), "--draft", str(run.draft_dir), "--target", str(run.target_dir),
               "--json", *extra)
    assert done.returncode == 0, done.stderr
    return Explanation.from_json(done.stdout)


def test_a_server_that_applied_no_vocab_map_is_the_vocab_maps_even_with_one_checkpoint(
        training, healthy, no_d2t) -> None:
    """B's server applied no d2t (its contract says so): B is replayed with none, not with the
    checkpoint's, and its cost is the vocab map's."""
    ex = explained_with(training, no_d2t.trace, healthy)
    assert ex.differing == ["d2t"]
    assert ex.conclusion.startswith("B's vocab map (d2t) costs"), ex.conclusion
    assert ex.recorded_agreement == {"a": 1.0, "b": 1.0}


def test_a_recording_the_checkpoint_does_not_reproduce_comes_first(training, healthy, rope) -> None:
    """B's server ran rope_theta 10; explained with the healthy checkpoint only, the first line says
    that B's recorded drafts are not what it computes, and which config key differs."""
    ex = explained_with(training, rope.trace, healthy)
    assert ex.conclusion.startswith("the checkpoint does not reproduce B's recorded drafts ("), ex.conclusion
    assert "the checkpoint's config has rope_theta 10000.0 (the trace states 10.0)" in ex.conclusion
    assert ex.recorded_agreement["b"] < 1.0 and ex.recorded_agreement["a"] == 1.0


@pytest.mark.parametrize("order", ["healthy first", "short first"])
def test_requests_that_share_only_a_system_prompt_are_not_blamed_on_fed_ids(healthy, tmp_path, order) -> None:
    """Two of four chats: the other two share only the 3-token system prompt with them. Requests pair
    one to one on the text through the next token: the same two pairs and verdict either way round."""
    short = serve_sample(tmp_path, **{**SERVED, "requests": 2})
    a, b = (healthy.trace, short.trace) if order == "healthy first" else (short.trace, healthy.trace)
    ex = explained_with(a, b, healthy)
    assert ex.differing == [] and ex.requests == 2, (ex.conclusion, ex.requests)
    assert "nothing to explain" in ex.conclusion
    longer = "a" if order == "healthy first" else "b"
    none = {"no_shared_text": 0, "partner_taken": 0, "no_context": 0}
    # never claimed: the verdict says what it did not see, and why (they share the system prompt only
    # with requests that paired on more rows)
    assert ex.unpaired == {"a": none, "b": none, longer: {**none, "partner_taken": 2}}
    assert ex.conclusion.endswith(f"(on the request pairs only: 2 of {longer.upper()}'s requests share text "
                                  "only with requests paired on more of theirs, never replayed)")
