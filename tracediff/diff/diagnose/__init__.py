"""Explanations of a divergence. Each module has one rule, a function (Context) -> findings: every
rule reads the one ``Context`` of the compare (evidence.py: the comparison, the traces and the facts
of the first divergence computed once for all). ``DIAGNOSES`` runs them in order, after the token
check (``STATIC_DIAGNOSES`` when the first divergence is a static tensor, which has no rows to
sample). A new explanation is one new module added here. ``precision`` runs last and only when
nothing else explains the divergence."""

from __future__ import annotations

from tracediff.diff.diagnose.aux import aux_quirks, aux_slots
from tracediff.diff.diagnose.config import config_causes
from tracediff.diff.diagnose.depths import draft_depths
from tracediff.diff.diagnose.evidence import Context
from tracediff.diff.diagnose.nan_inf import nan_inf
from tracediff.diff.diagnose.precision import precision
from tracediff.diff.diagnose.readings import engine_readings
from tracediff.diff.diagnose.scale import scale_or_norm
from tracediff.diff.diagnose.shift import position_shift
from tracediff.diff.diagnose.tokens import token_mismatch
from tracediff.diff.diagnose.vocab import vocab_map
from tracediff.diff.differ import Comparison
from tracediff.diff.findings import Diagnosis
from tracediff.diff.pair import Pair
from tracediff.trace.reader import Trace

DIAGNOSES = (nan_inf, aux_slots, vocab_map, position_shift, engine_readings, scale_or_norm, config_causes)
STATIC_DIAGNOSES = (vocab_map,)
COVERAGE_DIAGNOSES = (draft_depths, aux_quirks)  # what was never compared, and why: run on every compare


def diagnose(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    """Token differences first (a cause upstream of every tensor; when the first divergence consumed
    the differing token, nothing else is looked for), then the explanations of the divergence."""
    ctx = Context(comparison, traces)
    tokens = token_mismatch(ctx)
    unseen = [d for explain in COVERAGE_DIAGNOSES for d in explain(ctx)]
    if any(d.severity == "error" for d in tokens) or comparison.first_divergence is None:
        return tokens + unseen
    static = comparison.first_divergence.name in {s.name for s in comparison.plan.statics}
    explanations = STATIC_DIAGNOSES if static else DIAGNOSES
    found = [d for explain in explanations for d in explain(ctx)]
    return tokens + (found or ([] if static else precision(ctx))) + unseen


__all__ = ["COVERAGE_DIAGNOSES", "DIAGNOSES", "STATIC_DIAGNOSES", "Context", "Diagnosis", "diagnose"]
