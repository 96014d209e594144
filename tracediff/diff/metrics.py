"""Per-row comparison metrics; every function takes two [rows, ...] arrays and returns [rows].

Floats: ``max_abs``, ``mean_abs``, ``rel_l2`` (|a-b| / |a|), ``cosine`` and ``max_rel``
(max|a-b| / max|a|); for logits also ``argmax_agree``, ``topk_overlap`` (top ``TOP_K``) and ``kl``
(KL(a || b) of the softmaxes). Integers: ``equal``. The numbers come from ``kernels``.
"""

from __future__ import annotations

import numpy as np

from tracediff.diff.kernels import COLUMNS, compare_mapped_bf16, compare_rows
from tracediff.diff.pair import Pair
from tracediff.trace.dtypes import FLOAT_TAGS, decode

TOP_K = 5


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(len(x), -1))


def float_metrics(a: np.ndarray, b: np.ndarray, logits: bool = False) -> dict[str, np.ndarray]:
    """The float metrics of decoded rows (or of two uint16 arrays of bfloat16 bit patterns); with
    ``logits``, the logit metrics too."""
    if not a.dtype == b.dtype == np.uint16:
        wide = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
        a, b = a.astype(wide, copy=False), b.astype(wide, copy=False)
    a, b = _flat(a), _flat(b)
    return _named(compare_rows(a, b, logits, _top_k(a.shape[1])), logits)


def token_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Exact equality per row, for integer tensors (token ids, accept lengths)."""
    return {"equal": (_flat(a) == _flat(b)).all(axis=1).astype(np.float64)}


def metrics_for(name: str, dtypes: tuple[str, str], a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """The metrics that fit a tensor, of decoded rows: exact equality for integers, float metrics
    otherwise, logit metrics too for names ending in ``logits``."""
    if not all(d in FLOAT_TAGS for d in dtypes):
        return token_metrics(a, b)
    return float_metrics(a, b, logits=name.endswith("logits"))


def measure_rows(name: str, dtypes: tuple[str, str], raw_a: np.ndarray,
                 raw_b: np.ndarray) -> dict[str, np.ndarray]:
    """``metrics_for`` over raw stored rows; bfloat16 on both sides is decoded inside the kernel."""
    if not all(d in FLOAT_TAGS for d in dtypes):
        return token_metrics(raw_a, raw_b)
    if dtypes == ("bfloat16", "bfloat16"):
        return float_metrics(raw_a, raw_b, logits=name.endswith("logits"))
    return float_metrics(decode(raw_a, dtypes[0]), decode(raw_b, dtypes[1]), logits=name.endswith("logits"))


def measure_mapped(name: str, files: Pair[np.ndarray], at: Pair[np.ndarray],
                   width: int) -> dict[str, np.ndarray]:
    """``measure_rows`` of bfloat16 rows read in place from memory-mapped trace files."""
    logits = name.endswith("logits")
    return _named(compare_mapped_bf16(files.a, at.a, files.b, at.b, width, logits, _top_k(width)), logits)


def _top_k(width: int) -> int:
    return max(1, min(TOP_K, width))


def _named(table: np.ndarray, logits: bool) -> dict[str, np.ndarray]:
    """The kernel's [rows, 8] table as metric name -> per-row values."""
    return {column: table[:, i] for i, column in enumerate(COLUMNS[: 8 if logits else 5])}
