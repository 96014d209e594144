"""Planning a comparison from key columns only: which rows of each tensor correspond, and in
which order to read them. The plan is plain data; ``differ`` executes it chunk by chunk, so
memory stays bounded by the chunk size, not by the traces' size.

Chunks run in the baseline's execution order: by step, then by dataflow order (the order the
baseline first logged each name), then by row. The first chunk with a failing row therefore holds
the first divergence, and a compare told to stop there reads nothing after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.align import FED, Matched, Prefixes, fed_tokens, match, match_by_step
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import storage_dtype
from tracediff.trace.reader import RowKeys, Trace

CHUNK_BYTES = 8 << 20  # raw bytes per side per chunk
ALIGNMENTS = ("prefix", "step")


@dataclass
class TensorPlan:
    """One tensor name present on both sides: its rows and the ones that correspond."""

    name: str  # as the baseline (a) calls it
    keys: Pair[RowKeys]
    matched: Matched


@dataclass
class Chunk:
    tensor: TensorPlan
    rows: Pair[np.ndarray]  # corresponding row numbers into tensor.keys, a's order
    step: int  # the baseline's step of these rows


@dataclass
class Plan:
    tensors: list[TensorPlan]  # in a's dataflow order
    missing_in_a: list[str]
    missing_in_b: list[str]
    chunks: list[Chunk]
    prefixes: Pair[Prefixes]
    keys: Pair[dict[str, RowKeys]]  # every non-static name of each side, for the diagnoses


def tensor_keys(trace: Trace) -> dict[str, RowKeys]:
    """Key columns of every name that has per-row records (static weights, d2t are left out)."""
    out = {}
    for name in trace.names():
        if not trace.index.static[trace.select(name=name)].all():
            out[name] = trace.keys(name)
    return out


def make_plan(traces: Pair[Trace], rename: dict[str, str] | None = None, align: str = "prefix",
              chunk_bytes: int = CHUNK_BYTES) -> Plan:
    """``rename`` maps names in b to names in a (``--map NAME_IN_B=NAME_IN_A``); ``align`` is
    ``prefix`` (rows by token content) or ``step`` (rows by step and order, same producer)."""
    if align not in ALIGNMENTS:
        raise ValueError(f"--align takes 'prefix' or 'step', not {align!r}")
    rename = rename or {}
    keys = traces.map(tensor_keys)
    keys = Pair(keys.a, {rename.get(n, n): k for n, k in keys.b.items()})
    prefixes = keys.map(lambda k: Prefixes.of(list(k.values())))
    fed = Pair(fed_tokens(traces.a, keys.a.get(FED), prefixes.a),
               fed_tokens(traces.b, keys.b.get(FED), prefixes.b))
    tensors = []
    for name in keys.a:
        if name in keys.b:
            both = Pair(keys.a[name], keys.b[name])
            matched = match(both, prefixes, fed) if align == "prefix" else match_by_step(both)
            tensors.append(TensorPlan(name, both, matched))
    return Plan(tensors=tensors, missing_in_a=[n for n in keys.b if n not in keys.a],
                missing_in_b=[n for n in keys.a if n not in keys.b],
                chunks=chunks_of(tensors, chunk_bytes), prefixes=prefixes, keys=keys)


def chunks_of(tensors: list[TensorPlan], chunk_bytes: int) -> list[Chunk]:
    """Split each tensor's corresponding rows at step changes and every ``chunk_bytes``, then order
    all chunks by (step, dataflow order, row)."""
    ordered = []
    for order, tensor in enumerate(tensors):
        a_rows, b_rows = tensor.matched.rows.a, tensor.matched.rows.b
        if not len(a_rows):
            continue
        row_bytes = max(_row_bytes(tensor.keys.a), _row_bytes(tensor.keys.b), 1)
        per_chunk = max(1, chunk_bytes // row_bytes)
        steps = tensor.keys.a.step[a_rows]
        cuts = set(np.flatnonzero(np.diff(steps)) + 1) | set(range(per_chunk, len(a_rows), per_chunk))
        bounds = [0, *sorted(cuts), len(a_rows)]
        for start, stop in zip(bounds, bounds[1:]):
            chunk = Chunk(tensor, Pair(a_rows[start:stop], b_rows[start:stop]), int(steps[start]))
            ordered.append(((chunk.step, order, start), chunk))
    ordered.sort(key=lambda item: item[0])
    return [chunk for _, chunk in ordered]


def _row_bytes(keys: RowKeys) -> int:
    return int(np.prod(keys.row_shape, dtype=np.int64)) * storage_dtype(keys.dtype).itemsize
