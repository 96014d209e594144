"""Explanations of a divergence. Each module has one function (Comparison, traces) -> findings;
``DIAGNOSES`` runs them in order. A new explanation is one new module added here."""

from __future__ import annotations

from tracediff.diff.diagnose.aux import aux_slots
from tracediff.diff.diagnose.nan_inf import nan_inf
from tracediff.diff.diagnose.types import Diagnosis
from tracediff.diff.differ import Comparison
from tracediff.diff.pair import Pair
from tracediff.trace.reader import Trace

DIAGNOSES = (nan_inf, aux_slots)


def diagnose(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    return [d for explain in DIAGNOSES for d in explain(comparison, traces)]


__all__ = ["DIAGNOSES", "Diagnosis", "diagnose"]
