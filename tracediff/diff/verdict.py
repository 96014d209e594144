"""From what was compared to what may be claimed: the verdict and its reasons, and the typed
``Report``. A verdict never claims more than was compared: ``match`` needs every tensor present on
both sides aligned on at least ``min_coverage`` of its comparable rows."""

from __future__ import annotations

from tracediff.diff.contract import contract, incomparable
from tracediff.diff.differ import Comparison
from tracediff.diff.pair import Pair
from tracediff.diff.results import (
    EXCUSED,
    INCOMPLETE_STATUSES,
    Coverage,
    Diagnosis,
    FirstDivergence,
    Report,
    TensorResult,
    TraceInfo,
    Verdict,
)
from tracediff.diff.tokenview import token_view
from tracediff.trace.reader import Trace

MIN_COVERAGE = 0.95


def trace_info(trace: Trace) -> TraceInfo:
    meta = trace.meta
    torch = meta.get("torch")
    torch = torch if isinstance(torch, dict) else {}
    version = meta.get("format_version")
    version = version if isinstance(version, int) and not isinstance(version, bool) else 0
    text = {key: str(meta.get(key) or "") for key in ("source", "producer", "producer_version", "created")}
    return TraceInfo(paths=[str(p) for p in trace.paths],
                     format_version=version,
                     torch=str(torch.get("version") or ""), device=str(torch.get("device") or ""),
                     closed=trace.complete, world_size=_positive(meta.get("world_size")),
                     row_keys=str(contract(trace).get("row_keys") or ""), **text)


def _positive(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def shortfalls(tensors: list[TensorResult], min_coverage: float) -> list[str]:
    """One line per tensor present on both sides that was not compared well enough."""
    lines = []
    for t in tensors:
        if t.status in INCOMPLETE_STATUSES[1:]:
            lines.append(f"{t.name}: {t.status.replace('_', ' ')}: {t.note}")
        elif t.coverage is not None and not t.coverage.aligned:
            lines.append(f"{t.name}: no row compared: {t.coverage.describe()}")
        elif t.coverage is not None and (t.coverage.fraction or 0.0) < min_coverage:
            lines.append(f"{t.name}: {t.coverage.describe()}")
    return lines


def nothing_shared(tensors: list[TensorResult]) -> bool:
    """No row aligned, and not for want of knowledge (unknown prefixes, unrecorded fed tokens): what
    was left out lies outside the tokens the sides share."""
    total = Coverage.total([t.coverage for t in tensors if t.coverage is not None])
    known = {"outside_shared_prefix", *EXCUSED}
    return not total.aligned and bool(total.skipped_a or total.skipped_b) \
        and set(total.skipped_a) | set(total.skipped_b) <= known


def judge(comparison: Comparison, min_coverage: float) -> tuple[Verdict, list[str]]:
    reasons = incomparable(comparison.contract, comparison.plan.prefixes)
    on_both = [t for t in comparison.tensors if t.coverage is not None]
    if not on_both:
        reasons.append("no tensor name is in both traces (see --map)")
    elif not reasons and nothing_shared(on_both):
        reasons.append("no row of one trace corresponds to a row of the other (different tokens?)")
    if reasons:
        return "incomparable", reasons
    if comparison.first_divergence is not None:
        return "diverged", shortfalls(comparison.tensors, min_coverage)
    lines = shortfalls(comparison.tensors, min_coverage)
    return ("incomplete", lines) if lines else ("match", [])


def build_report(comparison: Comparison, diagnoses: list[Diagnosis], traces: Pair[Trace], align: str,
                 min_coverage: float) -> Report:
    verdict, reasons = judge(comparison, min_coverage)
    first = comparison.first_divergence
    row = None if first is None else first.first_bad
    return Report(
        verdict=verdict, reasons=reasons, a=trace_info(traces.a), b=trace_info(traces.b),
        align="step" if align == "step" else "prefix", min_coverage=min_coverage,
        coverage=Coverage.total([t.coverage for t in comparison.tensors if t.coverage is not None]),
        first_divergence=None if first is None or row is None else FirstDivergence(first.name, row),
        diagnoses=diagnoses, tensors=comparison.tensors, contract=comparison.contract,
        token_mismatch=comparison.token_mismatch,
        tokens=token_view(comparison.plan.prefixes, comparison.token_mismatch, row),
    )
