"""Compiled row kernels (numba): every per-row metric in a few vectorized passes over each row,
rows in parallel. numpy needs a dozen full passes (and as many temporaries) for the same numbers.

Rows arrive as uint16 (bfloat16 bit patterns, decoded in registers), float32 or float64. For
bfloat16 the sums run in float32 lanes inside blocks of ``BLOCK`` elements and in float64 across
blocks: twice the SIMD width of float64, at a relative error near 1e-7, four orders below
bfloat16's own rounding (wider inputs sum in float64 throughout). A row whose first sums could be
off (NaN/Inf anywhere, values too large or too small to square in float32) is measured again in
float64 with infinities handled.

Overflow-safe: a row whose largest finite magnitude (of both sides) lies outside ``F64_RANGE``,
where squares or their sums leave float64's normal range (only float64 inputs get there: bfloat16
and float32 values square within it), is measured a third time with both sides multiplied by one
power of two that brings that magnitude into [1/2, 1). Multiplying by a power of two only moves
the exponent: exact for every value that stays normal (scaled down, values more than 2^-1021 below
the peak turn subnormal and lose bits, far below anything a float64 sum dominated by the peak can
hold), and the same on both sides, so rel_l2, cosine and max_rel, ratios of sums, are those of the
true values; max_abs and mean_abs are divided back by the scale (Inf only where the true value
exceeds float64). The scaling sits in the masked pass only, so the common row pays nothing for it
(measured: the same throughput before and after, within noise). KL shifts float64 logits in
float64 before narrowing them to float32 (beyond float32's range they would become Inf - Inf).

Compiled on first use and cached next to this file (``cache=True``); ``numpy_kernels`` computes the
same tables without compiling, for inputs too small to repay it. Fast-math is limited to
reassociation, contraction and approximate functions: NaN and Inf keep their IEEE meaning, so a
row holding one is always seen.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from tracediff.diff.numpy_kernels import COLUMNS as COLUMNS  # the table's columns, for callers
from tracediff.diff.numpy_kernels import F64_RANGE

FAST = {"reassoc", "contract", "afn"}
BLOCK = 256  # elements summed in float32 before the partial sums move to float64
TOP_BLOCK = 64  # elements per block maximum in the top-k search
# float32 sums are trusted for rows whose largest magnitude lies in this range (or is 0): squares
# and squared differences of such values stay normal floats, far from overflow.
F32_RANGE = (1e-6, 1e15)
LOG2E = 1.4426950408889634
TINY = np.finfo(np.float64).tiny


def _exp2_polynomial(degree: int = 5) -> tuple[np.float32, ...]:
    """Coefficients (lowest first) of a polynomial near 2**f on [-1/2, 1/2] in relative error: a
    weighted least-squares fit on Chebyshev nodes, within 2.2e-7 evaluated in float32."""
    nodes = 0.5 * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    coefficients = np.polynomial.polynomial.polyfit(nodes, 2.0**nodes, degree, w=2.0**-nodes)
    return tuple(np.float32(c) for c in coefficients)


EXP2_TERMS = _exp2_polynomial()


def element(x):
    """One stored element as a float: bfloat16 bits (uint16) decoded, floats as they are. Only
    callable from compiled code, typed by ``_element_for``."""
    raise NotImplementedError("compiled code only")


@overload(element, inline="always")
def _element_for(x):
    if isinstance(x, types.Integer):
        return lambda x: np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    return lambda x: x


def accumulator(row):
    """0 in the type block sums of ``row`` run in: float32 for bfloat16 rows (products of two
    bfloat16 values are exact in float32), float64 otherwise."""
    raise NotImplementedError("compiled code only")


@overload(accumulator, inline="always")
def _accumulator_for(row):
    if isinstance(row.dtype, types.Integer):
        return lambda row: np.float32(0)
    return lambda row: np.float64(0)


def shift_for(row, maximum):
    """A row's maximum in the type its shift is taken in: float64 for float64 rows, else float32."""
    raise NotImplementedError("compiled code only")


@overload(shift_for, inline="always")
def _shift_for_for(row, maximum):
    if row.dtype == types.float64:
        return lambda row, maximum: np.float64(maximum)
    return lambda row, maximum: np.float32(maximum)


def shifted(value, shift):
    """A stored element less ``shift`` (from ``shift_for``), as float32. float64 values are shifted
    before they are narrowed: beyond float32's range they would become Inf, and Inf - Inf NaN."""
    raise NotImplementedError("compiled code only")


