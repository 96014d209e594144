"""From what was compared to what may be claimed: the verdict and its reasons, and the typed
``Report``. A verdict never claims more than was compared: ``match`` needs every tensor present on
both sides aligned on at least ``min_coverage`` of its comparable rows."""

from __future__ import annotations

from typing import NamedTuple

from tracediff.diff.contract_diff import ignoring_target, incomparable, shares_tokens
from tracediff.diff.differ import Comparison
from tracediff.diff.pair import Pair
from tracediff.diff.results import (
    EXCUSED,
    INCOMPLETE_STATUSES,
    REASON_TEXT,
    Coverage,
    Diagnosis,
    FirstDivergence,
    Report,
    TensorResult,
    TraceInfo,
    Verdict,
    side_labels,
)
from tracediff.diff.shortfall import find_shortfall, is_short
from tracediff.diff.tokenview import token_view
from tracediff.eagle3.acceptance import recorded_acceptance
from tracediff.trace.completeness import Gap, unrecorded
from tracediff.trace.reader import Trace

MIN_COVERAGE = 0.95


class SideGaps(NamedTuple):
    counted: list[Gap]  # keep the verdict from a match
    ignored: list[Gap]  # of tensors the other side lacks too: said, never counted


def side_gaps(traces: Pair[Trace], tensors: list[TensorResult], renamed: dict[str, str]) -> Pair[SideGaps]:
    """Each side's gaps (``Trace.completeness``) split by whether they cost the verdict: a stop, a
    writer never closed and missing rank files always do; records dropped of a tensor do where the
    other side holds that tensor; a name a producer attached and the trace never recorded does where
    the other side holds it and the user's filters did not keep it out. ``renamed``: b's name -> a's."""
    to_b = {a: b for b, a in renamed.items()}
    status = {t.name: t.status for t in tensors}

    def dropped(side: str, trace: Trace) -> set[str]:  # a's names of the tensors a side dropped records of
        return {renamed.get(g.tensor, g.tensor) if side == "b" else g.tensor
                for g in trace.completeness.gaps if g.kind == "dropped"}

    def gaps(side: str, trace: Trace) -> SideGaps:
        mine = trace.completeness
        lacks = "missing_in_a" if side == "b" else "missing_in_b"  # the other side lacks the tensor
        theirs = dropped("a", traces.a) if side == "b" else dropped("b", traces.b)
        counted, ignored = list(mine.whole_trace()), list[Gap]()
        for gap in (g for g in mine.gaps if g.tensor):
            name = renamed.get(gap.tensor, gap.tensor) if side == "b" else gap.tensor
            # the other side holds it, or logged it too and dropped it (then neither compared any)
            held = (status.get(name, lacks) != lacks or name in theirs) and not mine.filtered_out(gap.tensor)
            (counted if held else ignored).append(gap)
        for t in tensors:
            if t.status == f"missing_in_{side}":
                lacking = unrecorded(mine, to_b.get(t.name, t.name) if side == "b" else t.name)
                counted.extend([lacking] if lacking is not None else [])
        return SideGaps(counted, ignored)

    return Pair(gaps("a", traces.a), gaps("b", traces.b))


def gap_tensors(gaps: Pair[SideGaps], renamed: dict[str, str]) -> tuple[str, ...]:
    """a's names of the tensors whose counted gaps are a tensor's (b's names read through ``--map``)."""
    return tuple(dict.fromkeys([g.tensor for g in gaps.a.counted if g.tensor]
                               + [renamed.get(g.tensor, g.tensor) for g in gaps.b.counted if g.tensor]))


def gap_lines(gaps: Pair[SideGaps], labels: Pair[str]) -> list[str]:
    """One reason line per gap that costs the verdict, side a first."""
    return [g.line(label) for side, label in ((gaps.a, labels.a), (gaps.b, labels.b)) for g in side.counted]


