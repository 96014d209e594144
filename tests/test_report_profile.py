"""The report's data for pictures: each tensor's error per (depth, position cell), and the tokens each
side was fed around where they first differ. Renderers draw these; they never re-run the compare."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tracediff as td
from tracediff.diff.profile import MAX_CELLS
from tracediff.diff.tokenview import MAX_TOKENS


def hidden(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def tensor(report, name):
    return next(t for t in report.tensors if t.name == name)


def test_the_profile_holds_each_cells_rows_failures_and_worst_error(tmp_path) -> None:
    h = hidden(6)
    bad = h.copy()
    bad[4] = -bad[4]  # cosine -1 at position 4
    bad[5, 0] = np.nan
    for side, rows in (("a", h), ("b", bad)):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", rows, token_ids=np.arange(6), request="r")
            rec.log("t", np.arange(6), token_ids=np.arange(6), request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    p = tensor(report, "h").profile
    assert p is not None
    assert (p.bucket, p.depth, p.position) == (1, [0] * 6, list(range(6)))
    assert (p.rows, p.failed) == ([1] * 6, [0, 0, 0, 0, 1, 1])
    assert p.cosine[4] == pytest.approx(-1.0) and math.isnan(p.rel_l2[5]) and p.rel_l2[0] == 0.0
    ints = tensor(report, "t").profile
    assert ints is not None and ints.cosine == [None] * 6 and ints.failed == [0] * 6


def test_a_long_tensor_is_binned_into_at_most_max_cells_per_depth(tmp_path) -> None:
    n = 3 * MAX_CELLS + 5
    for side in ("a", "b"):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", hidden(n), token_ids=np.arange(n) % 50, request="r")
    p = tensor(td.compare(tmp_path / "a.h5", tmp_path / "b.h5"), "h").profile
    assert p is not None and p.bucket == 4 and len(p.position) <= MAX_CELLS
    assert sum(p.rows) == n and p.position[:3] == [0, 4, 8]


def test_the_token_view_centers_on_the_first_differing_token(tmp_path) -> None:
    tokens = np.arange(400) % 97
    other = tokens.copy()
    other[300] = 5
    for side, ids in (("a", tokens), ("b", other)):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", hidden(400), token_ids=ids, request=f"{side}-req")
    view = td.compare(tmp_path / "a.h5", tmp_path / "b.h5").tokens
    assert view is not None and (view.request_a, view.request_b) == ("a-req", "b-req")
    assert view.first_difference == 300 and view.start == 300 - MAX_TOKENS // 2
    assert len(view.tokens_a) == len(view.tokens_b) == MAX_TOKENS
    at = 300 - view.start
    assert (view.tokens_a[at], view.tokens_b[at]) == (300 % 97, 5)


def test_the_token_view_shows_the_first_divergences_tokens_when_tokens_agree(tmp_path) -> None:
    h = hidden(10)
    bad = h.copy()
    bad[7] += 1
    for side, rows in (("a", h), ("b", bad)):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", rows, token_ids=np.arange(10) + 3, request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    view = report.tokens
    assert view is not None and (view.first_difference, view.focus, view.start) == (None, 7, 0)
    assert view.tokens_a == view.tokens_b == list(range(3, 13))
    assert td.compare(tmp_path / "a.h5", tmp_path / "a.h5").tokens is None  # nothing to point at


def test_a_static_first_divergence_has_no_token_view(tmp_path) -> None:
    for side, offset in (("a", 0), ("b", 1)):
        with td.record(tmp_path / f"{side}.h5") as rec:
            rec.log("h", hidden(4), token_ids=np.arange(4), request="r")
            rec.log_static("draft.d2t", np.arange(8) + offset)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.first_divergence is not None and report.first_divergence.name == "draft.d2t"
    assert report.tokens is None
