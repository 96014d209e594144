"""Vocab map: the draft's d2t differs between the sides, or one side reads it as a direct map
(target = d2t[draft id]) where the other adds offsets (target = draft id + d2t[draft id])."""

from __future__ import annotations

import numpy as np

from tracediff.diff.diagnose.evidence import failing_sample, side_labels, values
from tracediff.diff.differ import Comparison
from tracediff.diff.findings import D2tEntriesEvidence, D2tSizeEvidence, Diagnosis, DirectMapEvidence, Side
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import decode
from tracediff.trace.reader import RowKeys, Trace

DRAFT_IDS, MAPPED, D2T = "draft.token", "draft.token_target", "draft.d2t"


def static_value(trace: Trace, name: str) -> np.ndarray | None:
    """The last static record of ``name``, decoded; None when the trace has none."""
    hits = [i for i in trace.select(name=name) if trace.index.static[i]]
    if not hits:
        return None
    record = trace.read(hits[-1])
    return decode(record.data, record.dtype)


def vocab_map(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    if comparison.first_divergence is None:
        return []
    return [*_d2t_differs(traces), *_read_differently(comparison, traces)]


def _d2t_differs(traces: Pair[Trace]) -> list[Diagnosis]:
    d2t = traces.map(lambda t: static_value(t, D2T))
    if d2t.a is None or d2t.b is None or np.array_equal(d2t.a, d2t.b):
        return []
    labels = side_labels(traces)
    if d2t.a.shape != d2t.b.shape:
        return [Diagnosis("vocab_map", f"d2t differs: {labels.a} maps {len(d2t.a)} draft ids, {labels.b} "
                          f"{len(d2t.b)}", D2tSizeEvidence(len(d2t.a), len(d2t.b)))]
    differ = np.flatnonzero(d2t.a != d2t.b)
    i = int(differ[0])
    return [Diagnosis("vocab_map", f"d2t differs between the sides in {len(differ)} of {len(d2t.a)} draft "
                      f"ids (draft id {i}: {labels.a} maps it to target {i + int(d2t.a[i])}, {labels.b} to "
                      f"{i + int(d2t.b[i])}): the draft was paired with another vocab map",
                      D2tEntriesEvidence(entries_differing=len(differ), first_draft_id=i,
                                         target_a=i + int(d2t.a[i]), target_b=i + int(d2t.b[i])))]


def _read_differently(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    """Same draft ids on both sides, and the mapped ids differ by exactly the draft id: one side
    added offsets, the other did not."""
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
    labels = side_labels(traces)
    readings: tuple[tuple[Side, Side], ...] = (("b", "a"), ("a", "b"))  # (direct, offset)
    for direct, offset in readings:
        if np.array_equal(getattr(mapped, offset) - getattr(mapped, direct), ids.a):
            return [Diagnosis("vocab_map", f"{getattr(labels, direct)} reads d2t as a direct map (target = "
                              f"d2t[draft id]); {getattr(labels, offset)} adds offsets (target = draft id + "
                              f"d2t[draft id]), as EAGLE-3 checkpoints mean",
                              DirectMapEvidence(rows_checked=len(ids.a), direct_side=direct))]
    return []


def _same_rows(keys: RowKeys, rows: np.ndarray, other: RowKeys) -> np.ndarray | None:
    """Rows of ``other`` with the same (request, position, depth, step) as ``rows`` of ``keys``."""
    where: dict[tuple[str, int, int, int], int] = {}
    for j, key in enumerate(zip(other.request.tolist(), other.position.tolist(), other.depth.tolist(),
                                other.step.tolist())):
        where.setdefault(key, j)
    found = [where.get((keys.request[r], int(keys.position[r]), int(keys.depth[r]), int(keys.step[r])))
             for r in rows.tolist()]
    return None if None in found else np.array(found, dtype=np.int64)