def trace_info(trace: Trace, gaps: SideGaps | None = None) -> TraceInfo:
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
                     row_keys=str(trace.contract.get("row_keys") or ""),
                     acceptance=recorded_acceptance(trace), gaps=list(gaps.counted) if gaps else [],
                     gaps_ignored=list(gaps.ignored) if gaps else [], filtered=_filtered(trace), **text)


def _filtered(trace: Trace) -> list[str]:
    """The user's name filters at recording, where they kept anything out."""
    said = trace.completeness
    kept = [] if said.names == ("*",) else [f"names={','.join(said.names)}"]
    sliced = [f"slice names={','.join(chosen)}" for chosen in said.selected]
    return kept + ([f"exclude={','.join(said.exclude)}"] if said.exclude else []) + sliced


def _positive(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def shortfalls(tensors: list[TensorResult], min_coverage: float) -> list[str]:
    """One line per tensor present on both sides that was not compared well enough."""
    lines = []
    for t in (t for t in tensors if is_short(t, min_coverage)):
        if t.status in INCOMPLETE_STATUSES[1:]:
            lines.append(f"{t.name}: {t.status.replace('_', ' ')}: {t.note}")
        elif t.coverage is not None and not t.coverage.aligned:
            lines.append(f"{t.name}: no row compared: {t.coverage.describe()}")
        elif t.coverage is not None:
            lines.append(f"{t.name}: {t.coverage.describe()}")
    return lines


# What a depth's rows left out most says why none of them was compared.
DEPTH_WHY = {"fed_differs": "the two sides drafted other tokens",
             "fed_unknown": "a side did not record the tokens it fed (draft.input_ids)",
             "past_other_text": "every chain runs past the other side's text"}


def depth_shortfalls(coverage: Coverage) -> list[str]:
    """One line per run of draft depths that were never compared: depths only one side recorded
    (a draft unrolled or served deeper on one side: a clamped ``num_steps``, a longer TTT), and
    depths both sides recorded where no row could be compared. Neither ever counts as covered."""
    runs: list[tuple[list[Coverage], str]] = []
    for d in coverage.depths:
        if d.aligned or d.depth is None:
            continue
        side = d.one_sided
        if side is not None:
            why = f"only {side}"
        else:
            top = _main_reason(d)
            why = DEPTH_WHY.get(top, REASON_TEXT.get(top, top) or "nothing aligned")
        if runs and runs[-1][1] == why and runs[-1][0][-1].depth == d.depth - 1:
            runs[-1][0].append(d)
        else:
            runs.append(([d], why))
    lines = []
    for depths, why in runs:
        span = depth_span([d.depth for d in depths if d.depth is not None])
        rows = f"{sum(d.rows_a for d in depths)} / {sum(d.rows_b for d in depths)} rows"
        if why.startswith("only "):
            lines.append(f"{span}: {why} recorded rows there ({rows}): never compared")
        else:
            lines.append(f"{span}: no row comparable ({rows}), {why}")
    return lines


def _main_reason(d: Coverage) -> str:
    """Why a depth both sides recorded had no row compared: the reason most of the rows of the side
    with fewer rows were left out for (both sides' where they hold as many). The other side's extra
    rows are those the fewer never held (a TTT unrolls every row, a server drafts from its anchors):
    "not recorded" there never says why the rows both sides drafted were not comparable."""
    fewer = d.skipped_a if d.rows_a < d.rows_b else d.skipped_b
    skipped: dict[str, int] = {}
    for side in [fewer] if d.rows_a != d.rows_b else [d.skipped_a, d.skipped_b]:
        for reason, n in side.items():
            skipped[reason] = skipped.get(reason, 0) + n
    return max(skipped, key=lambda r: skipped[r]) if skipped else ""


def depth_span(depths: list[int]) -> str:
    """'depth 3' or 'depths 2-6'."""
    return f"depth {depths[0]}" if len(depths) == 1 else f"depths {depths[0]}-{depths[-1]}"


def nothing_shared(tensors: list[TensorResult]) -> bool:
    """No row aligned, and not for want of knowledge (unknown prefixes, unrecorded fed tokens): what
    was left out lies outside the tokens the sides share."""
    total = Coverage.total([t.coverage for t in tensors if t.coverage is not None])
    known = {"outside_shared_prefix", *EXCUSED}
    return not total.aligned and bool(total.skipped_a or total.skipped_b) \
        and set(total.skipped_a) | set(total.skipped_b) <= known


def judge(comparison: Comparison, min_coverage: float, same_target: bool = False,
          gaps: list[str] | None = None, labels: tuple[str, str] = ("a", "b")) -> tuple[Verdict, list[str]]:
    """The verdict and its reasons; ``same_target``: the user declared the targets the same model
    (``--same-target``), so the target facts the contracts state never make the pair incomparable;
    ``gaps``: the lines of what a side lacks that costs the verdict (``gap_lines``), first among the
    reasons; ``labels``: how the reasons name the sides. Partial data can prove a difference, never a
    match. Text both sides recorded that differs (``Comparison.text_edit``) is a divergence, named
    first: the rows past it are not comparable because the sides were fed other text, not because a
    trace is partial; where no row of one side can stand for a row of the other, it says why the
    pair is incomparable."""
    stated = ignoring_target(comparison.contract) if same_target else comparison.contract
    reasons = incomparable(stated, comparison.plan.prefixes)
    about_text = len(reasons) == int(not shares_tokens(comparison.plan.prefixes))  # only the tokens part them
    edit = [comparison.text_edit.line(labels)] if comparison.text_edit is not None else []
    on_both = [t for t in comparison.tensors if t.coverage is not None]
    if not on_both and not gaps:  # with gaps: what one side lacks may be all the other holds
        reasons.append("no tensor name is in both traces (see --map)")
        about_text = False
    elif not reasons and nothing_shared(on_both):
        reasons.append("no row of one trace corresponds to a row of the other (different tokens?)")
    if reasons:
        return "incomparable", (edit + reasons if about_text else reasons + edit)
    lines = list(gaps or []) + shortfalls(comparison.tensors, min_coverage) + depth_shortfalls(Coverage.total(
        [t.coverage for t in on_both if t.coverage is not None]))
    if comparison.first_divergence is not None or edit:
        return "diverged", edit + lines
    return ("incomplete", lines) if lines else ("match", [])


def build_report(comparison: Comparison, diagnoses: list[Diagnosis], traces: Pair[Trace], align: str,
                 min_coverage: float, same_target: bool = False, renamed: dict[str, str] | None = None,
                 same_file: bool = False) -> Report:
    """``renamed``: the ``--map`` renames (name in b -> name in a); ``same_file``: both sides are the
    same files."""
    gaps = side_gaps(traces, comparison.tensors, renamed or {})
    a, b = trace_info(traces.a, gaps.a), trace_info(traces.b, gaps.b)
    labels = side_labels(a, b)
    verdict, reasons = judge(comparison, min_coverage, same_target, gap_lines(gaps, Pair(*labels)), labels)
    first = comparison.first_divergence
    row = None if first is None else first.first_bad
    return Report(
        verdict=verdict, reasons=reasons, a=a, b=b,
        align="step" if align == "step" else "prefix", min_coverage=min_coverage,
        coverage=Coverage.total([t.coverage for t in comparison.tensors if t.coverage is not None]),
        first_divergence=None if first is None or row is None else FirstDivergence(first.name, row),
        diagnoses=diagnoses, tensors=comparison.tensors, contract=comparison.contract,
        token_mismatch=comparison.token_mismatch, text_edit=comparison.text_edit,
        tokens=token_view(comparison.plan.prefixes, comparison.text_edit or comparison.token_mismatch, row),
        renamed={b: a for b, a in (renamed or {}).items() if b != a}, same_file=same_file,
        same_target=same_target,
        shortfall=find_shortfall(comparison.tensors, comparison.plan, min_coverage,
                                 gap_tensors(gaps, renamed or {})) if verdict == "incomplete" else None,
    )
