"""``tracediff show A B``: one row on both sides, side by side, and where they differ most; the
compare report's ``next:`` command that leads there."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

import tracediff as td
from tests.conftest import REPO, cli
from tracediff.diff.rowview import row_view
from tracediff.errors import InputError
from tracediff.jsonio import to_plain

SAMPLE = REPO / "traces" / "eagle3"
TRAINING, BUG = SAMPLE / "training.h5", SAMPLE / "serving_aux_bug.h5"
TOKENS = [5, 6, 7, 8]


def base_rows(shape=(3, 4)) -> np.ndarray:
    """Four rows of ``shape`` values, all distinct, deterministic."""
    return np.random.default_rng(0).standard_normal((len(TOKENS), *shape)).astype(np.float32)


def write(path, rows, request, **extra) -> None:
    with td.record(path) as rec:
        rec.log("h", rows, token_ids=TOKENS, request=request)
        for name, value in extra.items():
            rec.log_static(name.replace("_", "."), value)


def test_the_sample_bug_row_agrees_with_compare_and_with_the_traces() -> None:
    """The row compare names diverging: the same metrics compare measured, both rows' values as the
    traces hold them, and the largest differences largest first with their indices."""
    report = td.compare(TRAINING, BUG)
    first = report.first_divergence
    assert first is not None and first.name == "target.aux"
    row = first.row
    view = row_view(TRAINING, BUG, first.name, request=row.request_a, request_b=row.request_b,
                    position=row.position, depth=row.depth, top=5)
    assert (view.a.request, view.b.request, view.a.position, view.b.position) == ("sample0", "req0", 0, 0)
    assert view.a.matched == view.b.matched == 1 and view.notes == []
    assert view.metrics == pytest.approx(row.metrics, rel=1e-9)
    with td.open_trace(TRAINING) as a, td.open_trace(BUG) as b:
        xa = a.rows("target.aux", request="sample0").numpy()[0]
        xb = b.rows("target.aux", request="req0").numpy()[0]
    gaps = np.abs(xa.astype(np.float64) - xb)
    assert view.elements == xa.size and view.differing == int((xa != xb).sum())
    assert [d.index for d in view.top] == [[int(i)] for i in np.argsort(-gaps, kind="stable")[:5]]
    for d in view.top:
        i = d.index[0]
        assert (d.a, d.b, d.abs_diff) == (float(xa[i]), float(xb[i]), float(gaps[i]))
    assert view.top[0].abs_diff == pytest.approx(row.metrics["max_abs"])
    assert view.a.stats.mean == pytest.approx(float(xa.astype(np.float64).mean()))
    assert view.b.stats.head == xb[:8].tolist() and view.b.stats.shape == [192]
    json.dumps(to_plain(view), allow_nan=False)  # JSON-able, strictly


def test_largest_differences_carry_multi_dimensional_indices_nan_first(tmp_path, fmt) -> None:
    x = base_rows()
    y = x.copy()
    y[1, 2, 3] += 0.5  # position 1 only
    y[1, 0, 1] -= 2.0
    y[1, 1, 1] = np.nan  # NaN on one side differs most of all
    x[1, 2, 0] = y[1, 2, 0] = np.nan  # NaN on both sides: equal
    write(tmp_path / f"a.{fmt}", x, "p")
    write(tmp_path / f"b.{fmt}", y, "q")
    view = row_view(tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}", "h", request="p", request_b="q", position=1)
    assert view.elements == 12 and view.differing == 3
    assert [d.index for d in view.top] == [[1, 1], [0, 1], [2, 3]]
    assert np.isnan(view.top[0].b) and view.top[0].a == float(x[1, 1, 1])
    assert view.top[1].abs_diff == pytest.approx(2.0) and view.top[2].abs_diff == pytest.approx(0.5)
    assert np.isnan(view.metrics["max_abs"])  # compare's metrics, NaN and all
    assert view.a.stats.nan == 1 and view.b.stats.nan == 2 and view.b.stats.shape == [3, 4]
    assert json.loads(json.dumps(to_plain(view), allow_nan=False))["top"][0]["b"] == "NaN"
    same = row_view(tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}", "h", request="p", request_b="q", position=0)
    assert same.differing == 0 and same.top == [] and same.metrics["cosine"] == pytest.approx(1.0)


def test_without_a_position_the_first_row_both_sides_hold_is_shown(tmp_path) -> None:
    x = base_rows()
    with td.record(tmp_path / "b.h5") as rec:  # b starts at position 2 (a prefix-cache hit)
        rec.request_tokens("q", TOKENS)
        rec.log("h", x[2:], positions=[2, 3], token_ids=TOKENS[2:], request="q")
    write(tmp_path / "a.h5", x, "p")
    view = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "h", request="p", request_b="q")
    assert (view.a.position, view.b.position, view.differing) == (2, 2, 0)


def test_several_rows_fit_the_first_is_shown_and_the_count_said(tmp_path) -> None:
    x = base_rows()
    with td.record(tmp_path / "a.h5") as rec:
        for step, request in ((0, "p1"), (1, "p2")):
            rec.log("h", x + step, step=step, token_ids=TOKENS, request=request)
    write(tmp_path / "b.h5", x, "q")
    view = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "h", position=0, request_b="q")
    assert (view.a.matched, view.a.request, view.a.step, view.b.matched) == (2, "p1", 0, 1)
    narrowed = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "h", position=0, step=1, step_b=0,
                        request_b="q")
    assert (narrowed.a.matched, narrowed.a.request) == (1, "p2")
    assert narrowed.top[0].abs_diff == pytest.approx(1.0) and narrowed.differing == 12


def test_integer_rows_compare_exactly_and_other_text_is_said(tmp_path) -> None:
    ids = np.array([7, 2**62 + 1, 9, 4], dtype=np.int64)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("tok", ids, token_ids=TOKENS, request="p")
    with td.record(tmp_path / "b.h5") as rec:
        rec.log("tok", ids - [0, 1, 0, 0], token_ids=[5, 9, 7, 8], request="p")
    view = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "tok", request="p", position=1)
    assert view.metrics == {"equal": 0.0} and view.top[0].index == []
    assert (view.top[0].a, view.top[0].b, view.top[0].abs_diff) == (2**62 + 1, 2**62, 1.0)  # not via float
    assert view.notes == ["the rows hold other tokens (a 6, b 9): not the same text"]
    later = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "tok", request="p", position=3)
    assert later.notes == ["the requests hold other tokens at position 1 (a 6, b 9): these rows follow "
                           "other text"]


def test_a_static_tensor_is_compared_whole_and_shapes_that_differ_are_said(tmp_path) -> None:
    d2t = np.arange(6, dtype=np.int64)
    write(tmp_path / "a.h5", base_rows(), "p", draft_d2t=d2t, w=np.ones((2, 3), np.float32))
    write(tmp_path / "b.h5", base_rows(), "p", draft_d2t=d2t - np.arange(6), w=np.ones(6, np.float32))
    view = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "draft.d2t")
    assert view.static and view.a.request is None and view.metrics == {"equal": 0.0}
    assert view.differing == 5 and [d.index for d in view.top[:2]] == [[5], [4]]
    shapes = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "w")
    assert shapes.metrics == {} and shapes.top == []
    assert (shapes.a.stats.shape, shapes.b.stats.shape) == ([2, 3], [6])
    assert shapes.notes and shapes.notes[0].startswith("shape [2, 3] vs [6]")
    with pytest.raises(InputError, match="static tensor"):
        row_view(tmp_path / "a.h5", tmp_path / "b.h5", "draft.d2t", position=0)
    with td.record(tmp_path / "c.h5") as rec:
        rec.log("w", np.ones((4, 6), np.float32), token_ids=TOKENS, request="p")
    with pytest.raises(InputError) as kinds:
        row_view(tmp_path / "c.h5", tmp_path / "b.h5", "w")
    assert kinds.value.path == str(tmp_path / "b.h5")
    assert kinds.value.problem.startswith("'w' is a static tensor in b but a row tensor in a")


def test_a_side_that_lacks_the_tensor_or_the_row_is_named(tmp_path) -> None:
    write(tmp_path / "a.h5", base_rows(), "sample0")
    write(tmp_path / "b.h5", base_rows(), "req0")
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with pytest.raises(InputError) as missing:
        row_view(a, b, "nope")
    assert missing.value.path == str(a) and "a has no tensor 'nope'" in missing.value.problem
    with pytest.raises(InputError) as other_ids:
        row_view(a, b, "h", request="sample0", position=0)  # b names its requests otherwise
    assert other_ids.value.path == str(b)
    assert "its requests: 'req0'; pass --request-b" in other_ids.value.problem
    for where, text in (({"position": 9}, "at position 9 (positions of the rows selected: 0..3)"),
                        ({"depth": 2}, "at depth 2 (its depths: 0; pass --depth)"),
                        ({"step": 4}, "at step 4 (its steps: 0)")):
        with pytest.raises(InputError) as err:
            row_view(a, b, "h", request_b="req0", **where)
        assert err.value.path == str(a) and text in err.value.problem


def test_a_depth_row_fed_other_tokens_is_said() -> None:
    view = row_view(TRAINING, BUG, "draft.token", request="sample0", request_b="req0", position=3, depth=2)
    with td.open_trace(TRAINING) as a, td.open_trace(BUG) as b:
        fed = [t.rows("draft.input_ids", step=s.step, request=s.request, depth=2)
               for t, s in ((a, view.a), (b, view.b))]
        fed_tokens = [int(r.numpy()[r.position == 3][0]) for r in fed]
    assert [view.a.fed, view.b.fed] == fed_tokens and fed_tokens[0] != fed_tokens[1]
    said = f"the draft was fed other tokens at depth 2 (a {fed_tokens[0]}, b {fed_tokens[1]})"
    assert view.notes[0].startswith(said)


def test_the_next_command_of_the_sample_bug_shows_both_rows_and_their_largest_differences() -> None:
    """The compare report's last line is a command; run as printed, it shows the failing row of
    both traces and the elements that differ most."""
    compared = cli("compare", str(TRAINING), str(BUG))
    assert compared.returncode == 1, compared.stderr
    line = compared.stdout.strip().splitlines()[-1]
    argv = shlex.split(line.removeprefix("next: "))
    assert argv == ["tracediff", "show", str(TRAINING), str(BUG), "--name", "target.aux", "--request",
                    "sample0", "--request-b", "req0", "--position", "0"]
    shown = cli(*argv[1:])
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert f"a {TRAINING}: request sample0, position 0, depth 0" in text
    assert f"b {BUG}: request req0, position 0, depth 0" in text
    assert "192 of 192 elements differ" in text and "largest differences (10 of 192):" in text
    view = row_view(TRAINING, BUG, "target.aux", request="sample0", request_b="req0", position=0)
    largest = next(ln for ln in text.splitlines() if ln.lstrip().startswith(f"({view.top[0].index[0]},)"))
    assert f"{view.top[0].a:.6g}" in largest and f"{view.top[0].b:.6g}" in largest
    as_json = json.loads(cli(*argv[1:], "--json", "--top", "3").stdout)
    assert as_json == json.loads(json.dumps(to_plain(row_view(TRAINING, BUG, "target.aux", request="sample0",
                                                              request_b="req0", position=0, top=3))))


def test_bad_pair_input_is_one_line_naming_the_side(tmp_path) -> None:
    write(tmp_path / "a.h5", base_rows(), "p")
    write(tmp_path / "b.h5", base_rows(), "p")
    with td.record(tmp_path / "c.h5") as rec:
        rec.log("other", base_rows(), token_ids=TOKENS, request="p")
    out = cli("show", str(tmp_path / "a.h5"), str(tmp_path / "c.h5"), "--name", "h")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {tmp_path / 'c.h5'}: b has no tensor 'h' (list them: tracediff " \
                                 f"show {tmp_path / 'c.h5'})"
    out = cli("show", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert out.returncode == 2 and out.stderr.strip().startswith("error: --name: ")
    out = cli("show", str(tmp_path / "a.h5"), str(tmp_path / "nope.h5"), "--name", "h")
    assert out.returncode == 2 and out.stderr.strip() == f"error: {tmp_path / 'nope.h5'}: no such file"


def write_epochs(path, epochs) -> None:
    """Request ``R`` recorded once per (step, rows) in ``epochs``: training over the same sample in
    several epochs, or a server retrying a request id."""
    with td.record(path) as rec:
        for step, rows in epochs:
            rec.log("h", rows, token_ids=TOKENS, request="R", step=step)


def test_the_next_command_is_one_line_however_long_its_paths(tmp_path) -> None:
    """The printed command pastes as printed: never wrapped at the terminal's width."""
    deep = tmp_path / ("a-folder-with-a-long-name-" * 6) / "runs"
    deep.mkdir(parents=True)
    x = base_rows((8,))
    write_epochs(deep / "a.h5", [(0, x)])
    write_epochs(deep / "b.h5", [(0, x + 0.5)])
    compared = cli("compare", str(deep / "a.h5"), str(deep / "b.h5"))
    last = compared.stdout.strip().splitlines()[-1]
    assert last.startswith("next: tracediff show ") and last.endswith("--position 0"), compared.stdout
    shown = cli(*shlex.split(last.removeprefix("next: "))[1:])
    assert shown.returncode == 0, shown.stderr


