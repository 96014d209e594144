"""A trace's own acceptance estimate: its recorded drafts scored against its recorded target tokens,
without a checkpoint; compare reports it per side next to the verdict. On the committed sample the
training figures are the training run's (figures.json) and the serving figures are replay's."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, cli
from tracediff.eagle3.acceptance import recorded_acceptance

S = REPO / "traces" / "eagle3"
FIGURES = json.loads((S / "figures.json").read_text())


def acceptance(name: str):
    with td.open_trace(S / name) as trace:
        return recorded_acceptance(trace)


def test_a_training_trace_scores_every_row_as_training_measured_it() -> None:
    acc = acceptance("training.h5")
    # 81 rows; the last 3 of each of the 3 samples reach past its text: unscored (leading_hits)
    assert acc.scored_on == "every row" and (acc.chains, acc.chains_unscored) == (72, 9)
    assert acc.depth_accuracy == pytest.approx(FIGURES["training_acc_per_depth"], abs=1e-6)


@pytest.mark.parametrize(("name", "accept", "chains", "unscored"), [("serving.h5", 2.2727, 22, 5),
                                                                     ("serving_aux_bug.h5", 1.0227, 44, 12)])
def test_a_serving_trace_scores_the_servers_chains(name, accept, chains, unscored) -> None:
    """The same chains and figure as replay's (tests/test_replay.py checks those against the
    trace's own verify steps): those whose every depth has a recorded target token."""
    acc = acceptance(name)
    assert acc.scored_on == "the server's chains"
    assert (round(acc.expected_accept_len, 4), acc.chains, acc.chains_unscored) == (accept, chains, unscored)


def test_no_figure_without_target_tokens_or_drafts(tmp_path) -> None:
    with td.record(tmp_path / "t.h5") as rec:
        rec.log("draft.token", np.arange(3), request="r", positions=[0, 1, 2], token_ids=[1, 2, 3])
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert recorded_acceptance(trace) is None


def test_compare_reports_each_sides_acceptance_under_the_verdict() -> None:
    report = td.compare(S / "training.h5", S / "serving_aux_bug.h5")
    assert report.a.acceptance == acceptance("training.h5")
    assert report.b.acceptance == acceptance("serving_aux_bug.h5")
    lines = cli("compare", str(S / "training.h5"), str(S / "serving_aux_bug.h5")).stdout.splitlines()
    assert lines[1].startswith("acceptance: a's recorded drafts would be accepted 2.72 tokens per verify "
                               "(over 72 rows; 9 more unscored: some depth has no recorded target token; "
                               "accuracy per depth 0.63 / 0.60 / 0.57 / 0.60)")
    assert lines[2].startswith("acceptance: b's recorded drafts would be accepted 1.02 tokens per verify "
                               "(over 44 of the server's chains; 12 more unscored")
    md = cli("compare", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--markdown").stdout
    assert "Acceptance: b's recorded drafts would be accepted 1.02 tokens per verify" in md


def test_the_html_report_states_each_sides_acceptance(tmp_path) -> None:
    page = tmp_path / "r.html"
    done = cli("compare", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--html", str(page))
    assert done.returncode == 1, done.stderr
    html = page.read_text()
    assert html.count('<p class="acceptance">') == 2
    assert "b&#x27;s recorded drafts would be accepted 1.02 tokens per verify" in html


@pytest.fixture(scope="module")
def sample_models():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tracediff.eagle3.checkpoint import load_draft

    target = transformers.LlamaForCausalLM.from_pretrained(S / "target").eval()
    return target, load_draft(S / "draft", target.model.embed_tokens.weight.detach()), torch


def test_a_one_step_servers_chains_are_its_verifies(sample_models, tmp_path) -> None:
    """From an adversarial review: the reference loop records draft.token_target on every row its
    draft extends; a one-step server's chains are its verifies (verify.accept_len), not every row."""
    from testbed.loop import Conventions, SpeculativeDecoder
    from tracediff.eagle3.capture import AuxSpec
    from tracediff.eagle3.chains import drafted_from

    target, draft, _ = sample_models
    decoder = SpeculativeDecoder(target, draft, Conventions(AuxSpec((-1, 1, 3))), num_steps=1)
    with td.record(tmp_path / "one.h5", source="serving", meta=decoder.contract()) as rec:
        decoder.rec = rec
        for k, prompt in enumerate(([1, 5, 77, 300, 12, 9, 41], [1, 9, 8, 7])):
            decoder.decode(f"r{k}", prompt, 12)
    with td.open_trace(tmp_path / "one.h5") as trace:
        verifies = trace.keys("verify.accept_len")
        anchors = drafted_from(trace)
        acc = recorded_acceptance(trace)
        assert sum(len(p) for p in anchors.values()) == len(verifies) < len(trace.keys("draft.token_target"))
        assert acc.scored_on == "the server's chains" and acc.chains + acc.chains_unscored == len(verifies)


def test_no_figure_over_no_scorable_chain(sample_models, tmp_path) -> None:
    """A server drafting 7 tokens a verify, 3 new tokens a request: every chain reaches past the
    text, so no chain is scored, and compare says so instead of printing 1.00."""
    from testbed.loop import Conventions, SpeculativeDecoder
    from tracediff.eagle3.capture import AuxSpec

    target, draft, _ = sample_models
    decoder = SpeculativeDecoder(target, draft, Conventions(AuxSpec((-1, 1, 3))), num_steps=7)
    with td.record(tmp_path / "deep.h5", source="serving", meta=decoder.contract()) as rec:
        decoder.rec = rec
        decoder.decode("r0", [1, 5, 77, 300, 12, 9, 41], 3)
    with td.open_trace(tmp_path / "deep.h5") as trace:
        acc = recorded_acceptance(trace)
    assert acc.chains == 0 and acc.chains_unscored > 0 and acc.expected_accept_len != acc.expected_accept_len
    out = " ".join(cli("compare", str(S / "serving.h5"), str(tmp_path / "deep.h5")).stdout.split())
    assert "acceptance: b's recorded drafts: no chain scorable (over 0 of the server's chains; " in out
