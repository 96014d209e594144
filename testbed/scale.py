"""Scaffolding for how replay and explain scale (tests/test_explain_scale.py and
scripts/bench_explain_scale.py share it): a draft whose fc row is wide enough that tensor bytes
dominate a trace, such traces, a traced-memory peak, and the every-pair greedy pairing defined.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import tracediff as td
from tracediff.eagle3.config import DraftConfig
from tracediff.eagle3.draft import Eagle3Draft

WIDTH = 3 * 1024  # a fc row of 12 KiB (float32): tensor bytes dominate, as on a real model's trace
ROWS = 16  # rows a request


def wide_draft(seed: int = 0) -> Eagle3Draft:
    """A tiny draft (vocab 64) whose fc takes WIDTH: three slots of a 1024-wide target."""
    torch.manual_seed(seed)
    config = DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                         vocab_size=64, draft_vocab_size=None, target_hidden_size=1024)
    return Eagle3Draft(config, torch.randn(64, 32))


def write_wide_trace(path: str | Path, requests: int, rows: int = ROWS) -> int:
    """A training-like trace of ``requests`` requests of ``rows`` rows (fc input and target tokens);
    returns its fc input's bytes."""
    rng = np.random.default_rng(requests)
    with td.record(path, source="training") as rec:
        for r in range(requests):
            tokens = rng.integers(0, 64, rows + 1)
            where = {"request": f"r{r}", "positions": np.arange(rows), "token_ids": tokens[:rows]}
            rec.log("draft.fc_in", rng.standard_normal((rows, WIDTH)).astype(np.float32), **where)
            rec.log("target.token", tokens[1:], **where)
    return requests * rows * WIDTH * 4


def traced_peak(run: Callable[[], object]) -> int:
    """Peak bytes tracemalloc sees (numpy and Python allocations) while ``run`` runs."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def greedy_pairs(texts_a: list[tuple[int, ...]],
                 texts_b: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """The definition ``longest_agreements`` meets: every pair's common prefix, longest first (ties:
    lowest i, then j), one to one, pairs that share nothing left out."""
    def common(x: tuple[int, ...], y: tuple[int, ...]) -> int:
        return next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))

    every = itertools.product(enumerate(texts_a), enumerate(texts_b))
    candidates = sorted(((common(x, y), i, j) for (i, x), (j, y) in every), key=lambda c: (-c[0], c[1], c[2]))
    taken_a, taken_b, out = set(), set(), []
    for shared, i, j in candidates:
        if shared and i not in taken_a and j not in taken_b:
            taken_a.add(i)
            taken_b.add(j)
            out.append((i, j, shared))
    return out
