"""A bundle with ``--draft`` holds explain's result beside the compare: explain.json (the
explanation, round-tripping), explain.html and a section of report.md, all within the budget, and
a budget too small says what the explanation took; the explain options need ``--draft``."""

from __future__ import annotations

import json
import math
import re
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("torch")

import tracediff as td  # noqa: E402
from tests.conftest import REPO, cli  # noqa: E402
from tracediff.bundle.build import Explained, make_bundle  # noqa: E402
from tracediff.errors import InputError  # noqa: E402

SAMPLE = REPO / "traces" / "eagle3"
TRAINING, BUG = SAMPLE / "training.h5", SAMPLE / "serving_aux_bug.h5"
FLAGS = ("--draft", str(SAMPLE / "draft"), "--target", str(SAMPLE / "target"))


@pytest.fixture(scope="module")
def explained() -> Explained:
    return Explained(td.explain(TRAINING, BUG, SAMPLE / "draft", target=SAMPLE / "target"), FLAGS)


def on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_the_bundle_holds_the_explanation_within_its_budget(explained, tmp_path) -> None:
    out = tmp_path / "bug"
    bundle = make_bundle(TRAINING, BUG, out, zip=True, explained=explained)
    assert td.Explanation.from_json((out / "explain.json").read_text()) == explained.explanation
    assert explained.explanation.conclusion.startswith("B's fc input costs")
    page = (out / "explain.html").read_text()
    assert "← restores acceptance" in page and "B with A&#x27;s fc input" in page
    md = (out / "report.md").read_text()
    assert "## Explain: which input costs acceptance (full traces)" in md
    assert f"**{explained.explanation.conclusion}**" in md and "| B with A's fc input |" in md
    assert "tracediff explain " + " ".join([str(TRAINING), str(BUG), *FLAGS]) in md
    assert "| `explain.json` |" in md and "| `explain.html` |" in md
    assert bundle.files == {p.name: p.stat().st_size for p in out.iterdir()}
    assert on_disk(out) == bundle.total <= bundle.budget
    assert bundle.zip is not None and bundle.zip.stat().st_size <= bundle.budget
    assert {"bug/explain.json", "bug/explain.html"} <= set(zipfile.ZipFile(bundle.zip).namelist())
    assert bundle.verification.reproduced


@pytest.mark.slow
def test_a_budget_too_small_counts_the_explanation_and_the_size_it_states_fits(explained, tmp_path) -> None:
    with pytest.raises(InputError) as plain:
        make_bundle(TRAINING, BUG, tmp_path / "plain", budget=50_000)
    with pytest.raises(InputError) as error:
        make_bundle(TRAINING, BUG, tmp_path / "out", budget=50_000, explained=explained)
    sizes = {name: len(text.encode()) for name, text in explained.files().items()}
    problem = error.value.problem
    assert f"explain.json {sizes['explain.json']}, explain.html {sizes['explain.html']}" in problem
    needed = int(re.search(r"it takes (\d+) bytes", problem).group(1))
    without = int(re.search(r"it takes (\d+) bytes", plain.value.problem).group(1))
    assert needed > without + sum(sizes.values())  # the files, and report.md's section
    assert not (tmp_path / "out").exists()
    budget = math.ceil(needed / 1000) * 1000
    bundle = make_bundle(TRAINING, BUG, tmp_path / "out", budget=budget, explained=explained)
    assert on_disk(tmp_path / "out") == bundle.total <= budget
    assert (tmp_path / "out" / "explain.json").exists()


def test_the_command_explains_into_the_bundle(tmp_path) -> None:
    out = tmp_path / "bug"
    done = cli("bundle", str(TRAINING), str(BUG), "-o", str(out), *FLAGS, "--depths", "3")
    assert done.returncode == 0, done.stderr
    written = json.loads((out / "explain.json").read_text())
    assert written["depths"] == 3 and written["depths_from"] == "--depths"
    assert written["differing"] == ["fc_in"]


@pytest.mark.parametrize("option", [("--target", str(SAMPLE / "target")), ("--depths", "2"),
                                    ("--draft-b", str(SAMPLE / "draft"))])
def test_an_explain_option_without_a_draft_is_one_error_line(option, tmp_path) -> None:
    done = cli("bundle", str(TRAINING), str(BUG), "-o", str(tmp_path / "out"), *option)
    assert done.returncode == 2 and done.stderr.strip() == \
        f"error: {option[0]}: explains with --draft only: give the draft checkpoint too"
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_fails_before_the_replays(tmp_path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("kept")
    done = cli("bundle", str(TRAINING), str(BUG), "-o", str(tmp_path / "out"), "--draft",
               str(tmp_path / "none"))
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {tmp_path / 'out'}: exists and is not an empty directory")
    assert (tmp_path / "out" / "x").read_text() == "kept"
