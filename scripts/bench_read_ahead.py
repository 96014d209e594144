"""Benchmark: a cold open plus every key read of a ~1 GB Arrow trace of the issue-21 set, with the
reader's key read-ahead (``ArrowTraceFile._read_ahead_keys``, from the file's footer) and without
it, side by side: interleaved rep by rep, page cache dropped before each, medians reported.

Both variants run in this one process on the same file; "without" replaces the read-ahead by a
no-op, which is the reader as it was before it. What is timed: ``open_trace`` and
``read_keys_many`` of every record of the file (what compare's planning reads first).

Usage: python scripts/bench_read_ahead.py [--steps 390] [--reps 5] [--dir /tmp/bench_read_ahead]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_compare import TOKENS, WIDTHS
from bench_trace import drop_cache

import tracediff as td
from tracediff.trace.arrow import ArrowTraceFile


def write_trace(path: Path, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    pool = {name: torch.randn(TOKENS, width, generator=generator).to(dtype)
            for name, (width, dtype) in WIDTHS.items()}
    tokens = np.random.default_rng(0).integers(0, 32000, (TOKENS, steps))
    with td.record(path, source="bench", on_full="block", block_timeout=60) as rec:
        for step in range(steps):
            for name, rows in pool.items():
                rec.log(name, torch.roll(rows, shifts=step * 7, dims=1), step=step,
                        request=[f"r{i}" for i in range(TOKENS)], positions=[step] * TOKENS,
                        token_ids=tokens[:, step])


def cold_keys(path: Path) -> float:
    drop_cache(path)
    start = time.perf_counter()
    with td.open_trace(path) as trace:
        for file in trace.files:
            file.read_keys_many(np.arange(len(file.index), dtype=np.int64))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=390)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_read_ahead"))
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    path = args.dir / "a.arrow"
    write_trace(path, args.steps)
    read_ahead = ArrowTraceFile._read_ahead_keys
    variants = {"with read-ahead": read_ahead, "without": lambda self: None}
    cold_keys(path)  # imports and first-call costs out of the timed runs
    runs: dict[str, list[float]] = {label: [] for label in variants}
    try:
        for _ in range(args.reps):
            for label, method in variants.items():
                ArrowTraceFile._read_ahead_keys = method  # type: ignore[method-assign]
                runs[label].append(cold_keys(path))
    finally:
        ArrowTraceFile._read_ahead_keys = read_ahead  # type: ignore[method-assign]
    median = {label: statistics.median(seconds) for label, seconds in runs.items()}
    print(f"{path.stat().st_size / 1e9:.2f} GB, {args.reps} reps, cold open + every key read:")
    for label, seconds in runs.items():
        print(f"  {label:16} median {median[label]:.3f} s  ({', '.join(f'{s:.3f}' for s in seconds)})")
    print(f"  without / with: {median['without'] / median['with read-ahead']:.2f}x")
    shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
