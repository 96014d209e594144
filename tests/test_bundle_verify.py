"""A bundle's reproduction check on estimates: a norm ratio estimated on the slices' fewer rows
reproduces the full compare within the standard errors of that mean (the default window is kept, not
widened), one beyond them or an exact field that differs does not; every float evidence field
declares how it reproduces, so a new variant cannot fall back to exact by accident."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import numpy as np
import pytest

import tracediff as td
from tests.conftest import tiny_llama
from tracediff.bundle.build import make_bundle
from tracediff.bundle.verify import SPREAD_Z, differences
from tracediff.diff.findings import REPRODUCE, VARIANTS, NormFitEvidence, reproduction
from tracediff.diff.results import Report


def write_final_norm_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A real tiny Llama's last layer output: raw on a, after the final norm on b (HF's
    ``hidden_states[-1]``), 80 positions of one request."""
    torch = pytest.importorskip("torch")
    model = tiny_llama(seed=0, layers=4)
    tokens = np.random.default_rng(0).integers(0, 512, 80)
    raw = {}
    hook = model.model.layers[3].register_forward_hook(
        lambda module, args, out: raw.setdefault("x", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        normed = model(torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states[-1]
    hook.remove()
    paths = tmp_path / "raw.h5", tmp_path / "normed.h5"
    for path, rows in zip(paths, (raw["x"][0], normed[0])):
        with td.record(path, source=path.stem) as rec:
            rec.log("target.layer.3", rows.numpy(), token_ids=tokens, request="r0", step=0)
    return paths


@pytest.fixture(scope="module")
def norm_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("norm")
    a, b = write_final_norm_pair(tmp)
    return make_bundle(a, b, tmp / "out", zip=True), tmp / "out"


def test_a_norm_ratio_estimated_on_fewer_rows_reproduces_in_the_default_window(norm_bundle) -> None:
    bundle, out = norm_bundle
    full, small = bundle.report, td.compare(out / "a.h5", out / "b.h5")
    assert [d.kind for d in full.diagnoses] == [d.kind for d in small.diagnoses] == ["norm"]
    ours, theirs = small.diagnoses[0].evidence, full.diagnoses[0].evidence
    assert isinstance(ours, NormFitEvidence) and ours.normed_side == theirs.normed_side == "b"
    # the slices hold fewer rows: the sampled mean ratio moves by more than 1%, and that is no difference
    assert ours.rows_checked < theirs.rows_checked
    assert abs(ours.norm_ratio_b_over_a / theirs.norm_ratio_b_over_a - 1) > 0.02
    assert differences(full, small) == []
    assert bundle.verification.reproduced and bundle.window.wide == "" and bundle.window.radius == 16
    assert "**Reproduced on the slices**" in (out / "report.md").read_text()


def moved(report: Report, **fields) -> Report:
    """The report with its first diagnosis's evidence changed."""
    first = report.diagnoses[0]
    evidence = dataclasses.replace(first.evidence, **fields)
    return dataclasses.replace(report, diagnoses=[dataclasses.replace(first, evidence=evidence),
                                                  *report.diagnoses[1:]])


def test_an_estimate_agrees_within_its_standard_errors_and_exact_fields_must_be_equal(norm_bundle) -> None:
    full = norm_bundle[0].report
    e = full.diagnoses[0].evidence
    error = SPREAD_Z * e.ratio_spread * np.sqrt(2 / e.rows_checked)  # the same number of rows on both sides
    assert error > 0.05  # a spread ratio: its mean is an estimate, far looser than 1%
    ratio = e.norm_ratio_b_over_a
    assert differences(full, moved(full, norm_ratio_b_over_a=ratio * (1 + 0.9 * error))) == []
    beyond = moved(full, norm_ratio_b_over_a=ratio * (1 + 1.1 * error))
    assert [d.what for d in differences(full, beyond)] == ["diagnosis 1 (norm) norm_ratio_b_over_a"]
    # fewer rows read: the bound widens with them, and the count itself is no difference
    assert differences(full, moved(full, norm_ratio_b_over_a=ratio * (1 + 1.1 * error), rows_checked=8)) == []
    # a fitted weight's mean: within 1%
    assert differences(full, moved(full, weight_mean=e.weight_mean * 1.009)) == []
    assert [str(d) for d in differences(full, moved(full, weight_mean=2.0))] == [
        f"diagnosis 1 (norm) weight_mean: 2.0 on the slices, {e.weight_mean} on the full traces"]
    # exact fields: the side and the tensor
    assert [str(d) for d in differences(full, moved(full, normed_side="a", tensor="target.layer.2"))] == [
        "diagnosis 1 (norm) tensor: target.layer.2 on the slices, target.layer.3 on the full traces",
        "diagnosis 1 (norm) normed_side: a on the slices, b on the full traces"]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
def test_every_float_evidence_field_declares_how_it_reproduces(variant) -> None:
    names = {f.name for f in dataclasses.fields(variant)}
    hints = typing.get_type_hints(variant)
    for f in dataclasses.fields(variant):
        rule = reproduction(f)
        if hints[f.name] is float:
            assert REPRODUCE in f.metadata, f"{variant.__name__}.{f.name}: declare field(metadata=...) " \
                                            "EXACT, IGNORED or estimate(...) (tracediff/diff/findings.py)"
        if rule.spread is not None:
            assert {rule.spread, rule.rows} <= names and rule.rule == "estimate"
