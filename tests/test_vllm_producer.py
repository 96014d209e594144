"""tracediff/integrations/vllm/producer.py and plugin.py: which commands record through the vLLM plugin,
what `tracediff record` notes at their start, and that the entry point vLLM calls in every process does
nothing outside `tracediff record`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tracediff.integrations.vllm import plugin
from tracediff.integrations.vllm.producer import PRODUCER, SHUTDOWN, advise, runs_vllm
from tracediff.record.plugin import ENV, LaunchConfig


@pytest.mark.parametrize("command", [
    ["vllm", "serve", "Qwen/Qwen3-8B", "--speculative-config", "{}"],
    ["/opt/venv/bin/vllm", "serve", "m"],
    ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
    ["python", "-mvllm.entrypoints.launchers.api_server.entry", "--model", "m"],
])
def test_a_vllm_server_command_is_claimed(command: list[str]) -> None:
    assert runs_vllm(command)
    assert PRODUCER.claims(LaunchConfig(out="x.h5", plugins=()), command)


@pytest.mark.parametrize("command", [["python", "train.py"], ["python", "-m", "sglang.launch_server"],
                                     ["vllm-bench", "serve"], ["python", "serve_vllm.py"]])
def test_other_commands_are_not(command: list[str]) -> None:
    assert not runs_vllm(command)


def test_a_server_without_a_shutdown_grace_period_is_noted_at_start() -> None:
    config = LaunchConfig(out="x.h5", plugins=(PRODUCER.plugin,))
    assert advise(config, ["vllm", "serve", "m"]) == SHUTDOWN
    assert advise(config, ["vllm", "serve", "m", "--shutdown-timeout", "30"]) is None
    assert advise(config, ["vllm", "serve", "m", "--shutdown-timeout=30"]) is None


def test_the_entry_point_attaches_nothing_outside_tracediff_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    before = set(sys.modules)
    plugin.register()
    assert plugin._plugin is None
    assert not {m for m in set(sys.modules) - before if m.startswith(("vllm", "torch", "tracediff.record"))}


def test_the_entry_point_is_declared_for_vllm() -> None:
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    declared = ('[project.entry-points."vllm.general_plugins"]\n'
                'tracediff = "tracediff.integrations.vllm.plugin:register"')
    assert declared in text
