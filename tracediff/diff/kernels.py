"""Compiled row kernels (numba): every per-row metric in one or two passes over each row, rows in
parallel. numpy needs a dozen full passes (and as many temporaries) for the same numbers, which
made compare compute-bound at a fraction of the disk's speed.

Compiled on first use and cached next to this file (``cache=True``). Fast-math is limited to
reassociation, contraction and approximate functions: NaN and Inf keep their IEEE meaning, so a
row holding one is always seen.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

FAST = {"reassoc", "contract", "afn"}
# exp(x) for x <= 0 in float32 as 2^n * e^r, r = x - n ln2 split in two (Cody-Waite), e^r by a
# degree-6 polynomial: within 2.5e-7 relative, and it vectorizes where np.exp is a scalar call.
LOG2E = np.float32(1.4426950408889634)
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_TERMS = tuple(np.float32(1 / math.factorial(i)) for i in range(7))
COLUMNS = ("max_abs", "mean_abs", "rel_l2", "cosine", "max_rel", "argmax_agree", "topk_overlap", "kl")
TINY = np.finfo(np.float64).tiny


@njit(parallel=True, cache=True, nogil=True, fastmath=FAST)
def compare_rows(a: np.ndarray, b: np.ndarray, bf16: bool, logits: bool, k: int) -> np.ndarray:
    """[n, 8] float64, columns as ``COLUMNS`` (the last three only when ``logits``), of two 2-D
    arrays of one dtype: floats, or with ``bf16`` bfloat16 bit patterns decoded in registers."""
    out = np.full((a.shape[0], 8), np.nan)
    for i in prange(a.shape[0]):
        _row_metrics(a[i], b[i], bf16, logits, k, out[i])
    return out


@njit(parallel=True, cache=True, nogil=True, fastmath=FAST)
def compare_mapped_bf16(file_a: np.ndarray, at_a: np.ndarray, file_b: np.ndarray, at_b: np.ndarray,
                        width: int, logits: bool, k: int) -> np.ndarray:
    """``compare_rows`` of bfloat16 rows read in place from two memory-mapped files (uint8), row i
    starting at byte at_a[i] / at_b[i]: no copy of the data out of the page cache."""
    out = np.full((len(at_a), 8), np.nan)
    for i in prange(len(at_a)):
        a = file_a[at_a[i] : at_a[i] + 2 * width].view(np.uint16)
        b = file_b[at_b[i] : at_b[i] + 2 * width].view(np.uint16)
        _row_metrics(a, b, True, logits, k, out[i])
    return out


@njit(cache=True, nogil=True, fastmath=FAST)
def _row_metrics(a: np.ndarray, b: np.ndarray, bf16: bool, logits: bool, k: int, out: np.ndarray) -> None:
    """One row pair into ``out`` (8 values, NaN-filled). A NaN/Inf difference leaves all NaN; the
    same infinity on both sides (a masked logit) agrees. Cosine comes from the norms as
    1 - (|a-b|^2 - (|a|-|b|)^2) / (2|a||b|), exact near 1."""
    width = len(a)
    clean = _finite(a, b, bf16)  # most rows: then the main loop needs no infinity handling
    max_abs, sum_abs, dd, aa, bb, peak = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for j in range(width):  # branch-free but for the loop-invariant ``clean``, so it vectorizes
        x, y = _value(a[j], bf16), _value(b[j], bf16)
        if not clean:
            same_infinity = (x == y) & (x - x != 0.0)
            x = 0.0 if same_infinity else x
            y = 0.0 if same_infinity else y
        d = x - y
        ad = abs(d)
        max_abs = max(max_abs, ad)
        peak = max(peak, abs(x))
        sum_abs += ad
        dd += d * d
        aa += x * x
        bb += y * y
    if not sum_abs <= 1.7976931348623157e308:  # a NaN or Inf difference somewhere in the row
        return
    norm_d, norm_a, norm_b = math.sqrt(dd), math.sqrt(aa), math.sqrt(bb)
    out[0] = max_abs
    out[1] = sum_abs / width if width else 0.0
    out[2] = norm_d / max(norm_a, TINY)
    out[3] = 1.0 - (dd - (norm_a - norm_b) ** 2) / max(2.0 * norm_a * norm_b, TINY)
    out[4] = max_abs / max(peak, TINY)
    if logits and width:
        top_a, where_a = _top(a, bf16, k)
        top_b, where_b = _top(b, bf16, k)
        out[5] = 1.0 if where_a[0] == where_b[0] else 0.0
        shared = 0
        for p in range(k):
            for q in range(k):
                shared += where_a[p] == where_b[q]
        out[6] = shared / k
        out[7] = _kl(a, b, bf16, top_a[0], top_b[0])


@njit(cache=True, fastmath=FAST)
def _finite(a: np.ndarray, b: np.ndarray, bf16: bool) -> bool:
    """No NaN or Inf in either row (x - x is 0 exactly for finite x)."""
    bad = False
    for j in range(len(a)):
        x, y = _value(a[j], bf16), _value(b[j], bf16)
        bad |= (x - x != 0.0) | (y - y != 0.0)
    return not bad


@njit(inline="always")
def _value(x: np.number, bf16: bool) -> np.float64:
    """One element as float64; with ``bf16``, x is a bfloat16 bit pattern."""
    if bf16:
        return np.float64(np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32))
    return np.float64(x)


@njit(cache=True)
def _top(row: np.ndarray, bf16: bool, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values of a row, descending, and their indices (ties: the earlier index)."""
    values, where = np.full(k, -np.inf), np.full(k, -1)
    kth = -np.inf  # the k-th largest so far: most values fail this one test
    for j in range(len(row)):
        x = _value(row[j], bf16)
        if x > kth:
            kth = _insert(values, where, x, j)
    return values, where


