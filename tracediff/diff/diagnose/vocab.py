"""Vocab map: the draft's d2t differs between the sides (in size, or in entries: then the side
whose own table is unsound, e.g. a d2t holding target ids instead of offsets, is named), or one side
reads it as a direct map (target = d2t[draft id]) where the other adds offsets (target = draft id +
d2t[draft id]), each side judged by its own recorded table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.diagnose.evidence import Context, failing_sample, values
from tracediff.diff.findings import D2tEntriesEvidence, D2tSizeEvidence, Diagnosis, DirectMapEvidence, Side
from tracediff.diff.pair import Pair
from tracediff.eagle3.names import DRAFT_D2T, DRAFT_T2D, DRAFT_TOKEN, DRAFT_TOKEN_TARGET
from tracediff.eagle3.vocab import Finding, check_vocab_map, infer_mapping
from tracediff.trace.reader import RowKeys, Trace

DRAFT_IDS, MAPPED, D2T, T2D = DRAFT_TOKEN, DRAFT_TOKEN_TARGET, DRAFT_D2T, DRAFT_T2D


def static_value(trace: Trace, name: str) -> np.ndarray | None:
    """The last static record of ``name``, decoded; None when the trace has none."""
    record = trace.last_static(name)
    return None if record is None else record.numpy()


@dataclass(frozen=True)
class VocabTable:
    """One side's recorded vocab map (None where the trace holds no such static)."""

    d2t: np.ndarray | None
    t2d: np.ndarray | None

    @classmethod
    def of(cls, trace: Trace) -> VocabTable:
        return cls(static_value(trace, D2T), static_value(trace, T2D))

    def problem(self) -> Finding | None:
        """The first error ``check_vocab_map`` finds in this table (over the target vocab its t2d
        spans), None when it is sound or not recorded whole."""
        if self.d2t is None or self.t2d is None:
            return None
        return next((f for f in check_vocab_map(self.d2t, self.t2d, len(self.t2d)) if f.severity == "error"),
                    None)


def vocab_map(ctx: Context) -> list[Diagnosis]:
    if ctx.first is None:
        return []
    tables = ctx.traces.map(VocabTable.of)
    return [*_d2t_differs(tables, ctx.labels), *_read_differently(ctx, tables)]


def _d2t_differs(tables: Pair[VocabTable], labels: Pair[str]) -> list[Diagnosis]:
    d2t = tables.map(lambda t: t.d2t)
    if d2t.a is None or d2t.b is None or np.array_equal(d2t.a, d2t.b):
        return []
    if d2t.a.shape != d2t.b.shape:
        return [Diagnosis("vocab_map", f"draft vocab size differs: {labels.a}'s d2t maps {len(d2t.a)} draft "
                          f"ids, {labels.b}'s {len(d2t.b)}{_target_sizes(tables)}: the sides hold vocab maps "
                          "of other draft vocab sizes (a draft built for another vocab map?)",
                          D2tSizeEvidence(len(d2t.a), len(d2t.b)))]
    differ = np.flatnonzero(d2t.a != d2t.b)
    i = int(differ[0])
    wrong, problem = _wrong_table(tables)
    message = (f"d2t differs between the sides in {len(differ)} of {len(d2t.a)} draft ids (draft id {i}: "
               f"{labels.a} maps it to target {i + int(d2t.a[i])}, {labels.b} to {i + int(d2t.b[i])})")
    if wrong is None or problem is None:
        message += ": the draft was paired with another vocab map"
    else:
        message += f": {getattr(labels, wrong)}'s {problem.message}; {problem.fix}"
    return [Diagnosis("vocab_map", message, D2tEntriesEvidence(
        entries_differing=len(differ), first_draft_id=i, target_a=i + int(d2t.a[i]),
        target_b=i + int(d2t.b[i]), wrong_side=wrong, problem=problem.code if problem else None))]


def _target_sizes(tables: Pair[VocabTable]) -> str:
    """', over target vocab sizes 100 and 120' when the sides' t2d differ in length, else ''."""
    t2d = tables.map(lambda t: t.t2d)
    if t2d.a is None or t2d.b is None or len(t2d.a) == len(t2d.b):
        return ""
    return f", over target vocab sizes {len(t2d.a)} and {len(t2d.b)}"


