"""No false or misplaced causes: each diagnosis names the cause the data shows and nothing else. One
test per case seen in a trial (issue 17): NaN propagation read as a wiring difference, a scale read
as a shift too, a single scaled row left unexplained, a shift confined to one row left unexplained,
a d2t holding ids blamed on the other side's reading, a vocab size difference called a hidden size."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from testbed.loop import Conventions  # noqa: E402
from tests.test_diagnoses import SPEC, compare, kinds, models, serve, training  # noqa: E402, F401 (fixtures)
from tracediff.diff.pair import Pair  # noqa: E402
from tracediff.eagle3.vocab import build_vocab_map  # noqa: E402

TOKENS = [3, 17, 250, 9, 88, 41, 7, 300, 12, 5, 99, 64]
AUX_KINDS = {"aux_layer_set", "aux_order", "layer_offset"}


def record_rows(path, name: str, rows: np.ndarray, **meta) -> None:
    with td.record(path, **meta) as rec:
        rec.log(name, rows, token_ids=TOKENS, request="x")


@pytest.mark.slow
def test_nan_propagated_into_aux_slots_is_not_a_wiring_difference(models, training, tmp_path) -> None:  # noqa: F811
    """Serving's target produces a NaN in layer 1 at one position; layer 2 carries it on, and both
    land in target.aux slots that hold exactly serving's own layer 1 and layer 2, NaN where they are
    NaN. The cause is the NaN, not the aux layer set."""
    target, _ = models

    def poison(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.shape[1] > 4:
            hidden[0, 4, 1] = float("nan")
        return out

    handle = target.model.layers[1].register_forward_hook(poison)
    try:
        serve(models, tmp_path / "serving.h5", Conventions(SPEC))
    finally:
        handle.remove()
    code, report = compare(training, tmp_path / "serving.h5")
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert code == 1 and report["first_divergence"]["name"] == "target.layer.1"
    assert statuses["target.aux"] == "downstream"
    nan = next(d for d in report["diagnoses"] if d["kind"] == "nan_inf")
    assert (nan["evidence"]["tensor"], nan["evidence"]["side"]) == ("target.layer.1", "b")
    assert not AUX_KINDS & set(kinds(report)), report["diagnoses"]


def test_scaled_rows_of_one_direction_are_a_scale_not_a_shift(tmp_path) -> None:
    """Rows that all point one way, shrinking by 1.5 per position; one side is 1.5 x the other. Its
    row at p + 1 then equals the other's at p too, but a constant factor explains every row at its
    own position: the scale is the cause, a shift is not claimed."""
    direction = np.random.default_rng(0).standard_normal(16)
    rows = (1.5 ** -np.arange(len(TOKENS)))[:, None] * direction
    record_rows(tmp_path / "a.h5", "target.layer.0", rows.astype(np.float32))
    record_rows(tmp_path / "b.h5", "target.layer.0", (1.5 * rows).astype(np.float32))
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and kinds(report) == ["scale"], report["diagnoses"]
    assert report["diagnoses"][0]["evidence"]["norm_ratio_b_over_a"] == pytest.approx(1.5, rel=1e-6)


def test_a_single_scaled_row_is_a_scale(tmp_path) -> None:
    rows = np.random.default_rng(1).standard_normal((len(TOKENS), 16)).astype(np.float32)
    scaled = rows.copy()
    scaled[5] *= 1.5
    record_rows(tmp_path / "a.h5", "target.layer.0", rows)
    record_rows(tmp_path / "b.h5", "target.layer.0", scaled)
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and report["first_divergence"]["row"]["position"] == 5
    assert kinds(report) == ["scale"], report["diagnoses"]
    evidence = report["diagnoses"][0]["evidence"]
    assert evidence["rows_checked"] == 1 and evidence["norm_ratio_b_over_a"] == pytest.approx(1.5, rel=1e-6)


def test_a_shift_confined_to_one_row_is_named(tmp_path) -> None:
    """A chunk boundary: serving feeds row 4 its own token x[4] instead of the next one x[5]; every
    other row is right. Serving's failing row holds what training holds one position earlier."""
    tokens = [5, 61, 7, 80, 9, 33, 12, 40, 2, 71]
    rows = list(range(len(tokens) - 1))
    for name, boundary in (("a", None), ("b", 4)):
        fed = [tokens[t + 1] for t in rows]
        if boundary is not None:
            fed[boundary] = tokens[boundary]
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.request_tokens("r", tokens)
            rec.log("draft.input_ids", np.array(fed), token_ids=[tokens[t] for t in rows], positions=rows,
                    request="r", depth=0)
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and report["first_divergence"]["row"]["position"] == 4
    assert kinds(report) == ["position_shift"], report["diagnoses"]
    evidence = report["diagnoses"][0]["evidence"]
    assert (evidence["shift"], evidence["rows_checked"]) == (1, 1)
    assert "b at position p+1 equals a at position p" in report["diagnoses"][0]["message"]