@overload(shifted, inline="always")
def _shifted_for(value, shift):
    if value == types.float64:
        return lambda value, shift: np.float32(value - shift)
    return lambda value, shift: np.float32(element(value)) - shift


def order_key(value):
    """A float's bits (or a stored bfloat16's) as a signed integer that orders like the float (NaN
    above +Inf), undone by ``from_order_key``. LLVM vectorizes integer maxima, not float ones."""
    raise NotImplementedError("compiled code only")


def from_order_key(key):
    """The float whose ``order_key`` is ``key``: int16 -> bfloat16 as float32, int32 -> float32,
    int64 -> float64."""
    raise NotImplementedError("compiled code only")


# Negative floats get their magnitude bits inverted, so that a larger integer is a larger float.
SIGN_16, MAGNITUDE_16 = np.int16(15), np.int16(0x7FFF)
SIGN_32, MAGNITUDE_32 = np.int32(31), np.int32(0x7FFFFFFF)
SIGN_64, MAGNITUDE_64 = np.int64(63), np.int64(0x7FFFFFFFFFFFFFFF)


@overload(order_key, inline="always")
def _order_key_for(value):
    if isinstance(value, types.Integer):  # bfloat16 bits
        return lambda value: _flip_16(np.uint16(value).view(np.int16))
    if value == types.float64:
        return lambda value: _flip_64(np.float64(value).view(np.int64))
    return lambda value: _flip_32(np.float32(value).view(np.int32))


@overload(from_order_key, inline="always")
def _from_order_key_for(key):
    if key == types.int16:
        return lambda key: element(np.int16(_flip_16(key)).view(np.uint16))
    if key == types.int64:
        return lambda key: np.int64(_flip_64(key)).view(np.float64)
    return lambda key: np.int32(_flip_32(key)).view(np.float32)


# numba widens small-integer arithmetic to int64: the casts keep the lanes narrow.
@njit(inline="always")
def _flip_16(bits: np.int16) -> np.int16:
    return np.int16(bits ^ ((bits >> SIGN_16) & MAGNITUDE_16))


@njit(inline="always")
def _flip_32(bits: np.int32) -> np.int32:
    return np.int32(bits ^ ((bits >> SIGN_32) & MAGNITUDE_32))


@njit(inline="always")
def _flip_64(bits: np.int64) -> np.int64:
    return bits ^ ((bits >> SIGN_64) & MAGNITUDE_64)


@njit(parallel=True, cache=True, nogil=True, fastmath=FAST)
def compare_rows(a: np.ndarray, b: np.ndarray, logits: bool, k: int) -> np.ndarray:
    """[n, 8] float64, columns as ``COLUMNS`` (the last three only when ``logits``), of two 2-D
    arrays of one dtype: uint16 (bfloat16 bit patterns), float32 or float64."""
    out = np.full((a.shape[0], 8), np.nan)
    for i in prange(a.shape[0]):
        _row_metrics(a[i], b[i], logits, k, out[i])
    return out


@njit(parallel=True, cache=True, nogil=True, fastmath=FAST)
def compare_mapped(file_a: np.ndarray, at_a: np.ndarray, file_b: np.ndarray, at_b: np.ndarray,
                   width: int, itemsize: int, logits: bool, k: int) -> np.ndarray:
    """``compare_rows`` of rows read in place from two memory-mapped files (uint8), row i starting
    at byte at_a[i] / at_b[i]: bfloat16 (``itemsize`` 2) or float32 (4) elements, no copy of the
    data out of the page cache."""
    out = np.full((len(at_a), 8), np.nan)
    size = itemsize * width
    for i in prange(len(at_a)):
        if itemsize == 2:
            _row_metrics(file_a[at_a[i] : at_a[i] + size].view(np.uint16),
                         file_b[at_b[i] : at_b[i] + size].view(np.uint16), logits, k, out[i])
        else:
            _row_metrics(file_a[at_a[i] : at_a[i] + size].view(np.float32),
                         file_b[at_b[i] : at_b[i] + size].view(np.float32), logits, k, out[i])
    return out