@njit(cache=True)
def _insert(values: np.ndarray, where: np.ndarray, x: float, j: int) -> float:
    """Insert x (larger than the k-th) into the k largest, kept descending with their indices
    (ties keep the earlier index); the new k-th largest."""
    k = len(values)
    p = k - 1
    while p > 0 and x > values[p - 1]:
        values[p] = values[p - 1]
        where[p] = where[p - 1]
        p -= 1
    values[p] = x
    where[p] = j
    return values[k - 1]


@njit(cache=True, fastmath=FAST)
def _kl(a: np.ndarray, b: np.ndarray, bf16: bool, max_a: float, max_b: float) -> float:
    """KL(softmax(a) || softmax(b)) = sum p_a (a - b) - lse(a) + lse(b), clamped at 0."""
    sum_a, sum_b, weighted = np.float32(0), np.float32(0), np.float32(0)
    shift_a, shift_b = np.float32(max_a), np.float32(max_b)
    for j in range(len(a)):  # float32 throughout, so the loop vectorizes
        x, y = np.float32(_value(a[j], bf16)), np.float32(_value(b[j], bf16))
        ea = _exp_nonpositive(x - shift_a)
        sum_a += ea
        sum_b += _exp_nonpositive(y - shift_b)
        weighted += ea * (np.float32(0) if x == y else x - y)
    kl = (np.float64(weighted) / sum_a - (max_a + math.log(sum_a)) + (max_b + math.log(sum_b)))
    return max(kl, 0.0)


@njit(inline="always", fastmath=FAST)
def _exp_nonpositive(x: np.float32) -> np.float32:
    """exp(x) for x <= 0 (below -87 it returns exp(-87), 1.6e-38)."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * LOG2E + np.float32(0.5))
    r = (x - n * LN2_HI) - n * LN2_LO
    c0, c1, c2, c3, c4, c5, c6 = EXP_TERMS
    poly = c0 + r * (c1 + r * (c2 + r * (c3 + r * (c4 + r * (c5 + r * c6)))))
    return poly * np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
