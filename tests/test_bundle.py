"""tracediff bundle: the sample's bug pair as a bug report within 1 MB whose slices reproduce the
compare; a budget that forces leaving things out says what; no divergence, a static divergence, a
divergence whose evidence lies outside the window; bad input as one error line."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import tracediff as td
from tests.conftest import REPO
from tracediff.bundle.build import make_bundle
from tracediff.cli import app
from tracediff.diff.results import Report

SAMPLE = REPO / "traces" / "eagle3"
TRAINING, BUG, HEALTHY = SAMPLE / "training.h5", SAMPLE / "serving_aux_bug.h5", SAMPLE / "serving.h5"


def reproduces(full: Report, small: Report) -> bool:
    row, again = full.first_divergence, small.first_divergence
    same_row = (row is None) == (again is None) and (row is None or (
        row.name == again.name and (row.row.request_a, row.row.request_b, row.row.position, row.row.depth)
        == (again.row.request_a, again.row.request_b, again.row.position, again.row.depth)))
    return small.verdict == full.verdict and same_row and \
        [d.kind for d in small.diagnoses] == [d.kind for d in full.diagnoses]


def on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def outside_code(text: str) -> str:
    """Markdown with its code spans and blocks removed: what GitHub would read as markup."""
    return re.sub(r"(`+)(?s:.*?)\1", "", re.sub(r"```+\w*\n(?s:.*?)\n```+", "", text))


@pytest.fixture(scope="module")
def sample_bundle(tmp_path_factory) -> tuple[Path, object, str]:
    out = tmp_path_factory.mktemp("bundle") / "aux_bug"
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (TRAINING, BUG)]
    bundle = make_bundle(TRAINING, BUG, out, zip=True)
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in (TRAINING, BUG)] == before
    return out, bundle, (out / "report.md").read_text()


def test_the_sample_bug_bundle_is_under_1_mb_and_its_slices_reproduce_the_compare(sample_bundle) -> None:
    out, bundle, _ = sample_bundle
    assert sorted(p.name for p in out.iterdir()) == ["a.h5", "b.h5", "report.html", "report.json",
                                                     "report.md", "stats.json"]
    assert on_disk(out) <= 1_000_000 and bundle.total == on_disk(out)
    zipped = out.with_name("aux_bug.zip")
    assert zipped.stat().st_size <= 1_000_000 and bundle.zip_size == zipped.stat().st_size
    assert sorted(zipfile.ZipFile(zipped).namelist()) == sorted(f"aux_bug/{p.name}" for p in out.iterdir())
    full = td.compare(TRAINING, BUG)
    small = td.compare(out / "a.h5", out / "b.h5")
    assert full.verdict == "diverged" and full.first_divergence.name == "target.aux"
    assert [d.kind for d in full.diagnoses] == ["aux_layer_set"]
    assert reproduces(full, small) and bundle.verification.reproduced
    slots = [(e.slots_a, e.slots_b) for e in (small.diagnoses[0].evidence, full.diagnoses[0].evidence)]
    assert slots[0] == slots[1] == (["target.embed", "target.layer.1", "target.layer.3"],
                                    ["target.layer.1", "target.layer.3", "target.layer.5"])
    assert bundle.left_out == []
    for path in (out / "a.h5", out / "b.h5"):  # slices, not copies
        assert path.stat().st_size < min(TRAINING.stat().st_size, BUG.stat().st_size) / 4


def test_report_json_is_the_full_compare_and_stats_cover_what_is_not_sliced(sample_bundle) -> None:
    out, bundle, _ = sample_bundle
    written = Report.from_json((out / "report.json").read_text())
    assert written.to_json() == td.compare(TRAINING, BUG).to_json()
    stats = json.loads((out / "stats.json").read_text())
    for side, path in (("a", out / "a.h5"), ("b", out / "b.h5")):
        with td.open_trace(path) as sliced, td.open_trace(TRAINING if side == "a" else BUG) as whole:
            summarized = [t["name"] for t in stats[side]["tensors"]]
            assert sorted([*summarized, *sliced.names()]) == sorted(whole.names())
            assert not set(summarized) & set(sliced.names()) and "target.aux" in sliced.names()
            rows = whole.rows("draft.logits").numpy()
            logits = next(t for t in stats[side]["tensors"] if t["name"] == "draft.logits")
            assert logits["rows"] == len(rows) and logits["max"] == pytest.approx(float(rows.max()))
            assert logits["std"] == pytest.approx(float(rows.astype(np.float64).std()), rel=1e-9)
    assert (out / "report.html").read_text().lstrip().lower().startswith("<!doctype html")


def test_report_md_says_what_reproduces_how_to_reproduce_and_the_environment(sample_bundle) -> None:
    out, bundle, text = sample_bundle
    assert text.startswith("# tracediff bundle: diverged\n")
    assert "**Reproduced on the slices**" in text and "diagnoses (aux_layer_set)" in text
    assert "```sh\ntracediff compare a.h5 b.h5\n```" in text
    assert f"```sh\ntracediff compare {TRAINING} {BUG}\n```" in text
    assert f"tracediff bundle {TRAINING} {BUG} -o {out} --budget 1000000 --zip" in text
    environment = text[text.index("## Environment"):text.index("## The compare report")]
    assert "| torch | `2.13.0+cpu` | `2.13.0+cpu` |" in environment
    assert "| sglang | *not recorded* | *not recorded* |" in environment
    assert '| speculative arguments | *not recorded* | `{"algorithm": "EAGLE3", "num_draft_tokens": 5, ' \
           '"num_steps": 4, "topk": 1}` |' in environment
    assert "| aux layer ids | `[-1, 1, 3]` | `[1, 3, 5]` |" in environment
    assert "<details><summary>Run contracts</summary>" in text  # the compare report's collapsible parts
    assert f"| `report.md` | {(out / 'report.md').stat().st_size / 1000:.3g} kB | this file |" in text
    assert "- nothing to fit the budget" in text


def test_a_tight_budget_leaves_things_out_says_so_and_still_fits(sample_bundle, tmp_path) -> None:
    _, roomy, _ = sample_bundle
    budget = roomy.total - 5000  # the default window no longer fits (report.md's text differs by a few bytes)
    out = tmp_path / "tight"
    bundle = make_bundle(TRAINING, BUG, out, budget=budget)
    assert on_disk(out) <= budget and bundle.left_out
    text = (out / "report.md").read_text()
    for line in bundle.left_out:
        assert f"- to fit the budget: {line}" in text
    assert "positions more than" in bundle.left_out[0]
    assert bundle.verification.reproduced == reproduces(td.compare(TRAINING, BUG),
                                                        td.compare(out / "a.h5", out / "b.h5"))


def test_a_match_still_makes_a_bundle_and_says_there_is_nothing_to_reproduce(tmp_path) -> None:
    out = tmp_path / "healthy"
    bundle = make_bundle(TRAINING, HEALTHY, out)
    text = (out / "report.md").read_text()
    assert bundle.report.verdict == "match" and text.startswith("# tracediff bundle: match\n")
    assert "found no divergence (match): the slices hold the start of one request pair" in text
    assert td.compare(out / "a.h5", out / "b.h5").verdict == bundle.verification.report.verdict
    assert on_disk(out) <= 1_000_000


def write_pair(tmp_path: Path, *, d2t_differs: bool = False, nan_at: int | None = None) -> tuple[Path, Path]:
    """Two one-request traces of 40 rows that agree but for the change asked for; b's row 0 is
    scaled when a NaN is asked for (the first divergence is then row 0, the NaN far from it)."""
    rows = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    paths = tmp_path / "a.arrow", tmp_path / "b.arrow"
    for path, changed in zip(paths, (False, True)):
        h, d2t = rows.copy(), np.arange(32)
        if changed and nan_at is not None:
            h[0] *= 3
            h[nan_at, 2] = np.nan
        if changed and d2t_differs:
            d2t[5] += 1
        with td.record(path, source="t") as rec:
            rec.log_static("draft.d2t", d2t)
            rec.log("h", h, step=0, request="r", token_ids=np.arange(100, 140))
    return paths


def test_a_static_first_divergence_is_bundled_with_rows_to_align(tmp_path) -> None:
    a, b = write_pair(tmp_path, d2t_differs=True)
    bundle = make_bundle(a, b, tmp_path / "out")
    assert bundle.report.first_divergence.name == "draft.d2t" and bundle.verification.reproduced
    assert bundle.sides[0].sliced.names == ["draft.d2t", "h"] and bundle.sides[0].file == "a.arrow"
    assert reproduces(bundle.report, td.compare(tmp_path / "out" / "a.arrow", tmp_path / "out" / "b.arrow"))


def test_evidence_outside_the_window_widens_the_slices_and_says_so(tmp_path) -> None:
    a, b = write_pair(tmp_path, nan_at=35)  # the window around row 0 holds positions 0..16
    bundle = make_bundle(a, b, tmp_path / "out")
    assert [d.kind for d in bundle.report.diagnoses] == ["nan_inf"]
    assert bundle.window.wide == "requests" and bundle.verification.reproduced
    text = (tmp_path / "out" / "report.md").read_text()
    assert "did not reproduce it, so the slices hold every row of the requests involved" in text


def test_trace_text_in_report_md_is_data_not_markup(tmp_path) -> None:
    hostile = "<img src=x onerror=alert(1)>|`*x*`"
    paths = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, scale in zip(paths, (1, 2)):
        with td.record(path, source=hostile, meta={"target_model": hostile}) as rec:
            rec.log("h", np.ones((4, 8), np.float32) * scale, step=0, request=hostile, token_ids=np.arange(4))
    make_bundle(*paths, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    markup = re.findall(r"(?<!\\)<[^>]*>", outside_code(text))  # unescaped tags GitHub would read
    assert set(markup) == {"<details>", "</details>", "<summary>", "</summary>"}  # only the report's own
    assert "\\<img src=x onerror=alert(1)\\>" in text  # escaped prose where it is not in a code span


def test_the_command_writes_the_bundle(tmp_path) -> None:
    out = tmp_path / "b"
    done = CliRunner().invoke(app, ["bundle", str(TRAINING), str(BUG), "-o", str(out), "--budget", "1MB"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ")
    assert "the slices reproduce the compare: diverged" in done.stdout
    assert (out / "report.md").exists() and not out.with_name("b.zip").exists()


@pytest.mark.parametrize("case", ["missing", "not_empty", "budget", "too_small", "zip_exists"])
def test_bad_input_is_one_error_line_and_leaves_nothing(tmp_path, case) -> None:
    out = tmp_path / "out"
    a, budget = TRAINING, "1MB"
    if case == "missing":
        a = tmp_path / "none.h5"
    elif case == "not_empty":
        out.mkdir()
        (out / "mine.txt").write_text("keep")
    elif case == "budget":
        budget = "1x"
    elif case == "too_small":
        budget = "50k"
    else:
        out.with_name("out.zip").write_text("keep")
    done = CliRunner().invoke(app, ["bundle", str(a), str(BUG), "-o", str(out), "--budget", budget, "--zip"])
    expected = {"missing": f"error: {a}: no such file",
                "not_empty": f"error: {out}: exists and is not an empty directory: a bundle goes into a new "
                             "one",
                "budget": "error: --budget: expected a size such as 1MB, 500k or 2MiB, got '1x'",
                "too_small": f"error: {out}: not even the smallest bundle fits the budget of 50 kB: it takes "
                             "at least ",
                "zip_exists": f"error: {out.with_name('out.zip')}: exists: a bundle never overwrites a file"}
    assert done.exit_code == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(expected[case])
    if case == "not_empty":
        assert [p.name for p in out.iterdir()] == ["mine.txt"]
    elif case == "zip_exists":
        assert out.with_name("out.zip").read_text() == "keep" and not out.exists()
    else:
        assert not out.exists() and not out.with_name("out.zip").exists()
