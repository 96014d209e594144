"""How explain and replay scale: requests are paired as the greedy over every pair pairs them,
without comparing every pair, and a replay holds one request's (one pair's) tensor rows at a
time, so its memory does not grow with the traces' tensor bytes."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

import tracediff as td  # noqa: E402
from tracediff.eagle3.config import DraftConfig  # noqa: E402
from tracediff.eagle3.draft import Eagle3Draft  # noqa: E402
from tracediff.eagle3.explain import explain_traces, longest_agreements  # noqa: E402
from tracediff.eagle3.replay import replay  # noqa: E402


def greedy(texts_a: list[tuple[int, ...]], texts_b: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """The definition: every pair's common prefix, longest first (ties: lowest i, then j), one to one."""
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


@pytest.mark.parametrize("seed", range(40))
def test_pairing_is_the_greedy_over_every_pair(seed) -> None:
    """Chat traffic: a shared system prompt, conversations that part at different turns, repeats,
    a text that is a prefix of another, and texts of one side only."""
    rng = np.random.default_rng(seed)
    system = tuple(rng.integers(0, 3, rng.integers(0, 4)).tolist())

    def text() -> tuple[int, ...]:
        return system + tuple(rng.integers(0, 3, rng.integers(0, 6)).tolist())

    pool = [text() for _ in range(rng.integers(1, 8))]

    def side() -> list[tuple[int, ...]]:
        picks = rng.integers(0, len(pool), rng.integers(0, 9))
        return [pool[k] if rng.random() < 0.6 else text() for k in picks]

    texts_a, texts_b = side(), side()
    assert longest_agreements(texts_a, texts_b) == greedy(texts_a, texts_b)


def test_identical_texts_pair_in_order_and_a_text_sharing_nothing_stays_unpaired() -> None:
    same = (5, 6, 7)
    assert longest_agreements([same, same, (9,)], [same, (1, 2), same]) == [(0, 0, 3), (1, 2, 3)]


WIDTH = 3 * 1024  # a fc row of 12 KiB (float32): tensor bytes dominate, as on a real model's trace


def wide_draft() -> Eagle3Draft:
    torch.manual_seed(0)
    config = DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                         vocab_size=64, draft_vocab_size=None, target_hidden_size=1024)
    return Eagle3Draft(config, torch.randn(64, 32))


def write(path, requests: int, rows: int = 16) -> int:
    """A training-like trace: ``requests`` requests of ``rows`` rows; returns its fc input's bytes."""
    rng = np.random.default_rng(requests)
    with td.record(path, source="training") as rec:
        for r in range(requests):
            tokens = rng.integers(0, 64, rows + 1)
            where = {"request": f"r{r}", "positions": np.arange(rows), "token_ids": tokens[:rows]}
            rec.log("draft.fc_in", rng.standard_normal((rows, WIDTH)).astype(np.float32), **where)
            rec.log("target.token", tokens[1:], **where)
    return requests * rows * WIDTH * 4


def peak(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_replay_and_explain_hold_one_request_of_tensor_rows_at_a_time(tmp_path) -> None:
    """Four times the requests: the fc input grows by 3x its bytes, the peak by a small share of
    that (key columns and token ids, a few hundred bytes a row). Reading a tensor whole would
    add at least the 3x bytes it grew by."""
    draft = wide_draft()
    small, large = tmp_path / "small.h5", tmp_path / "large.h5"
    grown = write(large, 64) - write(small, 16)
    peaks = {}
    for name, path in (("small", small), ("large", large)):
        with td.open_trace(path) as a, td.open_trace(path) as b:
            peaks[name, "replay"] = peak(lambda: replay(a, draft, depths=2))
            peaks[name, "explain"] = peak(lambda: explain_traces(a, b, {"a": draft, "b": draft}, depths=2))
    for what in ("replay", "explain"):
        assert peaks["large", what] - peaks["small", what] < 0.1 * grown, (what, peaks, grown)
