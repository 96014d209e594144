"""``tracediff replay``'s chain: how many depths it unrolls (the trace's own, unless asked), and a
trace with no row to score is one error line, never a figure over 0 rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, cli
from tracediff.eagle3.replay import DEFAULT_DEPTHS, chain_depths

SAMPLES = REPO / "traces" / "eagle3"


def replay(trace: Path, *extra: str):
    return cli("replay", str(trace), "--draft", str(SAMPLES / "draft"), "--target", str(SAMPLES / "target"),
               *extra)


def test_the_chain_has_the_servers_num_steps() -> None:
    with td.open_trace(SAMPLES / "serving.h5") as trace:
        assert trace.contract["speculative_args"]["num_steps"] == 4
        assert chain_depths(trace) == (4, "the trace's speculative num_steps 4")
        assert chain_depths(trace, 2) == (2, "--depths")
    done = replay(SAMPLES / "serving.h5")
    assert done.returncode == 0, done.stderr
    assert "chain of 4, from the trace's speculative num_steps 4" in done.stdout


def test_without_num_steps_the_chain_is_as_deep_as_the_recorded_draft(tmp_path) -> None:
    path = tmp_path / "t.h5"
    with td.record(path, source="training") as rec:
        for depth in range(3):
            rec.log("draft.hidden", np.ones((2, 4), np.float32), request="r", positions=[0, 1],
                    token_ids=[1, 2],
                    depth=depth)
    with td.open_trace(path) as trace:
        assert chain_depths(trace) == (3, "the trace's recorded draft depths 0-2")
    with td.record(tmp_path / "bare.h5", source="training") as rec:
        rec.log("target.token", np.arange(2), request="r", positions=[0, 1], token_ids=[1, 2])
    with td.open_trace(tmp_path / "bare.h5") as trace:
        assert chain_depths(trace).depths == DEFAULT_DEPTHS


def test_a_trace_with_no_row_to_score_is_one_error_line(tmp_path) -> None:
    """The fc input rows and the target tokens share no request: replay cannot score anything."""
    with td.open_trace(SAMPLES / "serving.h5") as sample:
        fc_in = sample.rows("draft.fc_in", depth=0)
        width = fc_in.data.shape[1]
    path = tmp_path / "unscorable.h5"
    with td.record(path, source="training") as rec:
        rec.log("draft.fc_in", np.zeros((4, width), np.float32), request="a", positions=np.arange(4),
                token_ids=[1, 2, 3, 4])
        rec.log("target.token", np.arange(4), request="b", positions=np.arange(4), token_ids=[1, 2, 3, 4])
    done = replay(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {path}: replay has no row to score: no row of recorded draft.fc_in has the target's token "
        "at its next position recorded (target.token); a training trace needs them recorded too"]
    assert "nan" not in done.stdout


@pytest.mark.parametrize("depths", ["0", "-1"])
def test_depths_below_one_are_refused(tmp_path, depths) -> None:
    shutil.copy(SAMPLES / "serving.h5", tmp_path / "s.h5")
    done = replay(tmp_path / "s.h5", "--depths", depths)
    assert done.returncode == 2 and "--depths" in done.stderr  # a usage error, in typer's words:
    assert "x>=1" in done.stderr or "greater than or equal to 1" in done.stderr, done.stderr


def test_a_serving_trace_is_scored_on_the_chains_its_server_drafted() -> None:
    """The sample's server drafted from the last row of each forward (its verify steps): replay's
    figure is those chains' accept length, chain for chain the one the server's verify recorded, over
    the chains whose every depth has a recorded target token (the text reaches their last depth),
    whatever their outcome: the chains near the text's end are left out, not only the long ones."""
    import json

    done = replay(SAMPLES / "serving.h5", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    with td.open_trace(SAMPLES / "serving.h5") as trace:
        verify = trace.rows("verify.accept_len")
        targets = trace.rows("target.token")
    accepted = verify.numpy()
    # depth d of the chain from row t drafts the target's token at t+1+d: recorded through t+4
    last = {request: max(targets.position[targets.request == request]) for request in set(verify.request)}
    scorable = np.array([position + 4 <= last[request]
                         for request, position in zip(verify.request, verify.position)])
    assert report["scored_on"] == "the server's chains"
    assert (report["chains"], report["chains_unscored"]) == (int(scorable.sum()), 5)
    assert report["expected_accept_len"] == pytest.approx(1 + accepted[scorable].mean(), abs=1e-12)
    # the server's own figure, over the same chains: like compared with like
    assert report["verified_chains"] == report["chains"] and report["server_num_steps"] == 4
    assert report["verified_accept_len"] == pytest.approx(1 + accepted[scorable].mean(), abs=1e-12)
    longer = json.loads(replay(SAMPLES / "serving.h5", "--json", "--depths", "6").stdout)
    # a chain of 6 needs two more target tokens recorded after it: fewer chains, the verify's alike
    assert longer["verified_chains"] == longer["chains"] < report["chains"]
    text = " ".join(replay(SAMPLES / "serving.h5", "--depths", "6").stdout.split())
    assert "(a chain of 6: the server drafted 4, so not its figure)" in text
    assert report["every_row_chains"] > report["chains"]  # prompt rows too: another figure
    assert report["every_row_accept_len"] != pytest.approx(report["expected_accept_len"])


def test_a_training_trace_is_scored_on_every_row() -> None:
    import json

    report = json.loads(replay(SAMPLES / "training.h5", "--json").stdout)
    # each sample's last rows reach past its text with some depth (3 of 4 depths' tokens): unscored
    assert report["scored_on"] == "every row" and report["chains_unscored"] == 9
    assert report["expected_accept_len"] == report["every_row_accept_len"]
    assert report["chains"] == report["every_row_chains"] > 0


def test_the_self_check_reproduces_every_recorded_chain_of_a_healthy_trace() -> None:
    import json

    report = json.loads(replay(SAMPLES / "serving.h5", "--json").stdout)
    check = report["self_check"]
    with td.open_trace(SAMPLES / "serving.h5") as trace:
        served = len(trace.rows("verify.accept_len").position)
    assert check["chains"] == check["reproduced"] == served and check["first_departure"] is None
    assert check["hidden_max_rel"] < 1e-4
    text = replay(SAMPLES / "serving.h5").stdout
    assert f"replay reproduces all {served} recorded chains" in text


def test_the_self_check_names_where_a_draft_not_the_servers_leaves_the_recorded_chains(tmp_path) -> None:
    """The same weights with another rope_theta: replay leaves the recorded draft at the first
    depth, in draft.hidden, and says so; the figure is then not the server's."""
    import json

    draft = tmp_path / "draft"
    shutil.copytree(SAMPLES / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (draft / "config.json").write_text(json.dumps(config))
    done = cli("replay", str(SAMPLES / "serving.h5"), "--draft", str(draft), "--target",
               str(SAMPLES / "target"), "--json")
    check = json.loads(done.stdout)["self_check"]
    assert check["reproduced"] < check["chains"]
    left = check["first_departure"]
    assert (left["request"], left["depth"], left["tensor"]) == ("req0", 0, "draft.hidden")
    assert float(left["detail"].removeprefix("max_rel ")) > 1e-2
    assert check["suspect"] == ("the checkpoint's config.json is not the one the trace's producer ran: "
                                "rope_theta 500000.0 (the trace states 10000.0)")


def test_no_self_check_on_a_training_trace_or_another_fc_input() -> None:
    import json

    assert json.loads(replay(SAMPLES / "training.h5", "--json").stdout)["self_check"] is None
    assert json.loads(replay(SAMPLES / "serving_aux_bug.h5", "--json", "--aux", "embed,1,3").stdout)[
        "self_check"] is None
    bug = json.loads(replay(SAMPLES / "serving_aux_bug.h5", "--json").stdout)["self_check"]
    assert bug["first_departure"] is None  # the server computed the draft right, on the wrong inputs


def copy_with_contract(source: Path, path: Path, **contract) -> None:
    """The rows replay reads of ``source`` (depth-0 fc input and fed ids, chain rows, target
    tokens), written again under a contract with ``contract``'s keys."""
    with td.open_trace(source) as trace, td.record(path, meta={**trace.contract, **contract}) as rec:
        for name in ("draft.fc_in", "draft.input_ids", "draft.token", "target.token"):
            rows = trace.rows(name)
            for depth in sorted(set(rows.depth.tolist())):
                pick = rows.depth == depth
                rec.log(name, rows.numpy()[pick], request=rows.request[pick].tolist(),
                        positions=rows.position[pick], token_ids=rows.token_id[pick], depth=depth)


def test_a_server_that_drafted_trees_is_not_scored_as_chains(tmp_path) -> None:
    """topk > 1: a verify accepts a tree's best path, which replay does not score; the figure is
    every row's teacher-forced chain and the output says it is not the server's."""
    import json

    path = tmp_path / "tree.h5"
    copy_with_contract(SAMPLES / "serving.h5", path, speculative_args={
        "algorithm": "EAGLE3", "num_steps": 4, "topk": 4, "num_draft_tokens": 8})
    done = replay(path, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["scored_on"] == "every row" and report["self_check"] is None
    assert report["not_the_servers"].startswith("the server drafted trees (topk 4, 8 draft tokens)")
    assert report["expected_accept_len"] == report["every_row_accept_len"]
    text = replay(path)
    assert "not the server's figure: the server drafted trees (topk 4" in " ".join(text.stdout.split())
    chain = tmp_path / "chain.h5"  # the same rows under topk 1: the server's chains again
    copy_with_contract(SAMPLES / "serving.h5", chain)
    assert json.loads(replay(chain, "--json").stdout)["scored_on"] == "the server's chains"


def test_docs_replay_names_every_field_of_the_json() -> None:
    import dataclasses

    from tracediff.eagle3.replay import ReplayReport
    from tracediff.eagle3.selfcheck import Departure, SelfCheck

    doc = (REPO / "docs" / "REPLAY.md").read_text()
    for cls in (ReplayReport, SelfCheck):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc, f"{cls.__name__}.{f.name}"
    for f in dataclasses.fields(Departure):
        assert f"`{f.name}`" in doc, f"Departure.{f.name}"


@pytest.mark.parametrize(("extra", "said"), [
    (("--d2t", "ids"), "error: --d2t: unknown d2t reading 'ids': offset or direct"),
    (("--engine", "trtllm"), "error: --engine: unknown engine 'trtllm': one of sglang, specforge, vllm"),
    (("--aux", "embed,1,99"), "the trace holds no target.layer.99 (the fc input --aux rebuilds needs them)"),
])
def test_bad_options_are_one_error_line(extra, said) -> None:
    done = replay(SAMPLES / "serving.h5", *extra)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_an_output_that_names_no_trace_format_is_refused_before_the_replay(tmp_path) -> None:
    out = tmp_path / "replayed.bin"
    done = replay(SAMPLES / "serving.h5", "--out", str(out))
    assert done.returncode == 2 and done.stderr.startswith(f"error: {out}: cannot tell the trace format")
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_the_self_check_compares_the_target_tokens_the_figure_is_scored_on() -> None:
    """Read as a direct map, d2t sends the same drafts to other target tokens: the recorded
    draft.token_target is not reproduced, and the self-check says so."""
    import json

    report = json.loads(replay(SAMPLES / "serving.h5", "--d2t", "direct", "--json").stdout)
    left = report["self_check"]["first_departure"]
    assert report["self_check"]["reproduced"] == 0 and left["tensor"] == "draft.token_target"
    assert "the vocab map is read otherwise" in left["detail"]


def test_an_accuracy_over_no_rows_is_nan_in_strict_json_as_in_every_report() -> None:
    import json

    from tracediff.eagle3.replay import ReplayReport

    plain = ReplayReport(aux="x", requests=1, depth_accuracy=[0.5, float("nan")], depth_rows=[4, 0]).to_dict()
    assert plain["depth_accuracy"] == [0.5, "NaN"]
    json.dumps(plain, allow_nan=False)


@pytest.mark.parametrize(("contract", "engine"), [
    ({"producer_integration": "specforge"}, "specforge"),
    ({"sglang_version": "0.5.23"}, "sglang"),
    ({"speculative_args": {"num_steps": 3, "topk": 1}}, "sglang"),
    ({"draft_engine": "specforge", "speculative_args": {"num_steps": 3}}, "specforge"),
    ({}, None),
])
def test_the_engine_a_trace_states_picks_the_reading_replay_computes_with(tmp_path, contract, engine) -> None:
    from tracediff.eagle3.readings import READINGS, SPECFORGE, engine_choice

    with td.record(tmp_path / "t.h5", meta=contract) as rec:
        rec.log("target.token", np.arange(2), request="r", positions=[0, 1], token_ids=[1, 2])
    with td.open_trace(tmp_path / "t.h5") as trace:
        assert trace.engine == engine
        choice = engine_choice(trace.engine)
    assert choice.reading == READINGS[engine or SPECFORGE]
    assert choice.reason == ("the engine that recorded the trace" if engine else
                             "the trace names no engine: the trainer's reading")
    assert engine_choice(trace.engine, "sglang").reason == "--engine"


@pytest.mark.parametrize("reading", ["sglang", "specforge"])
def test_norms_a_checkpoint_lacks_are_unit_weights_only_where_the_engine_applies_them(tmp_path,
                                                                                     reading) -> None:
    """norm_before_fc without input_norm.weight: SGLang normalises with unit weights (and replay says
    so); SpecForge never applies the norm, and replay says nothing of it."""
    import json

    import torch

    from tracediff.eagle3.checkpoint import load_draft, target_embedding
    from tracediff.eagle3.readings import READINGS

    draft = tmp_path / "draft"
    shutil.copytree(SAMPLES / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    model = load_draft(draft, target_embedding(SAMPLES / "target"), reading=READINGS[reading])
    assert model.numerics.norm_before_fc == (reading == "sglang")
    assert torch.equal(model.input_norm.weight, torch.ones_like(model.input_norm.weight))
    if reading == "sglang":
        assert model.notes == ("config.json asks for norm_before_fc and the checkpoint has no "
                               "input_norm.weight: SGLang 0.5.23 normalises with unit weights, and so does "
                               "replay",)
    else:
        assert model.notes == ()


def test_the_library_call_returns_what_the_command_prints(tmp_path) -> None:
    """``td.replay`` is the command: the same report, and the same replayed trace written."""
    import json

    out = tmp_path / "replayed.h5"
    report = td.replay(SAMPLES / "serving.h5", SAMPLES / "draft", target=SAMPLES / "target", out=out)
    printed = json.loads(replay(SAMPLES / "serving.h5", "--json").stdout)
    assert isinstance(report, td.ReplayReport) and printed == json.loads(json.dumps(report.to_dict()))
    with td.open_trace(out) as written:
        assert written.meta["contract"]["replayed_trace"] == str(SAMPLES / "serving.h5")


def test_the_library_call_raises_bad_options_as_the_command_says_them() -> None:
    with pytest.raises(td.InputError) as bad:
        td.replay(SAMPLES / "serving.h5", SAMPLES / "draft", d2t="ids")
    assert (bad.value.path, bad.value.problem) == ("--d2t", "unknown d2t reading 'ids': offset or direct")
