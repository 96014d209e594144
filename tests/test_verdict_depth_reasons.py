"""diff/verdict.py's lines for draft depths no row was compared at (issue 36): the reason names the
cause that holds for most of the rows it counts, read on the side with fewer rows there (the rows
both sides drafted from), never the other side's rows the fewer never held."""

from __future__ import annotations

import numpy as np

import tracediff as td
from tests.test_compare_coverage import per_token

TEXT = list(range(100, 130))


def write(path, source: str, rows: range | list[int], fed) -> None:
    """Depth-0 draft rows at every position, depths 1-2 drafted from ``rows``, fed ``fed(p, d)``."""
    with td.record(path, source=source) as rec:
        rec.request_tokens("r", TEXT)
        before = np.array(TEXT[:-1])
        rec.log("draft.hidden", per_token(TEXT[1:]), token_ids=before, request="r",
                positions=np.arange(len(before)), depth=0)
        for p in rows:
            ids, at = np.array([TEXT[p]]), np.array([p])
            for d in (1, 2):
                rec.log("draft.input_ids", np.array([[fed(p, d)]]), token_ids=ids, request="r", positions=at,
                        depth=d)
                rec.log("draft.hidden", per_token([fed(p, d)], seed=d), token_ids=ids, request="r",
                        positions=at, depth=d)


def test_depths_drafted_from_other_tokens_say_so_though_ttt_holds_more_rows(tmp_path) -> None:
    """Training unrolls every row (104 depth 1-2 rows), serving drafted chains from 5 anchors, fed
    tokens its draft got wrong: the anchors' rows were fed other tokens on the two sides; training's
    other 84 rows are rows serving never drafted from, not why nothing was comparable."""
    write(tmp_path / "training.h5", "training", range(len(TEXT) - 4), lambda p, d: TEXT[p + 1 + d])
    write(tmp_path / "serving.h5", "serving", [4, 9, 14, 19, 24], lambda p, d: 999 + d)
    report = td.compare(tmp_path / "training.h5", tmp_path / "serving.h5")
    assert report.verdict == "incomplete"
    why = "the two sides drafted other tokens"
    assert report.reasons[-1] == f"depths 1-2: no row comparable (104 / 20 rows), {why}"
    deep = report.coverage.depths[1]
    assert deep.skipped_a["not_recorded"] > deep.skipped_a["fed_differs"]  # the majority of all rows
    swapped = td.compare(tmp_path / "serving.h5", tmp_path / "training.h5")
    assert swapped.reasons[-1] == f"depths 1-2: no row comparable (20 / 104 rows), {why}"
