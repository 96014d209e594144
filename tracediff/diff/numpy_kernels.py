"""Plain-numpy twins of the compiled row kernels (``kernels``): the same [rows, 8] tables from the
same arguments, with no build step: small compares and the diagnoses' samples never wait for a
compiler, and a machine without one measures everything here.

Semantics follow the kernels exactly: a row with a NaN/Inf difference is all NaN, the same
infinity on both sides agrees, cosine comes from the norms (exact near 1), top-k ties go to the
earlier index, and KL is taken of float32 logits shifted by each side's maximum (float64 logits
shifted in float64 first), with 2^t held at 2^-126 below t = -126 as the kernels' exp2 does. Sums
run in float64 throughout (the kernels sum bfloat16 in float32 blocks), so the two agree to ~1e-7
relative (KL to ~1e-6).

Overflow: a row whose largest magnitude (of both sides) lies outside ``F64_RANGE`` is measured
again with both sides multiplied by one power of two that brings it into [1/2, 1): exact, and the
same for both sides, so the ratios (rel_l2, cosine, max_rel) are those of the true values, and
max_abs, mean_abs are divided back (infinite only where the true value exceeds float64). Float64
values of 1e300 then compare as equal instead of overflowing their squares to Inf.
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("max_abs", "mean_abs", "rel_l2", "cosine", "max_rel", "argmax_agree", "topk_overlap", "kl")
TINY = np.finfo(np.float64).tiny
LOG2E = np.float32(1.4426950408889634)
EXP2_FLOOR = np.float32(-126.0)  # the kernels' exp2 never goes below 2^-126
BATCH_ELEMENTS = 1 << 14  # elements per side measured at once: float64 temporaries stay in cache
SHORT_ROW = 256  # rows read in place shorter than this are gathered by one fancy index
# Rows whose largest magnitude lies in this range (or is 0) are summed as they are: squares of such
# values and their sums over any row stay normal float64 numbers. Others are scaled first.
F64_RANGE = (2.0**-400, 2.0**400)


def compare_rows(a: np.ndarray, b: np.ndarray, logits: bool, k: int) -> np.ndarray:
    """``kernels.compare_rows``: [n, 8] float64, columns as ``COLUMNS`` (the last three only when
    ``logits``), of two 2-D arrays of one dtype: uint16 (bfloat16 bit patterns) or floats."""
    return _batched(len(a), a.shape[1], lambda rows: a[rows], lambda rows: b[rows], logits, k)


def compare_mapped(file_a: np.ndarray, at_a: np.ndarray, file_b: np.ndarray, at_b: np.ndarray,
                   width: int, itemsize: int, logits: bool, k: int) -> np.ndarray:
    """``kernels.compare_mapped``: rows of ``width`` bfloat16 (``itemsize`` 2) or float32 (4) values
    at byte offsets ``at_a`` / ``at_b`` of two uint8 arrays (memory-mapped files), copied out a
    batch at a time."""
    dtype = np.dtype("<u2") if itemsize == 2 else np.dtype("<f4")
    return _batched(len(at_a), width, lambda rows: _gather(file_a, at_a[rows], width, dtype),
                    lambda rows: _gather(file_b, at_b[rows], width, dtype), logits, k)


def _gather(file: np.ndarray, at: np.ndarray, width: int, dtype: np.dtype) -> np.ndarray:
    """Rows of ``width`` values of ``dtype`` at these byte offsets (any alignment): short rows by
    one fancy index, others row by row (a copy each, 10x faster for rows of KBs)."""
    size, at = dtype.itemsize * width, np.asarray(at, dtype=np.int64)
    if width < SHORT_ROW:
        return np.asarray(file)[at[:, None] + np.arange(size)].view(dtype)
    rows = np.empty((len(at), size), np.uint8)
    for i, start in enumerate(at.tolist()):
        rows[i] = file[start : start + size]
    return rows.view(dtype)


def _batched(n: int, width: int, rows_a, rows_b, logits: bool, k: int) -> np.ndarray:
    out = np.full((n, 8), np.nan)
    step = max(1, BATCH_ELEMENTS // max(width, 1))
    with np.errstate(all="ignore"):  # NaN/Inf rows are expected; their results are left NaN
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            _measure(_values(rows_a(rows)), _values(rows_b(rows)), logits, k, out[rows])
    return out


def _values(rows: np.ndarray) -> np.ndarray:
    """Rows as float32 or float64 (as the kernels see them): bfloat16 bit patterns decoded exactly."""
    if rows.dtype == np.uint16:
        return np.left_shift(rows, 16, dtype=np.uint32).view(np.float32)
    return rows if rows.dtype == np.float64 else rows.astype(np.float32)


def _measure(a: np.ndarray, b: np.ndarray, logits: bool, k: int, out: np.ndarray) -> None:
    """A batch of row pairs into ``out`` (NaN-filled): ``kernels._row_metrics`` for many rows."""
    width = a.shape[1]
    if width == 0:  # the kernels' sums of nothing; no logit metrics
        out[:, :5] = (0.0, 0.0, 0.0, 1.0, 0.0)
        return
    x, y = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    sums = _sums(x, y)
    odd = np.flatnonzero(~np.isfinite(sums[1]))  # NaN/Inf in the row (or |x-y| overflowed): masked
    if len(odd):
        sums[:, odd] = _sums(*_masked(x[odd], y[odd]))
    scale = _scales(sums[5], sums[6])
    far = np.flatnonzero(scale != 1.0)  # too large or too small to square: measured again, scaled
    if len(far):
        sums[:, far] = _sums(*_masked(x[far] * scale[far, None], y[far] * scale[far, None]))
    max_abs, sum_abs, dd, aa, bb, peak, _ = sums
    good = np.isfinite(sum_abs)  # otherwise a NaN or Inf difference somewhere in the row
    norm_d, norm_a, norm_b = np.sqrt(dd), np.sqrt(aa), np.sqrt(bb)
    span = 2.0 * norm_a * norm_b  # 0 when a side is all zero: cosine 1 if both are, else 0
    cosine = np.where(span > 0.0, 1.0 - (dd - (norm_a - norm_b) ** 2) / np.maximum(span, TINY), dd == 0.0)
    columns = [max_abs / scale, sum_abs / width / scale, norm_d / np.maximum(norm_a, TINY), cosine,
               max_abs / np.maximum(peak, TINY)]
    if logits:
        top_a, top_b = _top(a, k), _top(b, k)
        columns += [(np.argmax(a, axis=1) == np.argmax(b, axis=1)).astype(np.float64),
                    (top_a[:, :, None] == top_b[:, None, :]).sum(axis=(1, 2)) / k, _kl(a, b)]
    out[good, : len(columns)] = np.stack(columns, axis=1)[good]


def _masked(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same infinity on both sides (a masked logit) as 0 on both."""
    same_infinity = (x == y) & np.isinf(x)
    return np.where(same_infinity, 0.0, x), np.where(same_infinity, 0.0, y)


