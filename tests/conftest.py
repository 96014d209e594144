"""Shared fixtures: small real inputs, real files, a tiny real HF Llama model."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

# SpecForge wraps its RMSNorm in torch.compile: 30 s cold on CPU, and nothing to gain in tests.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

REPO = Path(__file__).resolve().parents[1]
FORMATS = ("h5", "arrow")


@pytest.fixture(params=FORMATS)
def fmt(request: pytest.FixtureRequest) -> str:
    return request.param


def run_python(code: str, *args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a snippet in a fresh interpreter (recorders in other processes, crashes, limits)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], env=full_env, capture_output=True, text=True,
                          timeout=120, **kw)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The real console entry point, as a user runs it: for promises about the process (exit codes of
    signals and kills, no traceback where Python itself would print one, a closed pipe)."""
    return run_python("from tracediff.cli import main; main()", *args)


@dataclass(frozen=True)
class CliResult:
    """What a command left: its exit code, stdout and stderr (the fields of ``run_cli``'s result)."""

    returncode: int
    stdout: str
    stderr: str


class _Stderr(logging.Handler):
    """Python's last-resort handler, which pytest's own handlers stand in for: the message on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def cli(*args: str) -> CliResult:
    """The CLI in this process (typer's runner): no interpreter start, so the inner loop stays fast.
    Its stderr holds what a fresh interpreter's would: the tracediff logger's warnings, and Python's
    warnings under Python's default filters (after the command's own output). An exception the command
    lets escape is raised here and fails the test with its traceback, as the real entry point would
    print it."""
    from typer.testing import CliRunner

    from tracediff.cli import app

    handler, tracediff_logger = _Stderr(logging.WARNING), logging.getLogger("tracediff")
    tracediff_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            done = CliRunner().invoke(app, list(args), prog_name="tracediff", catch_exceptions=False)
    finally:
        tracediff_logger.removeHandler(handler)
    shown = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught]
    return CliResult(done.exit_code, done.stdout, done.stderr + "".join(shown))


def tiny_llama(seed: int = 0, layers: int = 4):
    """A tiny HF Llama built from a config with a fixed seed (nothing downloaded)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_eagle3():
    """(target, draft): a tiny Llama target and an EAGLE-3 draft on it with a real d2t/t2d built from
    fixed token counts; aux ids (1, 2, 3) in the draft config."""
    torch = pytest.importorskip("torch")
    from tracediff.eagle3.config import DraftConfig
    from tracediff.eagle3.draft import Eagle3Draft
    from tracediff.eagle3.vocab import build_vocab_map

    target = tiny_llama(seed=0, layers=4)
    torch.manual_seed(3)
    config = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=512, draft_vocab_size=384, max_position_embeddings=128,
                         aux_layer_ids=(1, 2, 3))
    draft = Eagle3Draft(config, embed_tokens=target.model.embed_tokens.weight.detach())
    d2t, t2d = build_vocab_map(np.random.default_rng(0).integers(0, 100, 512), 384)
    draft.d2t.copy_(torch.from_numpy(d2t))
    draft.t2d.copy_(torch.from_numpy(t2d))
    return target, draft.eval()


def step_tensor(step: int, shape=(16, 32)) -> np.ndarray:
    """Deterministic per-step values, so a reader can check what a (killed) writer logged."""
    return np.random.default_rng(step).standard_normal(shape).astype(np.float32)


STARTED_EARLY: dict[Callable[[], subprocess.Popen], subprocess.Popen] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a ``start_early`` test run first (order kept otherwise): under pytest-xdist its
    long job then starts at once on one worker while the other takes the rest of the suite, instead
    of holding the run's last minutes alone (in one process the job is started in the background
    when collection ends, and its test is best left where it is)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    early = {item.path for item in items if item.get_closest_marker("start_early")}
    items.sort(key=lambda item: item.path not in early)


def pytest_collection_finish(session: pytest.Session) -> None:
    """``@pytest.mark.start_early(start=f)`` on a test: ``f()`` (which returns the process it started)
    runs once collection is done, when that test is selected. A long job in a process of its own (the
    sample generator's training) then runs on another core while the suite goes on, and its test only
    waits for it; one the run ends before is killed."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under pytest-xdist every worker collects every test: the job's test starts it itself
    for item in session.items:
        for mark in item.iter_markers("start_early"):
            if mark.kwargs["start"] not in STARTED_EARLY:
                STARTED_EARLY[mark.kwargs["start"]] = mark.kwargs["start"]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With TRACEDIFF_NO_SKIPS=1 (the README's test command, CI) a skipped test fails the run: there,
    every optional part (torch, SGLang, SpecForge) is installed, and a skip would hide a test that
    did not run. A process started early that still runs (its test never came) is killed first."""
    for process in STARTED_EARLY.values():
        if process.poll() is None:
            process.kill()
            process.wait()
    if os.environ.get("TRACEDIFF_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"TRACEDIFF_NO_SKIPS=1: {len(skipped)} tests skipped; every test must run here",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