def _wrong_table(tables: Pair[VocabTable]) -> tuple[Side | None, Finding | None]:
    """The one side whose own table is unsound (``check_vocab_map``), with its first error."""
    problems = tables.map(VocabTable.problem)
    if (problems.a is None) == (problems.b is None):
        return None, None
    return ("a", problems.a) if problems.a is not None else ("b", problems.b)


def _read_differently(ctx: Context, tables: Pair[VocabTable]) -> list[Diagnosis]:
    """Same draft ids on both sides, one side's mapped ids its own d2t read as a direct map, the
    other's read as offsets. Without both tables recorded: the mapped ids differ by exactly the
    draft id (the sides then share one table)."""
    comparison, traces, labels = ctx.comparison, ctx.traces, ctx.labels
    plan = comparison.plan
    tensor = next((t for t in plan.tensors if t.name == MAPPED), None)
    ids_a, ids_b = plan.keys.a.get(DRAFT_IDS), plan.keys.b.get(DRAFT_IDS)
    if tensor is None or ids_a is None or ids_b is None or not comparison.tallies[MAPPED].bad_rows.a:
        return []
    ids_keys = Pair(ids_a, ids_b)
    rows = failing_sample(comparison, MAPPED)
    mapped = Pair(values(traces.a, tensor.keys.a, rows.a), values(traces.b, tensor.keys.b, rows.b))
    same_rows = Pair(_same_rows(tensor.keys.a, rows.a, ids_keys.a),
                     _same_rows(tensor.keys.b, rows.b, ids_keys.b))
    if same_rows.a is None or same_rows.b is None:
        return []
    ids = Pair(values(traces.a, ids_keys.a, same_rows.a), values(traces.b, ids_keys.b, same_rows.b))
    if not np.array_equal(ids.a, ids.b):
        return []
    direct = _direct_side(ids.a, mapped, tables)
    if direct is None:
        return []
    offset: Side = "a" if direct == "b" else "b"
    return [Diagnosis("vocab_map", f"{getattr(labels, direct)} reads d2t as a direct map (target = "
                      f"d2t[draft id]); {getattr(labels, offset)} adds offsets (target = draft id + "
                      f"d2t[draft id]), as EAGLE-3 checkpoints mean",
                      DirectMapEvidence(rows_checked=len(ids.a), direct_side=direct))]


def _direct_side(ids: np.ndarray, mapped: Pair[np.ndarray], tables: Pair[VocabTable]) -> Side | None:
    """The side reading d2t as a direct map where the other adds offsets, else None. Each side is
    judged by its own recorded table: sides that both add offsets to tables that differ read them
    alike (their tables differ: ``_d2t_differs``)."""
    d2t = tables.map(lambda t: t.d2t)
    draft = ids.astype(np.int64).ravel()
    if d2t.a is not None and d2t.b is not None:
        if draft.min(initial=0) < 0 or draft.max(initial=0) >= min(len(d2t.a), len(d2t.b)):
            return None
        readings = mapped.zip(d2t).starmap(lambda m, table: infer_mapping(draft, m.ravel(), table))
        directs: dict[tuple[str, str], Side] = {("direct", "offset"): "a", ("offset", "direct"): "b"}
        return directs.get((readings.a, readings.b))
    sides: tuple[tuple[Side, Side], ...] = (("b", "a"), ("a", "b"))  # (direct, offset)
    return next((direct for direct, offset in sides
                 if np.array_equal(getattr(mapped, offset) - getattr(mapped, direct), ids)), None)


def _same_rows(keys: RowKeys, rows: np.ndarray, other: RowKeys) -> np.ndarray | None:
    """Rows of ``other`` with the same (request, position, depth, step) as ``rows`` of ``keys``."""
    where: dict[tuple[str, int, int, int], int] = {}
    for j, key in enumerate(zip(other.request.tolist(), other.position.tolist(), other.depth.tolist(),
                                other.step.tolist())):
        where.setdefault(key, j)
    found = [where.get((keys.request[r], int(keys.position[r]), int(keys.depth[r]), int(keys.step[r])))
             for r in rows.tolist()]
    return None if None in found else np.array(found, dtype=np.int64)
