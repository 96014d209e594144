"""Per-row comparison metrics; every function takes two [rows, ...] arrays and returns [rows]."""

from __future__ import annotations

import numpy as np

TOP_K = 5


def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(len(x), -1).astype(np.float64)


def value_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """max_abs, mean_abs, rel_l2 (|a-b| / |a|), cosine and max_rel (max|a-b| / max|a|), per row."""
    a, b = _flat(a), _flat(b)
    diff = np.abs(a - b)
    norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    tiny = np.finfo(np.float64).tiny
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "max_abs": diff.max(axis=1, initial=0.0),
            "mean_abs": diff.mean(axis=1) if a.shape[1] else np.zeros(len(a)),
            "rel_l2": np.linalg.norm(a - b, axis=1) / np.maximum(norm_a, tiny),
            "cosine": (a * b).sum(axis=1) / np.maximum(norm_a * norm_b, tiny),
            "max_rel": diff.max(axis=1, initial=0.0) / np.maximum(np.abs(a).max(axis=1, initial=0.0), tiny),
        }


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """argmax agreement, top-k overlap (fraction) and KL(a || b) of softmax, per row."""
    a, b = _flat(a), _flat(b)
    k = min(TOP_K, a.shape[1])
    top_a = np.argpartition(-a, k - 1, axis=1)[:, :k]
    top_b = np.argpartition(-b, k - 1, axis=1)[:, :k]
    overlap = np.array([len(np.intersect1d(x, y)) / k for x, y in zip(top_a, top_b)])
    log_a = a - a.max(axis=1, keepdims=True)
    log_a -= np.log(np.exp(log_a).sum(axis=1, keepdims=True))
    log_b = b - b.max(axis=1, keepdims=True)
    log_b -= np.log(np.exp(log_b).sum(axis=1, keepdims=True))
    return {"argmax_agree": (a.argmax(axis=1) == b.argmax(axis=1)).astype(np.float64),
            "topk_overlap": overlap, "kl": (np.exp(log_a) * (log_a - log_b)).sum(axis=1)}


def token_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Exact equality per row, for integer tensors (token ids, accept lengths)."""
    return {"equal": (a.reshape(len(a), -1) == b.reshape(len(b), -1)).all(axis=1).astype(np.float64)}
