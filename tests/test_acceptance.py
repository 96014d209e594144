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
    assert acc.scored_on == "every row" and acc.chains == 78
    assert acc.depth_accuracy == pytest.approx(FIGURES["training_acc_per_depth"], abs=1e-6)


@pytest.mark.parametrize(("name", "accept", "chains"), [("serving.h5", 2.2083, 24),
                                                         ("serving_aux_bug.h5", 1.0189, 53)])
def test_a_serving_trace_scores_the_servers_chains(name, accept, chains) -> None:
    """The same chains and figure as replay's (tests/test_replay.py checks those against the
    trace's own verify steps)."""
    acc = acceptance(name)
    assert acc.scored_on == "the server's chains"
    assert (round(acc.expected_accept_len, 4), acc.chains) == (accept, chains)


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
    assert lines[1].startswith("acceptance: a's recorded drafts would be accepted 2.64 tokens per verify "
                               "(over 78 rows; accuracy per depth 0.63 / 0.60 / 0.57 / 0.60)")
    assert lines[2].startswith("acceptance: b's recorded drafts would be accepted 1.02 tokens per verify "
                               "(over 53 of the server's chains;")
    md = cli("compare", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--markdown").stdout
    assert "Acceptance: b's recorded drafts would be accepted 1.02 tokens per verify" in md


def test_the_html_report_states_each_sides_acceptance(tmp_path) -> None:
    page = tmp_path / "r.html"
    done = cli("compare", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--html", str(page))
    assert done.returncode == 1, done.stderr
    html = page.read_text()
    assert html.count('<p class="acceptance">') == 2
    assert "b&#x27;s recorded drafts would be accepted 1.02 tokens per verify" in html
