"""Per-row comparison metrics; every function takes two [rows, ...] arrays and returns [rows]."""

from __future__ import annotations

import numpy as np

TOP_K = 5


def _flat(x: np.ndarray) -> np.ndarray:
    """Rows as 2-D float arrays: float32 for 32-bit and narrower data, float64 stays float64."""
    x = x.reshape(len(x), -1)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


def _row_norm(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.einsum("ij,ij->i", x, x).astype(np.float64))


def value_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """max_abs, mean_abs, rel_l2 (|a-b| / |a|), cosine and max_rel (max|a-b| / max|a|), per row.

    Works in the data's own precision (few passes, no float64 copies); cosine comes from the
    norms as 1 - (|a-b|^2 - (|a|-|b|)^2) / (2|a||b|), which stays exact near 1, unlike a.b/|a||b|."""
    a, b = _flat(a), _flat(b)
    diff = a - b
    norm_d, norm_a, norm_b = _row_norm(diff), _row_norm(a), _row_norm(b)
    np.abs(diff, out=diff)
    peak_a = np.maximum(a.max(axis=1, initial=-np.inf), -a.min(axis=1, initial=np.inf)) if a.shape[1] \
        else np.zeros(len(a))
    tiny = np.finfo(np.float64).tiny
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        max_abs = diff.max(axis=1, initial=0.0).astype(np.float64)
        metrics = {
            "max_abs": max_abs,
            "mean_abs": diff.mean(axis=1, dtype=np.float64) if a.shape[1] else np.zeros(len(a)),
            "rel_l2": norm_d / np.maximum(norm_a, tiny),
            "cosine": 1 - (norm_d**2 - (norm_a - norm_b) ** 2) / np.maximum(2 * norm_a * norm_b, tiny),
            "max_rel": max_abs / np.maximum(peak_a.astype(np.float64), tiny),
        }
        overflowed = ~np.isfinite(norm_a * norm_b * norm_d) & np.isfinite(max_abs)
    if overflowed.any() and a.dtype == np.float32:  # squares past float32's range: redo those rows wide
        wide = value_metrics(a[overflowed].astype(np.float64), b[overflowed].astype(np.float64))
        for k, v in wide.items():
            metrics[k][overflowed] = v
    return metrics


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """argmax agreement, top-k overlap (fraction) and KL(a || b) of softmax, per row."""
    a, b = _flat(a).astype(np.float64), _flat(b).astype(np.float64)
    k = min(TOP_K, a.shape[1])
    top_a = np.argpartition(-a, k - 1, axis=1)[:, :k]
    top_b = np.argpartition(-b, k - 1, axis=1)[:, :k]
    overlap = (top_a[:, :, None] == top_b[:, None, :]).any(axis=2).sum(axis=1) / k
    log_a = a - a.max(axis=1, keepdims=True)
    log_a -= np.log(np.exp(log_a).sum(axis=1, keepdims=True))
    log_b = b - b.max(axis=1, keepdims=True)
    log_b -= np.log(np.exp(log_b).sum(axis=1, keepdims=True))
    return {"argmax_agree": (a.argmax(axis=1) == b.argmax(axis=1)).astype(np.float64),
            "topk_overlap": overlap, "kl": (np.exp(log_a) * (log_a - log_b)).sum(axis=1)}


def token_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Exact equality per row, for integer tensors (token ids, accept lengths)."""
    return {"equal": (a.reshape(len(a), -1) == b.reshape(len(b), -1)).all(axis=1).astype(np.float64)}
