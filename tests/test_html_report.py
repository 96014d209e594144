"""The HTML report: one self-contained page rendered from the typed Report (the sample traces'
real compares, and a hand-built report full of hostile text), checked as parsed HTML, through the
CLI, and in a real headless Chromium that loads it and takes the screenshots CI keeps."""

from __future__ import annotations

import copy
import hashlib
import math
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracediff as td
from testbed.browser import find_chromium, load
from tracediff.cli import app
from tracediff.diff.findings import Diagnosis, SlotsEvidence
from tracediff.diff.results import (
    ContractDiff,
    ContractEntry,
    Coverage,
    FirstDivergence,
    Profile,
    Report,
    RowRef,
    TensorResult,
    TokenView,
    TraceInfo,
)
from tracediff.report.compare import skipped_lines
from tracediff.report.html import render_html

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces" / "eagle3"
SCRIPT = "<script>alert(1)</script>"
BREAKOUT = '"><img src=x onerror=alert(2)>'
# What the page is made of; anything else (script, img, iframe, object, a, link...) came from a trace.
TAGS = {"html", "head", "meta", "title", "style", "body", "main", "header", "section", "div", "p", "h1", "h2",
        "span", "b", "br", "code", "ul", "li", "table", "thead", "tbody", "tr", "th", "td", "details",
        "summary", "figure", "figcaption", "svg", "rect", "line", "polyline", "circle", "text"}


class Page(HTMLParser):
    """The parsed page: every tag with its attributes, the text a reader sees, and each tooltip
    (an SVG <title>) with the attributes of the shape it belongs to."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.chunks: list[str] = []
        self.tips: list[tuple[dict[str, str | None], str]] = []
        self.in_tip = False
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title" and self.tags and self.tags[-1][0] != "head":
            self.tips.append((self.tags[-1][1], ""))
            self.in_tip = True
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        self.in_tip = self.in_tip and tag != "title"

    def handle_data(self, data: str) -> None:
        self.chunks.append(data)
        if self.in_tip:
            self.tips[-1] = (self.tips[-1][0], self.tips[-1][1] + data)

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def having(self, cls: str) -> list[dict[str, str | None]]:
        return [a for _, a in self.tags if cls in (a.get("class") or "").split()]


@pytest.fixture(scope="module")
def diverged() -> Report:
    return td.compare(SAMPLES / "training.h5", SAMPLES / "serving_aux_bug.h5")


@pytest.fixture(scope="module")
def matched() -> Report:
    return td.compare(SAMPLES / "training.h5", SAMPLES / "serving.h5")


def hostile_report() -> Report:
    """Every piece of trace text a tag or an attribute breakout: names, requests, messages, paths,
    contract keys and values, slot names, notes; plus a terminal escape."""
    bad, name = SCRIPT, BREAKOUT
    row = RowRef(request_a=bad, request_b=name, position=2, depth=0, step_a=0, step_b=0,
                 metrics={"cosine": 0.5, "rel_l2": 0.9})
    profile = Profile(bucket=1, depth=[0, 0, 0, 1], position=[0, 1, 2, 2], rows=[1, 1, 1, 1],
                      failed=[0, 0, 1, 1], cosine=[1.0, 1.0, 0.5, 0.4], rel_l2=[1e-7, 2e-7, 0.9, math.nan])
    coverage = Coverage.of((4, 4), 4, (4, 4), {"not_recorded": 2}, {})
    info = TraceInfo(paths=[f"/tmp/{bad}.h5"], source=f"train\x1b[31m{name}", producer=bad)
    agreeing = Profile(1, [0, 0, 0], [0, 1, 2], [1, 1, 1], [0, 0, 0], [1.0, 1.0, 1.0], [0.0, 1e-8, 1e-7])
    tensors = [TensorResult(name=bad, status="match", dtypes=("float32", "float32"), shapes=([8], [8]),
                            rows=4, coverage=coverage, profile=agreeing),
               TensorResult(name=name, status="diverged", dtypes=("float32", "float32"), shapes=([8], [8]),
                            rows=4, failed=2, coverage=coverage, first_bad=row, profile=profile,
                            note=f"note {bad}", worst={"cosine": 0.4})]
    slots = SlotsEvidence(tensor=name, slots_a=[bad, "target.layer.1"], slots_b=["target.layer.1", name],
                          rows_checked=3)
    return Report(verdict="diverged", reasons=[f"reason {bad}"], a=info, b=TraceInfo(paths=[f"{name}.h5"]),
                  align="prefix", min_coverage=0.95, coverage=coverage,
                  first_divergence=FirstDivergence(name, row),
                  diagnoses=[Diagnosis("aux_order", f"message {bad} {name}", slots)], tensors=tensors,
                  contract=ContractDiff([ContractEntry(bad, [name], {bad: name})], {name: bad}, {}),
                  token_mismatch=None,
                  tokens=TokenView(request_a=bad, request_b=name, start=0, tokens_a=[1, 2, 3],
                                   tokens_b=[1, 2, 4], first_difference=2, focus=2))


def cell_fills(page: Page, tensor: str) -> list[str]:
    """Fill colours of a tensor's heatmap cells: the rects whose tooltip names the tensor and a cell."""
    fills = [str(attrs["fill"]) for attrs, tip in page.tips if tip.startswith(f"{tensor}, depth ")]
    assert fills, f"no heatmap cells of {tensor}"
    return fills


