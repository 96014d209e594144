"""The seed bug with the real code on both sides (scripts/seed_bug_real.py): features captured through
SGLang 0.5.23's target code feed a real SpecForge 0.2.0 training step, the same prompts are served by
SGLang's target and EAGLE-3 draft code, each recorded through its integration; compare says whether
training and serving fed the draft the same target states, and if not, how they differ."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import tracediff as td
from testbed.sglang_cpu import sglang_missing
from tests.conftest import REPO

REASON = sglang_missing() or (None if importlib.util.find_spec("specforge") else "specforge is not installed")
if REASON:
    pytest.skip(REASON, allow_module_level=True)

spec = importlib.util.spec_from_file_location("seed_bug_real", REPO / "scripts" / "seed_bug_real.py")
assert spec is not None and spec.loader is not None
seed_bug = sys.modules["seed_bug_real"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(seed_bug)
CASES = {case.name: case for case in seed_bug.CASES}
pytestmark = pytest.mark.slow  # SGLang's and SpecForge's real code, both sides of each case
DRAFT_INPUT = ("target.aux", "draft.fc_in")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("seed_bug_real")


@pytest.fixture(scope="module")
def reports(out_dir):
    seed_bug.sglang_cpu.prepare()
    return {name: seed_bug.run_case(case, out_dir) for name, case in CASES.items()}


def test_each_side_was_recorded_by_its_integration_from_the_real_code(reports, out_dir) -> None:
    with td.open_trace(out_dir / "match.training.h5") as training, \
            td.open_trace(out_dir / "match.serving.h5") as serving:
        trained, served = training.contract, serving.contract
        assert (trained["producer_integration"], trained["source"]) == ("specforge", "training")
        assert trained["aux_layer_ids"] == [1, 3, 5] and trained["ttt_length"] == seed_bug.TTT_LENGTH
        assert served["source"] == "serving" and served["layers_to_capture"] == [2, 4, 6]  # SGLang's +1
        assert served["speculative_args"]["num_draft_tokens"] == seed_bug.NUM_STEPS + 1  # resolved, not raw
        for name in ("target.layer.5", *DRAFT_INPUT, "draft.hidden", "draft.logits"):
            assert name in training.names() and name in serving.names(), name
        assert max(training.rows("draft.hidden").depth) == seed_bug.TTT_LENGTH - 1  # the TTT unroll
        assert max(serving.rows("draft.hidden").depth) == seed_bug.NUM_STEPS - 1  # the draft chain


def test_the_same_aux_ids_on_both_sides_match_with_full_coverage(reports) -> None:
    report = reports["match"]
    assert (report.first_divergence, report.coverage.fraction) == (None, 1.0)
    assert not [d for d in report.diagnoses if d.severity == "error"]
    # the draft took one training step: its chains never draft what training was fed at depth >= 1, so
    # those depths hold no comparable row, and the verdict does not claim them
    assert report.verdict == "incomplete" and all("no row comparable" in r for r in report.reasons)
    assert report.coverage.depths[0].aligned > 0
    # training learns from the served text: serving's last chains ran past it, and are not held against it
    assert report.coverage.skipped_b.get("past_other_text", 0) > 0
    # both integrations state the draft config the same way: it differs only where the drafts do
    assert "draft_config" not in {e.key for e in report.contract.differing}
    compared = {t.name: t.coverage.aligned for t in report.tensors if t.coverage is not None}
    for name in ("target.embed", "target.layer.5", *DRAFT_INPUT, "draft.fc_out", "draft.hidden",
                 "draft.logits", "draft.token_target", "target.token"):
        assert compared[name] > 0, name  # compared row by row, not just present


def test_the_seed_teams_configs_name_the_aux_layer_set_with_both_lists(reports) -> None:
    report = reports["aux_layer_set"]
    assert report.verdict == "diverged" and report.first_divergence.name in DRAFT_INPUT
    found = {d.kind: d.message for d in report.diagnoses}
    assert "aux_layer_set" in found
    assert "[layer 2, layer 4, layer 6]" in found["aux_layer_set"]  # the exported draft config
    assert "[embed, layer 2, layer 4]" in found["aux_layer_set"]  # the training config
    assert report.coverage.fraction == 1.0  # diverged on everything it could compare


def test_indexing_hf_hidden_states_with_sglang_ids_is_one_layer_off(reports) -> None:
    report = reports["layer_offset"]
    assert report.verdict == "diverged" and report.first_divergence.name in DRAFT_INPUT
    kinds = [d.kind for d in report.diagnoses]
    assert kinds[0] == "layer_offset", kinds
    assert "[layer 1, layer 3, layer 5]" in report.diagnoses[0].message
    assert "[layer 0, layer 2, layer 4]" in report.diagnoses[0].message
