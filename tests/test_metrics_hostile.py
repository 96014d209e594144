"""compare's numbers on hostile but legal data: values at float64's limits, a tensor stored in other
dtypes on the two sides, bounds on metrics a tensor lacks, a mapping file built to exhaust the
parser, and trace text that would act as markup in the report's messages."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
from rich.console import Console

import tracediff as td
from tests.conftest import cli
from tracediff.diff.metrics import COMPILED, NUMPY
from tracediff.diff.rename import read_mapping_file
from tracediff.report.compare import render


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 as a trace stores it (values chosen exact in bfloat16: truncation is rounding)."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write(path, tensors: dict[str, np.ndarray], source: str = "unknown") -> None:
    """One request of 4 tokens; each tensor one row per token."""
    with td.record(path, source=source) as rec:
        for name, rows in tensors.items():
            rec.log(name, rows, token_ids=np.arange(4), request="r")


def by_name(report) -> dict:
    return {t.name: t for t in report.tensors}


@pytest.mark.parametrize("engine", [NUMPY, COMPILED], ids=lambda e: e.name)
def test_float64_rows_at_the_limits_of_the_range_compare_by_their_values(engine) -> None:
    """Squares of 1e300 overflow and squares of 1e-300 vanish: equal rows must still be equal, and
    ratios (rel_l2, cosine, max_rel) those of the true values."""
    base = np.random.default_rng(0).standard_normal((1, 64))
    rows = np.concatenate([base * 1e300, base * 1e-300, base * 1e200, base / np.abs(base).max() * 1.7e308])
    same = engine.measure_rows("x", ("float64", "float64"), rows, rows.copy())
    assert (same["max_abs"] == 0).all() and (same["max_rel"] == 0).all() and (same["rel_l2"] == 0).all()
    assert np.allclose(same["cosine"], 1.0, rtol=0, atol=1e-15)
    off = engine.measure_rows("x.logits", ("float64", "float64"), rows, rows * (1 + 1e-3))
    np.testing.assert_allclose(off["rel_l2"], 1e-3, rtol=1e-9)
    np.testing.assert_allclose(off["max_rel"], 1e-3, rtol=1e-9)
    np.testing.assert_allclose(off["max_abs"][:3], np.abs(rows[:3]).max(axis=1) * 1e-3, rtol=1e-9)
    assert np.isfinite(off["kl"]).all() and (off["argmax_agree"] == 1).all()
    opposite = engine.measure_rows("x", ("float64", "float64"), rows[3:], -rows[3:])  # |a-b| > float64 max
    assert opposite["max_abs"][0] == np.inf and opposite["rel_l2"][0] == pytest.approx(2.0)
    assert opposite["cosine"][0] == pytest.approx(-1.0)


def test_huge_float64_traces_match_themselves_and_a_scaled_copy_is_named(tmp_path) -> None:
    rows = np.random.default_rng(1).standard_normal((4, 16)) * 1e300
    write(tmp_path / "a.h5", {"h": rows})
    write(tmp_path / "b.h5", {"h": rows.copy()})
    write(tmp_path / "c.h5", {"h": rows * 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow anywhere, diagnoses included
        report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
        scaled = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    assert report.verdict == "match" and by_name(report)["h"].worst["cosine"] == pytest.approx(1.0)
    assert scaled.verdict == "diverged" and [d.kind for d in scaled.diagnoses] == ["scale"]
    assert scaled.diagnoses[0].evidence.norm_ratio_b_over_a == pytest.approx(2.0)


def test_an_integer_side_is_compared_with_a_bfloat16_side_by_value() -> None:
    ints = np.arange(-16, 16, dtype=np.int64).reshape(4, 8)
    bits = bf16_bits(ints)  # the same values: raw bits they are not
    for engine in (NUMPY, COMPILED):
        got = engine.measure_rows("t", ("int64", "bfloat16"), ints, bits)
        assert (got["max_abs"] == 0).all() and (got["cosine"] == 1).all(), engine.name
    large = np.array([[2**40 + 1, -(2**40)]], np.int64)  # measured in float32, 2**40 + 1 would round
    rounded = np.float32([[2**40, -(2**40)]])
    assert NUMPY.measure_rows("t", ("int64", "float32"), large, rounded)["max_abs"][0] == 1
    widths = NUMPY.measure_rows("t", ("int8", "int64"), np.int8([[-1, 5]]), np.int64([[-1, 5]]))
    assert list(widths) == ["equal"] and widths["equal"].tolist() == [1.0]


def test_dtypes_that_differ_are_said_and_the_values_still_decide(tmp_path) -> None:
    """Another precision or integer width compares by value and says so in the note; an integer
    tensor against a float one is a dtype_mismatch (never a match, never the first divergence)
    whose note says whether the values agree."""
    rng = np.random.default_rng(2)
    hidden = (bf16_bits(rng.standard_normal((4, 8))).astype(np.uint32) << 16).view(np.float32)  # bf16-exact
    ids = np.arange(32, dtype=np.int64).reshape(4, 8)
    torch = pytest.importorskip("torch")

    write(tmp_path / "a.h5", {"h": hidden, "ids": ids, "n": ids})
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("h", torch.from_numpy(hidden).to(torch.bfloat16), token_ids=np.arange(4), request="r")
        rec.log("ids", torch.from_numpy(ids).to(torch.bfloat16), token_ids=np.arange(4), request="r")
        rec.log("n", ids.astype(np.int32), token_ids=np.arange(4), request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    tensors = by_name(report)
    assert tensors["h"].status == "match" and tensors["h"].worst["max_abs"] == 0
    assert tensors["h"].note == "dtypes differ: float32 vs bfloat16 (compared by value, in float32)"
    assert tensors["n"].status == "match" and "dtypes differ: int64 vs int32" in tensors["n"].note
    assert tensors["ids"].status == "dtype_mismatch" and tensors["ids"].rows == 4
    assert tensors["ids"].note.endswith("the values agree (4 rows compared)")
    assert report.verdict == "incomplete" and report.first_divergence is None
    assert report.reasons == [f"ids: dtype mismatch: {tensors['ids'].note}"]

    with td.record(tmp_path / "c.h5") as rec:  # other values, stored as floats
        rec.log("h", hidden * 1.5, token_ids=np.arange(4), request="r")
        rec.log("ids", (ids + 1).astype(np.float32), token_ids=np.arange(4), request="r")
        rec.log("n", ids, token_ids=np.arange(4), request="r")
    report = td.compare(tmp_path / "a.h5", tmp_path / "c.h5")
    tensors = by_name(report)
    assert report.verdict == "diverged" and report.first_divergence.name == "h"
    assert tensors["ids"].status == "dtype_mismatch" and "values differ in 4 of 4 rows" in tensors["ids"].note


def test_static_tensors_of_other_kinds_of_dtype_are_compared_by_value(tmp_path) -> None:
    d2t = np.arange(8, dtype=np.int64)
    for name, stored in (("a", d2t), ("b", d2t.astype(np.float32))):
        with td.record(tmp_path / f"{name}.h5") as rec:
            rec.log("h", np.ones((4, 2), np.float32), token_ids=np.arange(4))
            rec.log_static("draft.d2t", stored)
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    static = by_name(report)["draft.d2t"]
    assert static.status == "dtype_mismatch" and static.note.endswith("the values agree (1 row compared)")
    assert report.verdict == "incomplete"


def test_a_tol_bound_on_a_metric_the_tensor_lacks_is_noted(tmp_path) -> None:
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    write(tmp_path / "a.h5", {"h": x, "t": np.arange(4)[:, None]})
    write(tmp_path / "b.h5", {"h": x, "t": np.arange(4)[:, None]})
    rules = ["h:cos>=0.99,kl<=0.1", "t:equal>=1,cos>=0.9"]
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", tol=rules)
    tensors = by_name(report)
    assert report.verdict == "match"
    assert tensors["h"].note.startswith("--tol h: this tensor has no kl (it has cosine, max_abs")
    assert "that bound checks nothing here, the rule's other bounds apply" in tensors["h"].note
    assert tensors["t"].note == ("--tol t: this tensor has no cosine (it has equal): that bound checks "
                                 "nothing here, the rule's other bounds apply")
    clean = td.compare(tmp_path / "a.h5", tmp_path / "b.h5", tol=["h:cos>=0.99"])
    assert by_name(clean)["h"].note == ""


def test_a_deeply_nested_mapping_file_is_one_error(tmp_path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' * 200_000 + '"b"' + "}" * 200_000)
    with pytest.raises(td.InputError, match="JSON nested too deeply"):
        read_mapping_file(deep)
    long_line = tmp_path / "long.txt"
    long_line.write_text("[" * 100_000)
    with pytest.raises(td.InputError, match=r"line 1: expected NAME_IN_B=NAME_IN_A, got '\[{77}\.\.\.'$"):
        read_mapping_file(long_line)
    x = np.ones((4, 2), np.float32)
    write(tmp_path / "a.h5", {"h": x})
    out = cli("compare", str(tmp_path / "a.h5"), str(tmp_path / "a.h5"), "--map-file", str(deep))
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: {deep}: JSON nested too deeply (a mapping file is one flat object of strings)")


def test_trace_text_in_diagnoses_never_acts_as_markup_or_escapes(tmp_path) -> None:
    """The diagnoses quote tensor names and sources: printed literally in the terminal, escaped
    in JSON, read back exactly."""
    name = "h[/]\x1b[31m[bold]x"
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32)
    write(tmp_path / "a.h5", {name: x}, source="train[red]")
    write(tmp_path / "b.h5", {name: x * 2}, source="serve\x1b]0;T\x07")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    (diagnosis,) = report.diagnoses
    assert diagnosis.kind == "scale" and name in diagnosis.message
    assert "serve\x1b]0;T\x07" in diagnosis.message
    console = Console(file=io.StringIO(), width=300, color_system=None)
    render(console, report)
    shown = console.file.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown
    assert "why: scale: h[/]\\x1b[31m[bold]x: serve\\x1b]0;T\\x07 = 2 x train[red]" in shown
    text = report.to_json()
    assert "\x1b" not in text and "\x07" not in text
    assert json.loads(text)["diagnoses"][0]["message"] == diagnosis.message


def nan_rows(nan_at: list[tuple[int, int]], shift: float = 0.0) -> np.ndarray:
    """4 rows of 6; NaN at ``nan_at``; row 1 shifted by ``shift``."""
    rows = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) / 7
    rows[1] += shift
    for at in nan_at:
        rows[at] = np.nan
    return rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_at_the_same_elements_on_both_sides_is_the_same_data(tmp_path, dtype) -> None:
    """Both producers wrote NaN in the same places and equal values elsewhere: the rows agree, and the
    report says how they were compared rather than hiding the NaN."""
    rows = nan_rows([(1, 2), (3, 0)]).astype(dtype)
    rows[2, 5] = np.inf
    write(tmp_path / "a.h5", {"h": rows})
    write(tmp_path / "b.h5", {"h": rows.copy()})
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "match"
    assert "compared on their finite elements" in by_name(report)["h"].note
    assert by_name(report)["h"].worst["cosine"] == pytest.approx(1.0)


@pytest.mark.parametrize("a_rows, b_rows", [
    (nan_rows([(1, 2)]), nan_rows([])),  # NaN on one side only
    (nan_rows([(1, 2)]), nan_rows([(1, 2), (1, 3)])),  # NaN at other elements too
    (nan_rows([(1, 2)]), nan_rows([(1, 2)], shift=0.5)),  # NaN at the same element, other finite values
], ids=["one_side", "other_elements", "other_values"])
def test_nan_rows_that_differ_still_diverge(tmp_path, a_rows, b_rows) -> None:
    write(tmp_path / "a.h5", {"h": a_rows})
    write(tmp_path / "b.h5", {"h": b_rows})
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    assert report.verdict == "diverged"
    assert report.first_divergence is not None and report.first_divergence.name == "h"
    assert report.first_divergence.row.position == 1


def test_the_first_nan_is_the_earliest_row_that_differs_whatever_its_side(tmp_path) -> None:
    """a and b hold the same NaN at position 3 (not where anything went wrong); b alone has NaN at
    position 1: that is where the NaN was produced."""
    a_rows = nan_rows([(3, 0)])
    write(tmp_path / "a.h5", {"h": a_rows})
    write(tmp_path / "b.h5", {"h": nan_rows([(3, 0), (1, 4)])})
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    (nan,) = [d for d in report.diagnoses if d.kind == "nan_inf"]
    assert (nan.evidence.side, nan.evidence.position, nan.evidence.rows_non_finite) == ("b", 1, 1)