def test_the_next_command_of_a_request_at_several_steps_shows_the_diverging_step(tmp_path) -> None:
    """Step 0 agrees, step 1 diverges at position 2: the printed command names step 1, and run as
    printed it shows the step-1 rows, their values and their largest differences."""
    x = base_rows((8,))
    y = x.copy()
    y[2:] += 0.5
    write_epochs(tmp_path / "a.h5", [(0, x), (1, x)])
    write_epochs(tmp_path / "b.h5", [(0, x), (1, y)])
    compared = cli("compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert compared.returncode == 1, compared.stderr
    assert "position 2, depth 0, step 1 / 1" in compared.stdout.splitlines()[0]
    argv = shlex.split(compared.stdout.strip().splitlines()[-1].removeprefix("next: "))
    assert argv[-2:] == ["--step", "1"] and "--step-b" not in argv
    shown = cli(*argv[1:])
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    for side, path in (("a", "a.h5"), ("b", "b.h5")):
        assert f"{side} {tmp_path / path}: request R, position 2, depth 0, step 1, token 7" in text
    assert "8 of 8 elements differ" in text and "largest differences (8 of 8):" in text
    first = next(ln for ln in text.splitlines() if ln.lstrip().startswith("(0,)"))
    assert f"{x[2, 0]:.6g}" in first and f"{y[2, 0]:.6g}" in first and "0.5" in first


def test_several_steps_fit_the_lowest_is_shown_whatever_the_trace_order(tmp_path) -> None:
    """Without --step the row at the lowest step is shown (negative steps, e.g. a producer's
    'unknown', last): a divergence at step 0 needs no --step, even where step 0 was written later."""
    x = base_rows()
    write_epochs(tmp_path / "a.h5", [(3, x + 3), (-1, x - 1), (0, x), (1, x + 1)])
    write_epochs(tmp_path / "b.h5", [(0, x)])
    view = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "h", request="R", position=1)
    assert (view.a.step, view.a.matched, view.differing) == (0, 4, 0)
    write_epochs(tmp_path / "c.h5", [(3, x + 3), (-1, x - 1)])
    later = row_view(tmp_path / "c.h5", tmp_path / "b.h5", "h", request="R", position=1)
    assert (later.a.step, later.top[0].abs_diff) == (3, pytest.approx(3.0))


