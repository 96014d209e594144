"""Benchmark: how replay and explain scale with the trace, against side-by-side baselines.

  memory    peak traced memory (tracemalloc: numpy and Python allocations) of ``replay`` and of
            ``explain_traces`` (the trace against itself), next to reading the fc input whole
            (``Trace.rows("draft.fc_in")``: what holding every tensor row costs), at growing numbers
            of requests of 16 rows with a fc row of 12 KiB (3 x 1024 float32: a small model's)
  pairing   ``longest_agreements`` (a trie of the texts) against the greedy over every pair it
            equals, on chat texts: one system prompt, conversations of several turns sharing their
            first turns, each text on both sides

Usage: python scripts/bench_explain_scale.py [--requests 16,64,256] [--pairing 100,400] [--out scale.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tracediff/ from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchio import emit  # noqa: E402

import tracediff as td  # noqa: E402
from testbed.scale import greedy_pairs, traced_peak, wide_draft, write_wide_trace  # noqa: E402
from tracediff.eagle3.explain import explain_traces, longest_agreements  # noqa: E402
from tracediff.eagle3.replay import replay  # noqa: E402


def chat_texts(n: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    system = tuple(rng.integers(0, 1000, 40).tolist())
    turns = [tuple(rng.integers(0, 1000, 30).tolist()) for _ in range(max(2, n // 4))]
    return [system + sum((turns[k] for k in rng.integers(0, len(turns), rng.integers(1, 4))), ())
            for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="16,64,256")
    parser.add_argument("--pairing", default="100,400")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    draft = wide_draft()
    result: dict = {"memory": [], "pairing": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.requests.split(",")):
            path = Path(tmp) / f"t{n}.h5"
            fc_bytes = write_wide_trace(path, n)
            with td.open_trace(path) as a, td.open_trace(path) as b:
                whole = traced_peak(lambda: a.rows("draft.fc_in"))
                replayed = traced_peak(lambda: replay(a, draft, depths=2))
                explained = traced_peak(lambda: explain_traces(a, b, {"a": draft, "b": draft}, depths=2))
            result["memory"].append({"requests": n, "fc_input_mb": fc_bytes / 1e6,
                                     "read_whole_mb": whole / 1e6,
                                     "replay_mb": replayed / 1e6, "explain_mb": explained / 1e6,
                                     "explain_share_of_fc": explained / fc_bytes})
    rng = np.random.default_rng(0)
    for n in (int(x) for x in args.pairing.split(",")):
        texts = chat_texts(n, rng)
        started = time.perf_counter()
        found = longest_agreements(texts, list(texts))
        trie = time.perf_counter() - started
        started = time.perf_counter()
        assert greedy_pairs(texts, list(texts)) == found
        every = time.perf_counter() - started
        result["pairing"].append({"requests": n, "trie_s": trie, "every_pair_s": every,
                                  "speedup": every / trie})
    return emit(result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
