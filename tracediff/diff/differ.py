"""Compare two traces tensor by tensor in the baseline's dataflow order; the first tensor whose
aligned rows break tolerance is the first divergence, later failing tensors are downstream of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracediff.diff.align import Prefixes, fed_tokens, first_token_difference, match, match_by_step
from tracediff.diff.metrics import logit_metrics, token_metrics, value_metrics
from tracediff.diff.pair import Pair
from tracediff.diff.tolerance import Tolerances, failing_rows
from tracediff.trace.dtypes import FLOAT_TAGS
from tracediff.trace.reader import Rows, Trace


@dataclass
class TensorResult:
    name: str
    status: str  # match | diverged | downstream | not_comparable | missing_in_a | missing_in_b
    dtypes: tuple[str, str] | None = None
    rows: int = 0
    failed: int = 0
    not_comparable: int = 0
    worst: dict[str, float] = field(default_factory=dict)
    first_bad: dict | None = None  # row keys on both sides and the metrics of that row


@dataclass
class Comparison:
    """Everything compare found, as plain data for the diagnoses and the reports."""

    paths: Pair[list[str]]
    tensors: list[TensorResult]
    contract: list[dict]
    token_mismatch: dict | None
    rows: dict[str, Pair[Rows]] = field(default_factory=dict, repr=False)
    matched: dict[str, Pair[np.ndarray]] = field(default_factory=dict, repr=False)
    prefixes: Pair[Prefixes] | None = field(default=None, repr=False)

    @property
    def first_divergence(self) -> TensorResult | None:
        return next((t for t in self.tensors if t.status == "diverged"), None)

    @property
    def verdict(self) -> str:
        if self.first_divergence is not None:
            return "diverged"
        return "match" if any(t.status == "match" for t in self.tensors) else "incomparable"


def contract_diff(traces: Pair[Trace]) -> list[dict]:
    """Keys of the run contract whose values differ (final contract updates included)."""
    def merged(trace: Trace) -> dict:
        contract = dict(trace.meta.get("contract") or {})
        for final in trace.finals:
            contract.update((final or {}).get("contract") or {})
        return contract

    a, b = merged(traces.a), merged(traces.b)
    keys = sorted(a.keys() | b.keys())
    return [{"key": k, "a": a.get(k), "b": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def metrics_for(name: str, dtypes: tuple[str, str], a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    if not all(d in FLOAT_TAGS for d in dtypes):
        return token_metrics(a, b)
    metrics = value_metrics(a, b)
    if name.endswith("logits"):
        metrics.update(logit_metrics(a, b))
    return metrics


def compare_traces(traces: Pair[Trace], tolerances: Tolerances | None = None,
                   rename: dict[str, str] | None = None, align: str = "prefix") -> Comparison:
    """``rename`` maps names in b to names in a (``--map NAME_IN_B=NAME_IN_A``); ``align`` is
    ``prefix`` (rows by token content) or ``step`` (rows by step and order, same producer)."""
    if align not in ("prefix", "step"):
        raise ValueError(f"--align takes 'prefix' or 'step', not {align!r}")
    tolerances = tolerances or Tolerances()
    rename = rename or {}
    prefixes = traces.map(Prefixes.of)
    fed = Pair(fed_tokens(traces.a, prefixes.a), fed_tokens(traces.b, prefixes.b))
    b_names = {rename.get(n, n): n for n in traces.b.names()}
    result = Comparison(paths=traces.map(lambda t: [str(p) for p in t.paths]), tensors=[],
                        contract=contract_diff(traces), token_mismatch=None, prefixes=prefixes)
    diverged = False
    for name in traces.a.names():
        if name not in b_names:
            result.tensors.append(TensorResult(name, "missing_in_b"))
            continue
        if traces.a.index.static[traces.a.select(name=name)[0]]:
            continue  # static tensors (weights, d2t) are for the diagnoses, not row comparison
        rows = Pair(traces.a.rows(name), traces.b.rows(b_names[name]))
        matched = match(rows, prefixes, fed) if align == "prefix" else match_by_step(rows)
        tensor = _compare_rows(name, rows, matched.rows, tolerances)
        tensor.not_comparable = matched.not_comparable
        if tensor.status == "diverged":
            tensor.status = "downstream" if diverged else "diverged"
            diverged = True
        result.tensors.append(tensor)
        result.rows[name], result.matched[name] = rows, matched.rows
    a_names = set(traces.a.names())
    result.tensors += [TensorResult(name, "missing_in_a") for name in b_names if name not in a_names]
    result.token_mismatch = first_token_difference(prefixes)
    return result


def _compare_rows(name: str, rows: Pair[Rows], idx: Pair[np.ndarray], tolerances: Tolerances) -> TensorResult:
    dtypes = (rows.a.dtype, rows.b.dtype)
    if len(idx.a) == 0:
        return TensorResult(name, "not_comparable", dtypes)
    a, b = rows.a.numpy()[idx.a], rows.b.numpy()[idx.b]
    if a.shape[1:] != b.shape[1:]:
        return TensorResult(name, "diverged", dtypes, rows=len(a), failed=len(a),
                            worst={"shape_a": list(a.shape[1:]), "shape_b": list(b.shape[1:])})
    metrics = metrics_for(name, dtypes, a, b)
    bad = failing_rows(metrics, tolerances.bounds(name, dtypes))
    larger_is_worse = ("max_abs", "mean_abs", "rel_l2", "max_rel", "kl")
    worst = {k: float(np.nanmax(v) if k in larger_is_worse else np.nanmin(v)) for k, v in metrics.items()}
    tensor = TensorResult(name, "diverged" if bad.any() else "match", dtypes, rows=len(a),
                          failed=int(bad.sum()), worst=worst)
    if bad.any():
        i = int(np.argmax(bad))
        tensor.first_bad = {
            "request": {"a": str(rows.a.request[idx.a[i]]), "b": str(rows.b.request[idx.b[i]])},
            "position": int(rows.a.position[idx.a[i]]), "depth": int(rows.a.depth[idx.a[i]]),
            "step": {"a": int(rows.a.step[idx.a[i]]), "b": int(rows.b.step[idx.b[i]])},
            "metrics": {k: float(v[i]) for k, v in metrics.items()},
        }
    return tensor