def test_nan_at_the_same_elements_on_both_sides_is_measured_as_compare_does(tmp_path) -> None:
    """A row whose NaN/Inf agree on both sides (same elements, same values) holds the same data
    there: show gives compare's metrics, measured on the finite elements, and says so."""
    x = base_rows((8,))
    x[1, :3] = np.nan
    x[1, 3] = -np.inf
    y = x.copy()
    y[1, 6] += 0.25  # the row also differs in a finite element: compare reports its metrics
    for path, rows in (("a.h5", x), ("b.h5", y)):
        write(tmp_path / path, rows, "p")
    report = td.compare(tmp_path / "a.h5", tmp_path / "b.h5")
    row = report.first_divergence.row
    assert row.position == 1 and np.isfinite(row.metrics["max_abs"])
    view = row_view(tmp_path / "a.h5", tmp_path / "b.h5", "h", request="p", position=1)
    assert view.metrics == pytest.approx(row.metrics, rel=1e-12)
    assert view.metrics["max_abs"] == pytest.approx(0.25, rel=1e-6) and view.differing == 1
    assert view.notes == ["the rows hold NaN/Inf at the same elements with the same values on both sides: "
                          "measured on their finite elements, as compare does"]
    y[1, 3] = np.inf  # another infinity: not the same data, every metric NaN as in compare
    write(tmp_path / "c.h5", y, "p")
    other = row_view(tmp_path / "a.h5", tmp_path / "c.h5", "h", request="p", position=1)
    assert np.isnan(other.metrics["max_abs"]) and other.notes == []