V, VD = 100, 20
DRAFT_IDS = np.array([0, 1, 2, 3, 5, 8, 13, 19, 4, 7, 11, 6])


def record_vocab(path, d2t: np.ndarray, t2d: np.ndarray, source: str) -> None:
    """A side that maps draft ids with its own recorded d2t, read as offsets (both contracts say so)."""
    with td.record(path, source=source, meta={"d2t_reading": "offset"}) as rec:
        rec.log_static("draft.d2t", d2t)
        rec.log_static("draft.t2d", t2d)
        keys = dict(token_ids=TOKENS, request="x", depth=0)
        rec.log("draft.token", DRAFT_IDS, **keys)
        rec.log("draft.token_target", DRAFT_IDS + d2t[DRAFT_IDS], **keys)


def test_a_d2t_holding_target_ids_names_the_side_whose_table_is_wrong(tmp_path) -> None:
    """Serving's checkpoint stores d2t as target ids (kept ids, not offsets); serving adds arange
    again. Both read offsets: one diagnosis, naming serving's table as the wrong one."""
    d2t, t2d = build_vocab_map(np.random.default_rng(0).integers(0, 1000, V), VD)
    record_vocab(tmp_path / "a.h5", d2t, t2d, "training")
    record_vocab(tmp_path / "b.h5", np.arange(VD) + d2t, t2d, "serving")
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert code == 1 and report["first_divergence"]["name"] == "draft.token_target"
    [found] = report["diagnoses"]
    assert found["kind"] == "vocab_map" and "direct map" not in found["message"]
    assert found["evidence"]["wrong_side"] == "b" and found["evidence"]["problem"] == "d2t_holds_ids"
    assert "serving's d2t holds target ids, not offsets" in found["message"]


def test_a_vocab_size_difference_is_named_as_such(tmp_path) -> None:
    """The sides carry vocab maps of other sizes (a draft vocab of 20 and one of 24 over a target
    vocab of 100 and of 120): the statics' notes and the diagnosis name vocab sizes, not a hidden size."""
    counts = Pair(*(np.random.default_rng(seed).integers(0, 1000, size)
                    for seed, size in ((0, V), (1, V + 20))))
    record_vocab(tmp_path / "a.h5", *build_vocab_map(counts.a, VD), "training")
    record_vocab(tmp_path / "b.h5", *build_vocab_map(counts.b, VD + 4), "serving")
    code, report = compare(tmp_path / "a.h5", tmp_path / "b.h5")
    notes = {t["name"]: t["note"] for t in report["tensors"]}
    assert "draft vocab size" in notes["draft.d2t"] and "target vocab size" in notes["draft.t2d"]
    assert "hidden size" not in notes["draft.d2t"] + notes["draft.t2d"]
    [found] = report["diagnoses"]
    assert found["kind"] == "vocab_map" and "draft vocab size differs" in found["message"]
    assert (found["evidence"]["size_a"], found["evidence"]["size_b"]) == (VD, VD + 4)
