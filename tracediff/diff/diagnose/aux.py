"""Concatenated inputs (target.aux, draft.fc_in): which recorded target state fills each slot.

Each side's slots are matched against that side's own target.embed / target.layer.i at the same
rows, so the answer does not depend on the other side being right.
"""

from __future__ import annotations

import numpy as np

from tracediff.diff.diagnose.evidence import failing_sample, side_labels
from tracediff.diff.diagnose.evidence import values as evidence_values
from tracediff.diff.diagnose.types import Diagnosis
from tracediff.diff.differ import Comparison
from tracediff.diff.metrics import float_metrics
from tracediff.diff.pair import Pair
from tracediff.trace.reader import RowKeys, Trace

CONCATENATED = ("target.aux", "draft.fc_in")
SAMPLE_ROWS = 32
SAME = 1e-4  # max_rel below which a slot is taken to be that state


def layer_number(name: str) -> int:
    """target.embed -> -1 (the input of layer 0), target.layer.i -> i."""
    return -1 if name == "target.embed" else int(name.rsplit(".", 1)[1])


def label(name: str | None) -> str:
    if name is None:
        return "?"
    return "embed" if name == "target.embed" else f"layer {layer_number(name)}"


def slot_sources(trace: Trace, keys: RowKeys, picked: np.ndarray,
                 known: dict[str, RowKeys]) -> list[str | None]:
    """For each slot of the concatenated rows ``picked``, the target state (embed or layer output)
    of the same trace at the same (request, position) that it equals, or None."""
    at = list(zip(keys.request[picked].tolist(), keys.position[picked].tolist()))
    values = evidence_values(trace, keys, picked)
    candidates = {}  # name -> its values at the same rows
    for name, state in known.items():
        if name != "target.embed" and not name.startswith("target.layer."):
            continue
        where = {}
        for i, key in enumerate(zip(state.request.tolist(), state.position.tolist())):
            if state.depth[i] == 0:
                where.setdefault(key, i)
        found = [where.get(key) for key in at]
        if None not in found:
            candidates[name] = evidence_values(trace, state, np.array(found))
    widths = {c.shape[1] for c in candidates.values()}
    if len(widths) != 1 or values.shape[1] % (width := widths.pop()):
        return []
    sources: list[str | None] = []
    for k in range(values.shape[1] // width):
        slot = values[:, k * width : (k + 1) * width]
        sources.append(next((name for name, state in candidates.items()
                             if (float_metrics(state, slot)["max_rel"] < SAME).all()), None))
    return sources


def aux_slots(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    first = comparison.first_divergence
    failing = ("diverged", "downstream")
    names = [t.name for t in comparison.tensors if t.name in CONCATENATED and t.status in failing]
    if first is None or not names or comparison.plan is None:
        return []
    name = names[0]
    plan = comparison.plan
    tensor = next(t for t in plan.tensors if t.name == name)
    picked = failing_sample(comparison, name).map(lambda rows: rows[:SAMPLE_ROWS])
    sources = Pair(slot_sources(traces.a, tensor.keys.a, picked.a, plan.keys.a),
                   slot_sources(traces.b, tensor.keys.b, picked.b, plan.keys.b))
    if not sources.a or not sources.b or sources.a == sources.b:
        return []
    side = side_labels(traces)
    said = sources.map(lambda s: "[" + ", ".join(label(n) for n in s) + "]")
    evidence = {"tensor": name, "slots_a": sources.a, "slots_b": sources.b, "rows_checked": len(picked.a)}
    if None not in sources.a and None not in sources.b:
        layers = sources.map(lambda s: [layer_number(n) for n in s])
        shift = {b - a for a, b in zip(layers.a, layers.b)}
        fed = f"{side.b} fed {said.b}, {side.a} fed {said.a}"
        if len(layers.a) == len(layers.b) and len(shift) == 1 and abs(shift.pop()) == 1:
            return [Diagnosis("layer_offset", f"every {name} slot is one layer apart: {fed} "
                              "(output-of-layer vs input-to-layer convention)", evidence)]
        if sorted(layers.a) == sorted(layers.b):
            return [Diagnosis("aux_order", f"same aux layers, other order: {fed}", evidence)]
    return [Diagnosis("aux_layer_set", f"aux layer set differs: {side.b} fed {said.b}, {side.a} fed {said.a}",
                      evidence)]