def reddish(colour: str) -> bool:
    r, g = int(colour[1:3], 16), int(colour[3:5], 16)
    return r > g + 40


def test_the_diverged_page_leads_with_the_first_divergence_and_marks_its_cell(diverged: Report) -> None:
    page = Page(render_html(diverged))
    text = page.text
    assert diverged.first_divergence is not None and diverged.first_divergence.name == "target.aux"
    assert page.having("v-diverged") and "first divergence in target.aux" in text
    assert "at request sample0 / req0, position 0, depth 0" in text
    assert len(page.having("heatmap")) == 1 and len(page.having("hm-first-cell")) == 1
    assert "first divergence: target.aux, position 0, depth 0" in text
    assert [tip for attrs, tip in page.tips if "hm-label-first" in str(attrs.get("class"))] == [
        "target.aux (diverged)"]
    aux, embed = cell_fills(page, "target.aux"), cell_fills(page, "target.embed")
    assert aux and all(reddish(c) for c in aux)  # every target.aux row fails: red
    assert embed and not any(reddish(c) for c in embed)  # equal on both sides: teal
    assert "target.aux: worst cosine per position" in text
    assert "target.aux: worst rel_l2 per position (log)" in text


def test_a_report_without_profiles_says_they_were_left_out_not_that_nothing_was_compared(
        diverged: Report) -> None:
    """A bundle trims error profiles to fit its budget: the page must not then claim no row was
    compared, and it says what it does not draw."""
    trimmed = copy.deepcopy(diverged)
    for t in trimmed.tensors:
        t.profile = None
    text = Page(render_html(trimmed)).text
    compared = sum(1 for t in diverged.tensors if t.rows and not t.static)  # a static one has none by nature
    assert f"{compared} compared tensors carry no error profile in this report" in text
    assert "Its error profile was left out of this report" in text
    assert "No row was compared" not in text and "Compared: 1263 of 3146 rows in a" in text


def test_the_slot_matrix_shows_which_slot_of_a_holds_which_state_of_b(diverged: Report) -> None:
    page = Page(render_html(diverged))
    assert [d.kind for d in diverged.diagnoses] == ["aux_layer_set", "config"]  # + aux_layer_ids, aux_sources
    # training fed [embed, layer 1, layer 3], serving [layer 1, layer 3, layer 5]: a's slots 1 and 2 are
    # b's slots 0 and 1 (off the diagonal), and no slot holds the same state on both sides
    assert [a["title"] for a in page.having("sm-moved")] == [
        "a slot 1 holds target.layer.1; b slot 0 holds target.layer.1",
        "a slot 2 holds target.layer.3; b slot 1 holds target.layer.3"]
    assert len(page.having("sm-wrong")) == 3 and not page.having("sm-same")


def test_tokens_of_both_sides_are_shown_with_the_differing_token_marked() -> None:
    page = Page(render_html(hostile_report()))  # a: 1 2 3, b: 1 2 4 from position 0; divergence at 2
    columns = [str(a["class"]).split() for a in page.having("tok") if "tok-side" not in str(a["class"])]
    assert columns == [["tok"], ["tok"], ["tok", "tok-first", "tok-focus"]]
    assert "The tokens first differ at position 2" in page.text


def test_the_header_says_what_was_compared_and_what_was_not(diverged: Report) -> None:
    text = Page(render_html(diverged)).text
    assert f"{diverged.coverage.aligned} row pairs compared" in text
    lines = skipped_lines(diverged.coverage)
    assert lines and all(f"not compared, {line}" in text for line in lines)
    assert "not compared, b: 1 tensor that a lacks (verify.accept_len)" in text


def test_a_match_page_marks_no_divergence(matched: Report) -> None:
    page = Page(render_html(matched))
    assert matched.verdict == "match" and "every compared row is within tolerance" in page.text
    assert len(page.having("heatmap")) == 1 and not page.having("hm-first-cell") and not page.having("curve")
    assert not any(reddish(c) for t in ("target.aux", "draft.hidden") for c in cell_fills(page, t))


