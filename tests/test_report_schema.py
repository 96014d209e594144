"""docs/REPORT.md is the contract of the JSON report: it must name what the code produces."""

from __future__ import annotations

import dataclasses
import re
import typing

from tests.conftest import REPO
from tracediff.diff import findings, results
from tracediff.diff.findings import VARIANTS, Diagnosis, evidence_table
from tracediff.eagle3.acceptance import Acceptance
from tracediff.jsonio import from_plain, to_plain
from tracediff.trace.completeness import Gap, GapKind

DOC = (REPO / "docs" / "REPORT.md").read_text()


def test_the_evidence_table_is_the_codes() -> None:
    table = re.search(r"<!-- evidence-table:[^>]*-->\n(.*?)<!-- /evidence-table -->", DOC, re.S)
    assert table is not None and table.group(1).strip() == evidence_table(), (
        "docs/REPORT.md's evidence table is stale; paste tracediff.diff.findings.evidence_table()")


def test_every_literal_is_documented() -> None:
    for literal in (results.Verdict, results.Status, results.Reason, findings.Kind, findings.Severity,
                    GapKind):
        for value in typing.get_args(literal):
            assert f"`{value}`" in DOC or f"{value} |" in DOC or f'"{value}' in DOC, value
    for verdict, code in results.EXIT_CODES.items():
        assert f"| `{verdict}` | {code} |" in DOC


def test_every_report_field_is_documented() -> None:
    for cls in (results.Report, results.Coverage, results.RowRef, results.TensorResult,
                results.FirstDivergence, results.TokenMismatch, results.TextEdit, results.ContractDiff,
                results.ContractEntry,
                results.TraceInfo, Gap, Diagnosis, Acceptance):
        for field in dataclasses.fields(cls):
            assert f'"{field.name}"' in DOC, f"{cls.__name__}.{field.name}"


def test_evidence_variants_are_told_apart_by_their_fields() -> None:
    field_sets = [frozenset(f.name for f in dataclasses.fields(cls)) for cls in VARIANTS]
    assert len(set(field_sets)) == len(VARIANTS)
    for cls in VARIANTS:
        hints = typing.get_type_hints(cls)
        sample = cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})
        diagnosis = Diagnosis(cls.KINDS[0], "message", sample)
        again = from_plain(Diagnosis, to_plain(diagnosis))
        assert again == diagnosis and type(again.evidence) is cls


def _sample(tp):
    """A value of a field's type, for a round trip."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)[0]
    if typing.get_origin(tp) is list:  # an item of the list's type, and where it may be None, a None
        (item,) = typing.get_args(tp)
        return [_sample(item)] + ([None] if type(None) in typing.get_args(item) else [])
    if type(None) in typing.get_args(tp):  # X | None
        return _sample(next(t for t in typing.get_args(tp) if t is not type(None)))
    return {str: "x", int: 3, float: 0.5, bool: True}.get(tp)
