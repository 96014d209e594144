"""Planning a comparison from key columns only: which rows of each tensor correspond, and in
which order to read them. The plan is plain data; ``differ`` executes it chunk by chunk, so
memory stays bounded by the chunk size, not by the traces' size.

Chunks run in the baseline's execution order: the baseline's steps are grouped into windows of
about ``chunk_bytes`` (over all names); within a window by dataflow order (the order the baseline
first logged each name), then by row. Once a window holds a failing row, the first divergence is
settled (the failing row with the earliest step, then the earliest name), and a compare told to
stop there reads no further window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracediff.diff.align import FED, Matched, Prefixes, fed_tokens, match, match_by_step
from tracediff.diff.pair import Pair
from tracediff.errors import TraceError
from tracediff.trace.reader import RowKeys, Trace

CHUNK_BYTES = 16 << 20  # raw bytes per side per chunk
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
    order: int  # the tensor's place in dataflow order
    rows: Pair[np.ndarray]  # corresponding row numbers into tensor.keys, a's order
    window: int  # the window of baseline steps these rows belong to

    @property
    def nbytes(self) -> Pair[int]:
        """Raw bytes of the chunk's rows on each side."""
        return self.tensor.keys.map(lambda keys: len(self.rows.a) * keys.row_nbytes)


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
    if not out:
        raise TraceError(trace.paths[0], "the trace holds no tensor rows")
    return out


def make_plan(traces: Pair[Trace], rename: dict[str, str] | None = None, align: str = "prefix",
              chunk_bytes: int = CHUNK_BYTES, keys: Pair[dict[str, RowKeys]] | None = None) -> Plan:
    """``rename`` maps names in b to names in a (``--map NAME_IN_B=NAME_IN_A``); ``align`` is
    ``prefix`` (rows by token content) or ``step`` (rows by step and order, same producer);
    ``keys``: each side's ``tensor_keys`` if already read."""
    if align not in ALIGNMENTS:
        raise ValueError(f"--align takes 'prefix' or 'step', not {align!r}")
    rename = rename or {}
    keys = keys or traces.map(tensor_keys)
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
    """Group the baseline's steps into windows of about ``chunk_bytes`` over all tensors, split each
    tensor's rows of a window further where they alone exceed it, and order the chunks by (window,
    dataflow order, row)."""
    steps = [t.keys.a.step[t.matched.rows.a] for t in tensors]
    row_bytes = [max(t.keys.a.row_nbytes, t.keys.b.row_nbytes, 1) for t in tensors]
    present = [s for s in steps if len(s)]
    if not present:
        return []
    unique = np.unique(np.concatenate(present))
    step_bytes = np.zeros(len(unique))
    for s, size in zip(steps, row_bytes):
        step_bytes += np.bincount(np.searchsorted(unique, s), minlength=len(unique)) * size
    window_of_step = (np.cumsum(step_bytes) - step_bytes) // max(chunk_bytes, 1)
    _, window_of_step = np.unique(window_of_step, return_inverse=True)  # 0, 1, 2, ... without gaps
    ordered = []
    for order, (tensor, s, size) in enumerate(zip(tensors, steps, row_bytes)):
        if not len(s):
            continue
        windows = window_of_step[np.searchsorted(unique, s)]
        per_chunk = max(1, chunk_bytes // size)
        bounds = [0]
        for start, stop in zip(*_runs(windows)):
            bounds += list(range(start + per_chunk, stop, per_chunk)) + [stop]
        a_rows, b_rows = tensor.matched.rows.a, tensor.matched.rows.b
        for start, stop in zip(bounds, bounds[1:]):
            chunk = Chunk(tensor, order, Pair(a_rows[start:stop], b_rows[start:stop]), int(windows[start]))
            ordered.append(((chunk.window, order, start), chunk))
    ordered.sort(key=lambda item: item[0])
    return [chunk for _, chunk in ordered]


def _runs(values: np.ndarray) -> tuple[list[int], list[int]]:
    """Starts and stops of the runs of equal neighbouring values."""
    cuts = (np.flatnonzero(np.diff(values)) + 1).tolist()
    return [0, *cuts], [*cuts, len(values)]
