"""Which chains a figure is scored on (``tracediff/eagle3/chains.py``): a chain is scored only where
every depth of it has a recorded target token, whatever its outcome, in replay, compare's
acceptance and explain alike; the others are counted, unscored. Tested against SGLang's own chains.

Scoring a chain near the text's end when its first miss falls inside the text, and leaving it out
when every position the text shows was accepted, keeps chains by their outcome: a bias toward short
chains. The served tests take the chains SGLang 0.5.23's real ``draft_forward`` drafted (topk 1, 7
steps, four chat prompts) with texts that end mid-chain, and compute the figure over the chains whose
every drafted position lies inside the text from SGLang's drafted tokens themselves."""

from __future__ import annotations

import numpy as np
import pytest

from tracediff.eagle3.chains import leading_hits

STEPS = 7


def test_a_chain_is_scored_only_where_every_depth_has_a_target_token() -> None:
    """Three chains of 3 depths: all known (a miss at depth 1); a miss at depth 0 with depth 2 past
    the text; every known depth right, depth 2 past the text. The last two are unscored alike."""
    hits = np.array([[True, False, True], [False, False, False], [True, True, False]])
    valid = np.array([[True, True, True], [True, True, False], [True, True, False]])
    assert leading_hits(hits, valid).tolist() == [1, -1, -1]
    assert leading_hits(np.ones((1, 3), bool), np.ones((1, 3), bool)).tolist() == [3]


def inside_the_text(run) -> tuple[float, int, int]:
    """SGLang's chains whose every drafted position lies inside the served text: (1 + the mean
    leading drafts equal to the text, chains, the other chains), from the drafted tokens."""
    scored = []
    for chain, text in run.drafted:
        if chain.anchor + 1 + len(chain.tokens) >= len(text):  # depth d drafts position anchor + 2 + d
            continue
        same = [token == text[chain.anchor + 2 + depth] for depth, token in enumerate(chain.tokens)]
        scored.append(same.index(False) if False in same else len(same))
    return 1 + float(np.mean(scored)), len(scored), len(run.drafted) - len(scored)


@pytest.mark.slow
@pytest.mark.parametrize(("served", "new_tokens"), [
    ({"config": {"norm_output": True}}, 21),  # a draft setting SGLang reads otherwise than training
    ({"aux_ids": [0, 2, 4]}, 19),  # aux ids shifted by one layer
    ({}, 21),  # healthy
], ids=["norm_output", "aux_shifted", "healthy"])
def test_replay_compare_and_explain_score_the_chains_inside_the_text(served, new_tokens, tmp_path) -> None:
    """new_tokens not a multiple of the chain (7 drafts + the target's token): each request's text
    ends mid-chain, and replay, compare's acceptance and explain all give SGLang's figure over the
    chains inside the text, the same chains, and count the others as unscored."""
    from testbed.sglang_cpu import sglang_missing

    if sglang_missing():
        pytest.skip(sglang_missing())
    import tracediff as td
    from testbed.sglang_cpu import serve_sample
    from tests.conftest import cli
    from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor
    from tracediff.eagle3.readings import engine_choice
    from tracediff.eagle3.replay import replay

    run = serve_sample(tmp_path, num_steps=STEPS, new_tokens=new_tokens, **served)
    figure, chains, unscored = inside_the_text(run)
    assert chains and unscored
    with td.open_trace(run.trace) as trace:
        choice = engine_choice(trace.engine)
        draft = load_draft(run.draft_dir, target_embedding(run.target_dir), reading=choice.reading,
                           target_head=target_tensor(run.target_dir, "lm_head"))
        replayed = replay(trace, draft, engine=choice)
    assert replayed.scored_on == "the server's chains"
    assert (replayed.chains, replayed.chains_unscored) == (chains, unscored)
    assert replayed.expected_accept_len == pytest.approx(figure, abs=1e-12)
    assert replayed.self_check is not None and replayed.self_check.first_departure is None

    acceptance = td.compare(run.trace, run.trace).b.acceptance
    assert acceptance is not None and acceptance.scored_on == "the server's chains"
    assert (acceptance.chains, acceptance.chains_unscored) == (chains, unscored)
    assert acceptance.expected_accept_len == pytest.approx(figure, abs=1e-12)
    line = cli("compare", str(run.trace), str(run.trace)).stdout.splitlines()[1]
    assert line.startswith(f"acceptance: a's recorded drafts would be accepted {figure:.2f} tokens per "
                           f"verify (over {chains} of the server's chains; {unscored} more unscored: some "
                           "depth has no recorded target token;")

    explained = td.explain(run.trace, run.trace, run.draft_dir, target=run.target_dir)
    mine = explained.run("B's inputs")
    assert (mine.chains, mine.own_chains, explained.chains_unscored) == (chains, chains, unscored)
    assert mine.expected_accept_len == pytest.approx(figure, abs=1e-12)
    assert mine.own_accept_len == pytest.approx(figure, abs=1e-12)