def test_a_missing_position_lists_the_positions_held_gaps_and_all(tmp_path) -> None:
    """The positions a side holds are listed as runs, so that gaps show; a long list is cut short
    with the count."""
    tokens = list(range(100, 160))
    rows = np.random.default_rng(1).standard_normal((60, 4)).astype(np.float32)
    with td.record(tmp_path / "a.h5") as rec:
        rec.log("h", rows, token_ids=tokens, request="p")
    with td.record(tmp_path / "b.h5") as rec:
        rec.request_tokens("q", tokens)
        held = [3, 4, 9, 14, 19]
        rec.log("h", rows[held], positions=held, token_ids=[tokens[i] for i in held], request="q")
    with td.record(tmp_path / "c.h5") as rec:
        rec.request_tokens("q", tokens)
        held = list(range(20, 60, 2))
        rec.log("h", rows[held], positions=held, token_ids=[tokens[i] for i in held], request="q")
    with pytest.raises(InputError) as gaps:
        row_view(tmp_path / "a.h5", tmp_path / "b.h5", "h", request="p", request_b="q", position=5)
    assert gaps.value.problem.endswith("at position 5 (positions of the rows selected: 3..4, 9, 14, 19)")
    with pytest.raises(InputError) as many:
        row_view(tmp_path / "a.h5", tmp_path / "c.h5", "h", request="p", request_b="q", position=5)
    assert many.value.problem.endswith("(positions of the rows selected: 20, 22, 24, 26, 28, 30, 32, 34, "
                                       "... (20 positions in all))")
    with pytest.raises(InputError) as none_shared:
        row_view(tmp_path / "b.h5", tmp_path / "c.h5", "h", request="q")
    assert none_shared.value.problem.endswith("on a: positions 3..4, 9, 14, 19; on b: 20, 22, 24, 26, 28, "
                                              "30, 32, 34, ... (20 positions in all))")


def test_a_mistyped_name_gets_the_closest_names_of_the_side_that_lacks_it(tmp_path) -> None:
    rows = base_rows()
    for side in "ab":
        with td.record(tmp_path / f"{side}.h5") as rec:
            for name in ("draft.hidden", "draft.embed", "draft.hidden_norm", *(f"target.layer.{i}"
                                                                               for i in range(5))):
                rec.log(name, rows, token_ids=TOKENS, request="r")
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with pytest.raises(InputError) as typo:
        row_view(a, b, "draft.hiden")
    assert typo.value.problem == f"a has no tensor 'draft.hiden'; did you mean 'draft.hidden'? (list them: " \
                                 f"tracediff show {a})"
    with pytest.raises(InputError) as several:  # as close as each other: the first three by name
        row_view(a, b, "draft.hidden", name_b="target.layer")
    assert several.value.path == str(b) and several.value.problem.startswith(
        "b has no tensor 'target.layer'; did you mean 'target.layer.0', 'target.layer.1' or "
        "'target.layer.2'? ")
    with pytest.raises(InputError) as unlike:
        row_view(a, b, "verify.accept_len")
    assert unlike.value.problem == f"a has no tensor 'verify.accept_len' (list them: tracediff show {a})"
