"""The vocab map helpers: offset semantics, validation, and each known misuse named."""

from __future__ import annotations

import numpy as np
import pytest

from tracediff.eagle3.vocab import build_vocab_map, check_vocab_map, draft_to_target, infer_mapping

V, VD = 100, 20


@pytest.fixture
def healthy() -> tuple[np.ndarray, np.ndarray]:
    counts = np.random.default_rng(0).integers(0, 1000, V)
    return build_vocab_map(counts, VD)


def codes(findings) -> list[str]:
    return [f.code for f in findings]


def test_build_keeps_most_frequent_in_id_order() -> None:
    counts = np.zeros(V, dtype=np.int64)
    counts[[5, 3, 90, 41]] = [10, 30, 20, 20]
    d2t, t2d = build_vocab_map(counts, 3)
    assert np.flatnonzero(t2d).tolist() == [3, 41, 90]  # token 5 (count 10) is dropped
    assert d2t.tolist() == [3, 40, 88]
    assert draft_to_target(np.array([0, 1, 2]), d2t).tolist() == [3, 41, 90]


def test_healthy_map_has_no_findings(healthy) -> None:
    d2t, t2d = healthy
    assert check_vocab_map(d2t, t2d, V) == []
    assert (np.arange(VD) + d2t == np.flatnonzero(t2d)).all()


@pytest.mark.parametrize(("make", "code"), [
    (lambda d2t, t2d: (None, t2d), "d2t_missing"),
    (lambda d2t, t2d: (np.zeros_like(d2t), t2d), "d2t_zero"),
    (lambda d2t, t2d: (np.arange(VD), t2d), "d2t_arange"),
    (lambda d2t, t2d: (np.arange(VD) + d2t, t2d), "d2t_holds_ids"),
    (lambda d2t, t2d: (d2t[::-1].copy(), t2d), "d2t_not_monotone"),
    (lambda d2t, t2d: (d2t + V, t2d), "d2t_out_of_range"),
    (lambda d2t, t2d: (d2t, np.roll(t2d, 1)), "t2d_inconsistent"),
    (lambda d2t, t2d: (d2t, None), "t2d_missing"),
])
def test_each_misuse_is_named(healthy, make, code) -> None:
    d2t, t2d = make(*healthy)
    assert code in codes(check_vocab_map(d2t, t2d, V))


def test_infer_mapping_tells_offset_from_direct(healthy) -> None:
    d2t, _ = healthy
    draft = np.array([0, 1, 5, 19])
    assert infer_mapping(draft, draft_to_target(draft, d2t), d2t) == "offset"
    assert infer_mapping(draft, d2t[draft], d2t) == "direct"
    assert infer_mapping(draft, draft, d2t) == "unknown"