@njit(cache=True, nogil=True, fastmath=FAST)
def _row_metrics(a: np.ndarray, b: np.ndarray, logits: bool, k: int, out: np.ndarray) -> None:
    """One row pair into ``out`` (8 values, NaN-filled). A NaN/Inf difference leaves all NaN; the
    same infinity on both sides (a masked logit) agrees. Cosine comes from the norms as
    1 - (|a-b|^2 - (|a|-|b|)^2) / (2|a||b|), exact near 1; with a side all zero it is 1 if both
    are, 0 otherwise."""
    width = len(a)
    zero = accumulator(a)
    sums = _sums(a, b, False, zero, zero + np.float32(1))
    scale = 1.0
    if not _sums_hold(sums):
        sums = _sums(a, b, True, np.float64(0), 1.0)
        scale = _scale(sums[5], sums[6])
        if scale != 1.0:
            sums = _sums(a, b, True, np.float64(0), scale)
    max_abs, sum_abs, dd, aa, bb, peak, _ = sums
    if not sum_abs <= 1.7976931348623157e308:  # a NaN or Inf difference somewhere in the row
        return
    norm_d, norm_a, norm_b = math.sqrt(dd), math.sqrt(aa), math.sqrt(bb)
    out[0] = max_abs / scale
    out[1] = sum_abs / width / scale if width else 0.0
    out[2] = norm_d / max(norm_a, TINY)
    span = 2.0 * norm_a * norm_b  # 0 when a side is all zero: the formula would divide noise by 0
    out[3] = 1.0 - (dd - (norm_a - norm_b) ** 2) / span if span > 0.0 else (1.0 if dd == 0.0 else 0.0)
    out[4] = max_abs / max(peak, TINY)
    if logits and width:
        maxima_a, maxima_b = _block_maxima(a, b)
        top_a, where_a = _top(a, maxima_a, k)
        top_b, where_b = _top(b, maxima_b, k)
        out[5] = 1.0 if where_a[0] == where_b[0] else 0.0
        shared = 0
        for p in range(k):
            for q in range(k):
                shared += where_a[p] == where_b[q]
        out[6] = shared / k
        out[7] = _kl(a, b, top_a[0], top_b[0])


@njit(inline="always", fastmath=FAST)
def _sums_hold(sums: tuple) -> bool:
    """Unmasked block sums hold: everything finite and both rows' peaks in ``F32_RANGE`` (or 0)."""
    max_abs, sum_abs, dd, aa, bb, peak_a, peak_b = sums
    low, high = F32_RANGE
    finite = (max_abs + sum_abs + dd + aa + bb) <= 1.7976931348623157e308
    in_range = ((peak_a == 0.0) | ((peak_a >= low) & (peak_a <= high))) & (
        (peak_b == 0.0) | ((peak_b >= low) & (peak_b <= high)))
    return finite and in_range


@njit(inline="always")
def _scale(peak_a: float, peak_b: float) -> float:
    """1, or the power of two that brings the larger peak into [1/2, 1) when it is finite and
    outside ``F64_RANGE`` (the sums of its squares would overflow or lose their precision)."""
    peak = max(peak_a, peak_b)
    low, high = F64_RANGE
    if not (peak <= 1.7976931348623157e308 and (peak > high or (0.0 < peak < low))):
        return 1.0
    return math.ldexp(1.0, -math.frexp(peak)[1])


@njit(cache=True, nogil=True, fastmath=FAST)
def _sums(a: np.ndarray, b: np.ndarray, masked: bool, zero, scale) -> tuple:
    """(max|a-b|, sum|a-b|, |a-b|^2, |a|^2, |b|^2, max|a|, max|b|) as float64, summed in the type
    of ``zero`` within each block. ``masked``: the same infinity on both sides counts as 0, and
    both sides are multiplied by ``scale`` (of ``zero``'s type: the fast pass stays in float32)."""
    width = len(a)
    sum_abs, dd, aa, bb = 0.0, 0.0, 0.0, 0.0
    m = pa = pb = order_key(zero)  # maxima of |a-b|, |a|, |b| as order keys
    for start in range(0, width, BLOCK):
        s, d2, a2, b2 = zero, zero, zero, zero
        for j in range(start, min(start + BLOCK, width)):  # branch-free but for ``masked``: vectorizes
            x, y = zero + element(a[j]), zero + element(b[j])
            if masked:
                x, y = x * scale, y * scale
                same_infinity = (x == y) & (x - x != 0.0)
                x = zero if same_infinity else x
                y = zero if same_infinity else y
            d = x - y
            ad = abs(d)
            m = max(m, order_key(ad))
            pa = max(pa, order_key(abs(x)))
            pb = max(pb, order_key(abs(y)))
            s += ad
            d2 += d * d
            a2 += x * x
            b2 += y * y
        sum_abs, dd, aa, bb = sum_abs + s, dd + d2, aa + a2, bb + b2
    return (np.float64(from_order_key(m)), sum_abs, dd, aa, bb, np.float64(from_order_key(pa)),
            np.float64(from_order_key(pb)))