def test_an_incomparable_page_leads_with_the_reason_and_marks_no_divergence() -> None:
    report = hostile_report()  # it holds a failing row; an incomparable pair's rows are nothing to chase
    report.verdict, report.reasons = "incomparable", ["the contracts name different target models: a x, b y"]
    page = Page(render_html(report))
    heading = "".join(page.chunks[page.chunks.index("incomparable") + 1:]).split("\n")[0]
    assert heading.startswith("the contracts name different target models")
    assert not page.having("hm-first-cell") and not page.having("curve") and not page.having("row-first")


def test_an_integer_tensor_is_drawn_by_the_share_of_rows_that_differ() -> None:
    report = hostile_report()
    report.tensors[1].profile = Profile(1, [0, 0, 0], [0, 1, 2], [2, 2, 2], [0, 1, 2], [None] * 3, [None] * 3)
    page = Page(render_html(report))
    assert [str(a["aria-label"]) for a in page.having("curve")] == [
        f"{BREAKOUT}: share of rows that differ, per position"]
    fills = cell_fills(page, BREAKOUT)
    assert not reddish(fills[0]) and reddish(fills[1]) and reddish(fills[2])


def test_trace_text_is_data_never_markup() -> None:
    html = render_html(hostile_report())
    page = Page(html)
    assert {tag for tag, _ in page.tags} <= TAGS
    assert not [name for _, attrs in page.tags for name in attrs if name.startswith("on")]
    assert SCRIPT in page.text and BREAKOUT in page.text  # shown to the reader, as text
    assert "\x1b" not in html and "train\\x1b[31m" in page.text
    policy = [a["content"] for tag, a in page.tags if tag == "meta" and a.get("http-equiv")]
    assert policy == ["default-src 'none'; style-src 'unsafe-inline'; img-src data:"]


def test_the_page_is_self_contained(diverged: Report) -> None:
    html = render_html(diverged)
    assert not re.search(r"(src|href)\s*=|url\(|@import|https?://(?!www\.w3\.org/2000/svg)", html)


def test_compare_writes_the_page_beside_the_terminal_report(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    args = ["compare", str(SAMPLES / "training.h5"), str(SAMPLES / "serving_aux_bug.h5"), "--html", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("diverged")
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no staging file left behind


@pytest.mark.parametrize("where", ["missing/dir/report.html", "TRACE"])
def test_a_bad_html_path_is_one_error_line_and_nothing_is_modified(tmp_path: Path, where: str) -> None:
    trace = tmp_path / "serving.h5"
    trace.write_bytes((SAMPLES / "serving.h5").read_bytes())
    before = hashlib.sha256(trace.read_bytes()).hexdigest()
    target = trace if where == "TRACE" else tmp_path / where
    args = ["compare", str(SAMPLES / "training.h5"), str(trace), "--html", str(target)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {target}: ") and "Traceback" not in result.output
    assert hashlib.sha256(trace.read_bytes()).hexdigest() == before


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        reason = "no chromium on PATH: install Debian's (apt-get install chromium) to test the HTML report"
        if os.environ.get("TRACEDIFF_NO_SKIPS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def artifacts() -> Path:
    out = Path(os.environ.get("TRACEDIFF_ARTIFACTS") or REPO / "artifacts") / "html_report"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_browser_check_sees_a_page_error(chromium: str, tmp_path: Path) -> None:
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>notDefined()</script></body></html>")
    assert any("Uncaught ReferenceError" in line for line in load(page, chromium).console)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_pages_load_cleanly_in_chromium(chromium: str, diverged: Report, matched: Report,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = artifacts()
    for label, report in (("diverged", diverged), ("match", matched), ("hostile", hostile_report())):
        page = out / f"{label}.html"
        page.write_text(render_html(report), encoding="utf-8")
        loaded = load(page, chromium, screenshot=out / f"{label}.png")
        with capsys.disabled():  # in the CI log, whatever the capture mode
            print(f"\nHTML report screenshot: {loaded.screenshot}")
        assert loaded.console == [], f"{label}: the page logged {loaded.console}"
        dom = Page(loaded.dom)
        assert {tag for tag, _ in dom.tags} <= TAGS, label
        assert len(dom.having("heatmap")) == 1, label
        if label != "match":
            assert len(dom.having("hm-first-cell")) == 1 and "first divergence in" in dom.text, label
        assert loaded.screenshot is not None and loaded.screenshot.stat().st_size > 20_000
