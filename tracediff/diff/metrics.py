"""Per-row comparison metrics; every function takes two [rows, ...] arrays and returns [rows].

Floats: ``max_abs``, ``mean_abs``, ``rel_l2`` (|a-b| / |a|), ``cosine`` and ``max_rel``
(max|a-b| / max|a|); for logits also ``argmax_agree``, ``topk_overlap`` (top ``TOP_K``) and ``kl``
(KL(a || b) of the softmaxes). Integers: ``equal``. The numbers come from ``kernels``.
"""

from __future__ import annotations

import numpy as np

from tracediff.diff.kernels import COLUMNS, bf16_to_f32, compare_rows
from tracediff.trace.dtypes import FLOAT_TAGS, decode

TOP_K = 5


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(len(x), -1))


class Scratch:
    """Reused float32 buffers for decoded bfloat16 chunks: a fresh array per chunk would spend
    as long in page faults as in decoding."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def decoded(self, raw: np.ndarray, side: str) -> np.ndarray:
        raw = _flat(raw)
        buffer = self._buffers.get(side)
        if buffer is None or buffer.size < raw.size:
            buffer = self._buffers[side] = np.empty(raw.size, dtype=np.float32)
        out = buffer[: raw.size].reshape(raw.shape)
        bf16_to_f32(raw, out)
        return out


SCRATCH = Scratch()  # compare measures chunks one at a time, on one thread


def float_metrics(a: np.ndarray, b: np.ndarray, logits: bool = False) -> dict[str, np.ndarray]:
    """The float metrics of decoded rows; with ``logits``, the logit metrics too."""
    wide = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
    a, b = _flat(a).astype(wide, copy=False), _flat(b).astype(wide, copy=False)
    k = min(TOP_K, a.shape[1]) if a.shape[1] else 1
    table = compare_rows(a, b, logits, k)
    return {name: table[:, i] for i, name in enumerate(COLUMNS[: 8 if logits else 5])}


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
    """``metrics_for`` over raw stored rows (bfloat16 decoded into reused buffers)."""
    if not all(d in FLOAT_TAGS for d in dtypes):
        return token_metrics(raw_a, raw_b)
    a, b = (SCRATCH.decoded(raw, side) if dtype == "bfloat16" and raw.size else decode(raw, dtype)
            for raw, dtype, side in ((raw_a, dtypes[0], "a"), (raw_b, dtypes[1], "b")))
    return float_metrics(a, b, logits=name.endswith("logits"))
