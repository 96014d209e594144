"""``tracediff explain``: the draft replayed on A's inputs, B's and the swaps; the input whose swap
restores acceptance is named with its cost, and traces that feed the draft alike have nothing to
explain. On the committed sample (training vs serving with the aux-layer bug)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import REPO, cli  # noqa: E402
from tracediff.eagle3.checkpoint import load_draft, target_embedding  # noqa: E402
from tracediff.eagle3.explain import explain_traces  # noqa: E402
from tracediff.eagle3.explanation import Explanation  # noqa: E402
from tracediff.eagle3.replay import replay  # noqa: E402

S = REPO / "traces" / "eagle3"
FIGURES = json.loads((S / "figures.json").read_text())


def run(a: str, b: str, draft_b=None) -> Explanation:
    draft = load_draft(S / "draft", target_embedding(S / "target"))
    other = draft if draft_b is None else load_draft(draft_b, target_embedding(S / "target"))
    with td.open_trace(S / a) as ta, td.open_trace(S / b) as tb:
        return explain_traces(ta, tb, {"a": draft, "b": other})


def test_the_aux_bug_is_attributed_to_the_fc_input() -> None:
    ex = run("training.h5", "serving_aux_bug.h5")
    assert ex.differing == ["fc_in"] and ex.scored_on == "the server's chains"
    a, b, fixed = ex.run("A's inputs"), ex.run("B's inputs"), ex.run("B with A's fc input")
    assert ex.conclusion.startswith(f"B's fc input costs {a.expected_accept_len - b.expected_accept_len:.2f} "
                                    "accepted tokens per verify")
    assert a.chains == b.chains == fixed.chains  # one set of chains: like compared with like
    assert fixed.expected_accept_len == pytest.approx(a.expected_accept_len)
    assert ex.cost > 1.0 and ex.cost > ex.noise
    with td.open_trace(S / "serving_aux_bug.h5") as trace:  # B's own figure is replay's and the server's
        alone = replay(trace, load_draft(S / "draft", target_embedding(S / "target")))
    assert b.own_accept_len == pytest.approx(alone.expected_accept_len)
    assert b.own_chains == alone.chains
    assert b.own_accept_len == pytest.approx(FIGURES["serving_aux_bug_mean_accept_len"], abs=0.01)


def test_traces_that_feed_the_draft_alike_have_nothing_to_explain() -> None:
    ex = run("training.h5", "serving.h5")
    assert ex.differing == [] and ex.conclusion.startswith("A and B give the draft the same inputs")
    assert "nothing to explain" in ex.conclusion and len(ex.runs) == 2


def test_a_second_checkpoint_with_another_rope_theta_is_the_draft_computation(tmp_path) -> None:
    """rope_theta 10 against the 10000 the draft was trained with (500000 moves this sample's short
    texts less than the noise of its 22 chains)."""
    other = tmp_path / "draft"
    shutil.copytree(S / "draft", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 10.0}))
    ex = run("serving.h5", "serving.h5", draft_b=other)
    assert ex.differing == ["draft"]
    caveat, verdict = ex.conclusion.split("; with the checkpoints given: ")
    assert caveat.startswith("the checkpoint does not reproduce B's recorded drafts") and caveat.endswith(
        "the checkpoint's config has rope_theta 10.0 (the trace states 10000.0)): give B's own checkpoint as "
        "--draft-b")
    assert verdict.startswith("B's draft computation costs"), ex.conclusion
    assert ex.run("B with A's draft computation").expected_accept_len == pytest.approx(
        ex.run("A's inputs").expected_accept_len)
    # the recorded logits say the same: A's checkpoint computes A's recording, B's does not
    assert ex.recorded_logits_max_diff["a"] < 1e-4 < 1e-1 < ex.recorded_logits_max_diff["b"]


def test_the_recorded_logits_are_what_the_checkpoint_computes_on_each_sides_inputs() -> None:
    ex = run("training.h5", "serving_aux_bug.h5")
    assert set(ex.recorded_logits_max_diff) == {"a", "b"}
    assert all(v is not None and v < 1e-4 for v in ex.recorded_logits_max_diff.values())


def test_the_explanation_round_trips_json() -> None:
    ex = run("training.h5", "serving_aux_bug.h5")
    assert Explanation.from_json(ex.to_json()) == ex
    with pytest.raises(ValueError, match="explanation version"):
        Explanation.from_json(json.dumps({**json.loads(ex.to_json()), "explanation_version": 99}))
    lacking = {k: v for k, v in json.loads(ex.to_json()).items() if k != "runs"}
    with pytest.raises(ValueError, match=r"missing fields \['runs'\]"):  # a field with a default too
        Explanation.from_json(json.dumps(lacking))


def test_the_cli_prints_the_conclusion_first_and_markdown_for_a_bug_report() -> None:
    args = ("explain", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--draft", str(S / "draft"),
            "--target", str(S / "target"))
    text = cli(*args)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].startswith("B's fc input costs")
    md = cli(*args, "--markdown")
    assert md.stdout.startswith("**B's fc input costs") and "| B with A's fc input |" in md.stdout
    plain = json.loads(cli(*args, "--json").stdout)
    assert plain["differing"] == ["fc_in"] and plain["explanation_version"] == 3
    both = cli(*args, "--json", "--markdown")
    assert both.returncode == 2 and both.stderr.startswith("error: --json: choose one")


def test_traces_that_share_no_text_are_one_error_line(tmp_path) -> None:
    import numpy as np

    with td.open_trace(S / "serving.h5") as sample:
        width = sample.rows("draft.fc_in", depth=0).data.shape[1]
    path = tmp_path / "other.h5"
    with td.record(path, source="training") as rec:
        rec.log("draft.fc_in", np.zeros((4, width), np.float32), request="x", positions=np.arange(4),
                token_ids=[1, 2, 3, 4])
        rec.log("target.token", np.arange(4), request="x", positions=np.arange(4), token_ids=[1, 2, 3, 4])
    done = cli("explain", str(S / "training.h5"), str(path), "--draft", str(S / "draft"), "--target",
               str(S / "target"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: {path}: shares no request text with")


def test_too_few_chains_tell_no_difference_from_noise() -> None:
    import numpy as np

    from tracediff.eagle3.explain import MIN_CHAINS, Run, conclude

    def run(name: str, base: str, accept: float) -> Run:
        return Run(name=name, base=base, swapped=[], expected_accept_len=accept, chains=2,
                   own_accept_len=accept, own_chains=2, depth_accuracy=[0.5], depth_rows=[2])

    runs = {"A's inputs": run("A's inputs", "a", 3.0), "B's inputs": run("B's inputs", "b", 1.0)}
    leads = {"A's inputs": np.array([2, 2]), "B's inputs": np.array([0, 0])}  # a constant difference
    verdict = conclude(runs, ["fc_in"], 2.0, float("inf"), leads)
    assert verdict.text.startswith(f"too few chains to tell a difference from noise (A 3.00, B 1.00 over 2 "
                                   f"chains; at least {MIN_CHAINS} needed)")
    assert verdict.restored_by is None


def test_the_figures_do_not_depend_on_which_trace_comes_first() -> None:
    forward, backward = run("training.h5", "serving_aux_bug.h5"), run("serving_aux_bug.h5", "training.h5")
    assert backward.conclusion.startswith("A's fc input costs")
    assert backward.cost == pytest.approx(-forward.cost)
    assert backward.run("A's inputs").chains == forward.run("B's inputs").chains
    assert backward.run("A's inputs").depth_accuracy == forward.run("B's inputs").depth_accuracy


def test_docs_explain_names_every_field_of_the_json() -> None:
    import dataclasses

    from tracediff.eagle3.explanation import Run

    doc = (REPO / "docs" / "EXPLAIN.md").read_text()
    for cls in (Explanation, Run):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc, f"{cls.__name__}.{f.name}"


def test_the_public_api_explains_from_paths_as_the_command_does() -> None:
    ex = td.explain(S / "training.h5", S / "serving_aux_bug.h5", S / "draft", target=S / "target")
    said = json.loads(cli("explain", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--draft",
                          str(S / "draft"), "--target", str(S / "target"), "--json").stdout)
    assert td.Explanation.from_json(json.dumps(said)) == ex
    assert ex.restored_by == "B with A's fc input"


def test_a_server_that_drafted_trees_is_scored_on_every_row_and_says_why(tmp_path) -> None:
    from tests.test_replay import copy_with_contract

    path = tmp_path / "tree.h5"
    copy_with_contract(S / "serving.h5", path, speculative_args={
        "algorithm": "EAGLE3", "num_steps": 4, "topk": 4, "num_draft_tokens": 8})
    draft = load_draft(S / "draft", target_embedding(S / "target"))
    with td.open_trace(S / "training.h5") as ta, td.open_trace(path) as tb:
        ex = explain_traces(ta, tb, {"a": draft, "b": draft})
    assert ex.scored_on.startswith("every row, not the server's figure: the server drafted trees (topk 4")
    assert "nothing to explain" in ex.conclusion


def test_a_checkpoint_whose_fc_takes_another_width_is_one_error_line(tmp_path) -> None:
    import torch

    from tracediff.eagle3.checkpoint import save_draft
    from tracediff.eagle3.config import DraftConfig
    from tracediff.eagle3.draft import Eagle3Draft

    torch.manual_seed(0)
    config = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=1024, draft_vocab_size=768, max_position_embeddings=256,
                         target_hidden_size=128)
    save_draft(Eagle3Draft(config, torch.randn(1024, 64)), tmp_path / "wide", with_embeddings=True)
    base = ("explain", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), "--target", str(S / "target"))
    done = cli(*base, "--draft", str(tmp_path / "wide"))
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: --draft: A's fc input (draft.fc_in) is 192 wide (1.5 slots of 128); the draft's fc takes 384 "
        "(3 slots): not the checkpoint that trace was drafted with")
    only_b = cli(*base, "--draft", str(S / "draft"), "--draft-b", str(tmp_path / "wide"))
    assert only_b.returncode == 2 and only_b.stderr.startswith("error: --draft-b (or --draft): B's fc input")
    bundled = cli("bundle", *base[1:3], "-o", str(tmp_path / "out"), "--draft", str(tmp_path / "wide"))
    assert bundled.returncode == 2 and bundled.stderr.startswith("error: --draft: A's fc input")
    assert not (tmp_path / "out").exists()


def test_arrow_traces_explain_alike_and_without_a_warning(tmp_path) -> None:
    for name in ("training", "serving_aux_bug"):
        done = cli("convert", str(S / f"{name}.h5"), str(tmp_path / f"{name}.arrow"))
        assert done.returncode == 0, done.stderr
    args = ("--draft", str(S / "draft"), "--target", str(S / "target"), "--json")
    arrow = cli("explain", str(tmp_path / "training.arrow"), str(tmp_path / "serving_aux_bug.arrow"), *args)
    h5 = cli("explain", str(S / "training.h5"), str(S / "serving_aux_bug.h5"), *args)
    assert arrow.returncode == 0 and arrow.stderr == "", arrow.stderr
    strip = {"a", "b"}
    assert {k: v for k, v in json.loads(arrow.stdout).items() if k not in strip} == \
        {k: v for k, v in json.loads(h5.stdout).items() if k not in strip}
