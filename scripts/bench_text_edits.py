"""Benchmark: what finding text edits (tracediff/diff/edits.py) adds to a compare's planning, on
unrelated chat traffic where every request leaves the other side's text after a shared system
prompt (the case that examines every request), beside the planning pass it rides on.

Both are timed in this process on the same token tables: ``departures`` (which compare's planning
computes anyway, per side) as the baseline, then ``text_edit`` given its result, as compare calls
it. Medians of ``--reps`` runs; the sizes are requests x tokens per request on each side.

Usage: python scripts/bench_text_edits.py [--reps 3] [--out result.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
from benchio import emit

from tracediff.diff.align import Prefixes, _prefix_hashes, departures
from tracediff.diff.edits import text_edit
from tracediff.diff.pair import Pair

SYSTEM = 50  # tokens of the system prompt every request starts with
SIZES = ((1000, 300), (5000, 300), (20000, 200))


def traffic(requests: int, length: int, seed: int) -> Prefixes:
    """``requests`` texts of ``length`` tokens: one system prompt, then each its own random text."""
    rng = np.random.default_rng(seed)
    system = np.random.default_rng(0).integers(0, 32000, SYSTEM)
    texts = [np.r_[system, rng.integers(0, 32000, length - SYSTEM)] for _ in range(requests)]
    tokens = np.concatenate(texts)
    code, position = np.repeat(np.arange(requests), length), np.tile(np.arange(length), requests)
    stride = length + 2
    return Prefixes(names={i: f"r{i}" for i in range(requests)}, stride=stride,
                    where=code * stride + position, ids=_prefix_hashes(code, position, tokens), tokens=tokens)


def median_seconds(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for requests, length in SIZES:
        pair = Pair(traffic(requests, length, 1), traffic(requests, length, 2))
        gone = Pair(departures(pair.a, pair.b), departures(pair.b, pair.a))  # as compare's plan holds them
        both_ways = partial(lambda p: (departures(p.a, p.b), departures(p.b, p.a)), pair)
        baseline = median_seconds(both_ways, args.reps)
        edits = median_seconds(partial(text_edit, pair, gone), args.reps)
        assert text_edit(pair, gone) is None  # unrelated traffic holds no edit
        rows.append({"requests": requests, "tokens_per_request": length, "departures_s": round(baseline, 3),
                     "text_edit_s": round(edits, 3), "ratio": round(edits / baseline, 2)})
    return emit({"bench": "text_edits", "sizes": rows}, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
