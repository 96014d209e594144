"""explain --html: one self-contained page (no script, the compare page's CSP), the conclusion first,
a bar per run with the run whose swap restores acceptance marked; trace text is data; an existing
file is replaced only with --force; it loads in Chromium without a console message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from testbed.browser import load  # noqa: E402
from tests.conftest import REPO, cli  # noqa: E402
from tests.test_html_report import artifacts, chromium  # noqa: E402, F401  (the fixture)

S = REPO / "traces" / "eagle3"


def explain_html(a: Path, b: Path, page: Path, *extra: str):
    return cli("explain", str(a), str(b), "--draft", str(S / "draft"), "--target", str(S / "target"),
               "--html", str(page), *extra)


def test_the_page_leads_with_the_conclusion_and_marks_the_restoring_run(tmp_path) -> None:
    page = tmp_path / "explain.html"
    done = explain_html(S / "training.h5", S / "serving_aux_bug.h5", page)
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    assert "<script" not in html and "Content-Security-Policy" in html
    assert html.index("B&#x27;s fc input costs") < html.index("<h2>Runs</h2>")
    marked = [line for line in html.split("<tr") if "restores acceptance" in line]
    assert len(marked) == 1 and "B with A&#x27;s fc input" in marked[0] and "bar restored" in marked[0]


def test_trace_names_are_data_and_an_existing_page_needs_force(tmp_path) -> None:
    hostile = tmp_path / "<img src=x onerror=alert(1)>.h5"
    shutil.copy(S / "serving_aux_bug.h5", hostile)
    page = tmp_path / "explain.html"
    page.write_text("mine")
    refused = explain_html(S / "training.h5", hostile, page)
    assert refused.returncode == 2 and page.read_text() == "mine"
    assert refused.stderr.startswith(f"error: {page}: ")
    done = explain_html(S / "training.h5", hostile, page, "--force")
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;.h5" in html


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_page_loads_cleanly_in_chromium(chromium: str, tmp_path) -> None:  # noqa: F811
    out = artifacts()
    page = out / "explain.html"
    page.unlink(missing_ok=True)
    assert explain_html(S / "training.h5", S / "serving_aux_bug.h5", page).returncode == 0
    loaded = load(page, chromium, screenshot=out / "explain.png", size=(1300, 700))
    assert loaded.console == [], loaded.console
    assert loaded.screenshot is not None and loaded.screenshot.stat().st_size > 10_000