@njit(cache=True, nogil=True, fastmath=FAST)
def _block_maxima(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The maximum of each ``TOP_BLOCK`` elements of both rows, compared as stored (order keys)."""
    n = (len(a) + TOP_BLOCK - 1) // TOP_BLOCK
    maxima_a, maxima_b = np.empty(n), np.empty(n)
    for block in range(n):
        start = block * TOP_BLOCK
        ma, mb = order_key(a[start]), order_key(b[start])
        for j in range(start, min(start + TOP_BLOCK, len(a))):
            ma = max(ma, order_key(a[j]))
            mb = max(mb, order_key(b[j]))
        maxima_a[block], maxima_b[block] = from_order_key(ma), from_order_key(mb)
    return maxima_a, maxima_b


@njit(cache=True, nogil=True)
def _top(row: np.ndarray, maxima: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values of a row, descending, and their indices (ties: the earlier index; -inf
    is a value like any other). Only blocks whose maximum reaches the k-th largest block maximum t
    are scanned: every block holding one of the k largest values has its maximum >= the k-th
    largest value >= t, and every other block holds values below t only."""
    values, where = np.full(k, -np.inf), np.full(k, -1)
    filled = 0
    for block in range(len(maxima)):
        if filled < k or maxima[block] > values[k - 1]:
            filled = _insert(values, where, filled, maxima[block], block)
    threshold = values[k - 1] if filled == k else -np.inf
    values[:], where[:], filled, kth = -np.inf, -1, 0, -np.inf
    for block in range(len(maxima)):
        if maxima[block] < threshold:
            continue
        for j in range(block * TOP_BLOCK, min((block + 1) * TOP_BLOCK, len(row))):
            x = np.float64(element(row[j]))
            if x > kth or filled < k:
                filled = _insert(values, where, filled, x, j)
                kth = values[k - 1]
    return values, where


@njit(cache=True, nogil=True)
def _insert(values: np.ndarray, where: np.ndarray, filled: int, x: float, j: int) -> int:
    """Insert x into the k largest so far (the first ``filled`` slots; x larger than the k-th once
    all k are filled), kept descending with their indices (ties keep the earlier index); the number
    of slots filled now. Counting them, not testing x against the empty slots' -inf, lets -inf in."""
    k = len(values)
    p = min(filled, k - 1)
    while p > 0 and x > values[p - 1]:
        values[p] = values[p - 1]
        where[p] = where[p - 1]
        p -= 1
    values[p] = x
    where[p] = j
    return min(filled + 1, k)


@njit(cache=True, nogil=True, fastmath=FAST)
def _kl(a: np.ndarray, b: np.ndarray, max_a: float, max_b: float) -> float:
    """KL(softmax(a) || softmax(b)) = sum p_a (u - v) - log sum e^u + log sum e^v, clamped at 0,
    with u = a - max a and v = b - max b: every term is shifted, so logits of any size keep their
    precision (the shifts cancel exactly). A NaN term (the same -inf both sides) counts as 0."""
    shift_a, shift_b = shift_for(a, max_a), shift_for(b, max_b)
    scale, zero = np.float32(LOG2E), np.float32(0)
    sum_a, sum_b, weighted = np.float64(0.0), np.float64(0.0), np.float64(0.0)  # float64 across blocks
    for start in range(0, len(a), BLOCK):
        sa, sb, w = zero, zero, zero
        block_a, block_b = a[start : start + BLOCK], b[start : start + BLOCK]
        for j in range(len(block_a)):  # float32 throughout: vectorizes
            u = shifted(block_a[j], shift_a)
            v = shifted(block_b[j], shift_b)
            ea = _exp2_nonpositive(u * scale)
            sa += ea
            sb += _exp2_nonpositive(v * scale)
            gap = u - v
            w += ea * (gap if gap == gap else zero)
        sum_a, sum_b, weighted = sum_a + sa, sum_b + sb, weighted + w
    return max(weighted / sum_a - math.log(sum_a) + math.log(sum_b), 0.0)


@njit(inline="always", fastmath=FAST)
def _exp2_nonpositive(t: np.float32) -> np.float32:
    """2^t for t <= 0 as 2^n * p(t - n), n the nearest integer (below -126 it returns 2^-126)."""
    t = max(t, np.float32(-126.0))
    n = np.rint(t)
    f = t - n
    c0, c1, c2, c3, c4, c5 = EXP2_TERMS
    poly = c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * c5))))
    return poly * np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
