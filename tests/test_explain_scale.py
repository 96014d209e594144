"""How explain and replay scale: requests are paired as the greedy over every pair pairs them,
without comparing every pair, and a replay holds one request's (one pair's) tensor rows at a
time, so its memory does not grow with the traces' tensor bytes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.scale import greedy_pairs, traced_peak, wide_draft, write_wide_trace  # noqa: E402
from tracediff.eagle3.explain import explain_traces, longest_agreements  # noqa: E402
from tracediff.eagle3.replay import replay  # noqa: E402


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
    assert longest_agreements(texts_a, texts_b) == greedy_pairs(texts_a, texts_b)


def test_identical_texts_pair_in_order_and_a_text_sharing_nothing_stays_unpaired() -> None:
    same = (5, 6, 7)
    assert longest_agreements([same, same, (9,)], [same, (1, 2), same]) == [(0, 0, 3), (1, 2, 3)]


@pytest.mark.slow
def test_replay_and_explain_hold_one_request_of_tensor_rows_at_a_time(tmp_path) -> None:
    """Four times the requests: the fc input grows by 3x its bytes, the peak by a small share of
    that (key columns and token ids, a few hundred bytes a row). Reading a tensor whole would
    add at least the 3x bytes it grew by."""
    draft = wide_draft()
    small, large = tmp_path / "small.h5", tmp_path / "large.h5"
    grown = write_wide_trace(large, 64) - write_wide_trace(small, 16)
    peaks = {}
    for name, path in (("small", small), ("large", large)):
        with td.open_trace(path) as a, td.open_trace(path) as b:
            peaks[name, "replay"] = traced_peak(lambda: replay(a, draft, depths=2))
            peaks[name, "explain"] = traced_peak(lambda: explain_traces(a, b, {"a": draft, "b": draft},
                                                                        depths=2))
    for what in ("replay", "explain"):
        assert peaks["large", what] - peaks["small", what] < 0.1 * grown, (what, peaks, grown)
