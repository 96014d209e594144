"""Concatenated inputs (target.aux, draft.fc_in): which recorded target state fills each slot.

Each side's slots are matched against that side's own target.embed / target.layer.i at the same
rows, so the answer does not depend on the other side being right.
"""

from __future__ import annotations

import numpy as np

from tracediff.diff.diagnose.types import Diagnosis
from tracediff.diff.differ import Comparison
from tracediff.diff.metrics import value_metrics
from tracediff.diff.pair import Pair
from tracediff.trace.reader import Rows, Trace

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


def _candidates(trace: Trace) -> list[str]:
    return [n for n in trace.names() if n == "target.embed" or n.startswith("target.layer.")]


def slot_sources(rows: Rows, picked: np.ndarray, trace: Trace, loaded: dict[str, Rows]) -> list[str | None]:
    """For each slot of the concatenated rows ``picked``, the candidate state it equals (or None).
    Candidate rows already read by the comparison (``loaded``) are reused."""
    keys = list(zip(rows.request[picked].tolist(), rows.position[picked].tolist()))
    gathered = {}  # candidate -> its values at the same (request, position) rows
    for name in _candidates(trace):
        state = loaded.get(name) or trace.rows(name, depth=0)
        where = {(r, p): i for i, (r, p) in enumerate(zip(state.request.tolist(), state.position.tolist()))}
        found = [where.get(key) for key in keys]
        if None not in found:
            gathered[name] = state.numpy()[found]
    if not gathered:
        return []
    width = next(iter(gathered.values())).shape[1]
    values = rows.numpy()[picked]
    if values.shape[1] % width:
        return []
    sources: list[str | None] = []
    for k in range(values.shape[1] // width):
        slot = values[:, k * width : (k + 1) * width]
        sources.append(next((name for name, state in gathered.items()
                             if (value_metrics(state, slot)["max_rel"] < SAME).all()), None))
    return sources


def aux_slots(comparison: Comparison, traces: Pair[Trace]) -> list[Diagnosis]:
    first = comparison.first_divergence
    failing = ("diverged", "downstream")
    names = [t.name for t in comparison.tensors if t.name in CONCATENATED and t.status in failing]
    if first is None or not names:
        return []
    name = names[0]
    rows, matched = comparison.rows[name], comparison.matched[name]
    picked = matched.map(lambda m: m[:SAMPLE_ROWS])
    loaded = Pair({n: r.a for n, r in comparison.rows.items()}, {n: r.b for n, r in comparison.rows.items()})
    sources = Pair(slot_sources(rows.a, picked.a, traces.a, loaded.a),
                   slot_sources(rows.b, picked.b, traces.b, loaded.b))
    if not sources.a or not sources.b or sources.a == sources.b:
        return []
    sides = traces.map(lambda t: str(t.meta.get("source") or "?"))
    side = Pair(sides.a if sides.a != sides.b else "a", sides.b if sides.a != sides.b else "b")
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