def _scales(peak_a: np.ndarray, peak_b: np.ndarray) -> np.ndarray:
    """Per row, 1, or the power of two that brings the larger finite peak outside ``F64_RANGE``
    into [1/2, 1) (``kernels._scale``)."""
    peak = np.maximum(peak_a, peak_b)
    low, high = F64_RANGE
    far = np.isfinite(peak) & ((peak > high) | ((peak < low) & (peak > 0.0)))
    _, exponent = np.frexp(np.where(far, peak, 1.0))
    return np.where(far, np.ldexp(1.0, -exponent), 1.0)


def _sums(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[7, rows]: max|x-y|, sum|x-y|, |x-y|^2, |x|^2, |y|^2, max|x|, max|y| (float64 rows)."""
    d = np.subtract(x, y)
    np.abs(d, out=d)
    return np.stack([d.max(axis=1), d.sum(axis=1), np.einsum("ij,ij->i", d, d), np.einsum("ij,ij->i", x, x),
                     np.einsum("ij,ij->i", y, y), np.maximum(x.max(axis=1), -x.min(axis=1)),
                     np.maximum(y.max(axis=1), -y.min(axis=1))])


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """[rows, k] indices of each row's k largest values, in any order; ties across the k-th place
    go to the earlier indices, as in a stable descending sort. Rows with such a tie (common only in
    bfloat16) are redone one by one."""
    cut = x.shape[1] - k
    where = np.argpartition(x, cut, axis=1)[:, cut:]
    kth = np.take_along_axis(x, where[:, :1], axis=1)
    for i in np.flatnonzero(np.count_nonzero(x >= kth, axis=1) > k):
        above = np.flatnonzero(x[i] > kth[i])
        where[i] = np.concatenate([above, np.flatnonzero(x[i] == kth[i])[: k - len(above)]])
    return where


def _kl(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``kernels._kl``: sum p_a (u - v) - log sum e^u + log sum e^v, clamped at 0, with u, v the
    float32 logits less each row's maximum (float64 logits shifted before they are narrowed: they
    may lie beyond float32's range); a NaN term (the same -inf both sides) counts as 0."""
    u, v = _shifted(x), _shifted(y)
    ea = np.exp2(np.maximum(u * LOG2E, EXP2_FLOOR))
    eb = np.exp2(np.maximum(v * LOG2E, EXP2_FLOOR))
    gap = u - v
    gap[np.isnan(gap)] = 0.0
    gap *= ea
    sum_a, sum_b = ea.sum(axis=1, dtype=np.float64), eb.sum(axis=1, dtype=np.float64)
    return np.maximum(gap.sum(axis=1, dtype=np.float64) / sum_a - np.log(sum_a) + np.log(sum_b), 0.0)


def _shifted(x: np.ndarray) -> np.ndarray:
    """Each row less its maximum, as float32 (``kernels.shifted``); a copy."""
    if x.dtype == np.float64:
        return (x - x.max(axis=1, keepdims=True)).astype(np.float32)
    u = x.astype(np.float32)
    u -= u.max(axis=1, keepdims=True)
    return u
