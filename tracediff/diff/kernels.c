/* Compiled row kernels: every per-row metric of two rows in one streaming pass over memory, rows
 * split across threads. Built by kernels.py with the machine's C compiler on first use (about a
 * second) and loaded through ctypes, which lets go of the GIL for the whole call.
 *
 * Rows are bfloat16 bit patterns (itemsize 2, decoded in registers), float32 (4) or float64 (8).
 * Their sums run in blocks of BLOCK elements: bfloat16 in float32 lanes (a product of two
 * bfloat16 values is exact in float32; the relative error of a 256-term float32 sum is near 1e-7,
 * four orders below bfloat16's own rounding), everything else in float64; blocks add in float64.
 * A row whose fast sums could be off (NaN/Inf anywhere, a peak outside the float32 trust range,
 * where squares leave float32's normal numbers) is measured again in float64 with infinities
 * handled (the same infinity on both sides counts as 0: a masked logit agrees).
 *
 * Overflow-safe: a row whose largest finite magnitude (of both sides) lies outside the float64
 * trust range (only float64 inputs get there) is measured a third time with both sides multiplied
 * by the one power of two that brings that magnitude into [1/2, 1). A power of two only moves the
 * exponent: exact for every value that stays normal, and the same on both sides, so rel_l2, cosine
 * and max_rel (ratios of sums) are those of the true values; max_abs and mean_abs are divided back.
 *
 * Logit rows (metrics 5..7): the maximum of each TOP_BLOCK elements is taken in the same pass as
 * the sums; top-k then scans only the blocks whose maximum reaches the k-th largest block maximum
 * (every block holding one of the k largest values has its maximum >= the k-th largest value >=
 * that threshold); KL shifts each side by its maximum (float64 logits shifted in float64 before they
 * are narrowed to float32, beyond whose range they would be Inf - Inf) and sums 2^t from a fitted
 * polynomial in float32 lanes. Every pass after the first reads the row from cache. Two finite
 * rows equal everywhere (|a-b|^2 = 0 from the first pass) skip them: their top-k are the same
 * indices and their KL is exactly 0 (every u - v is 0 and both sums are the same operations on the
 * same values), which is what the passes would compute.
 *
 * Floating point: reassociation and contraction only (the build flags): NaN and Inf keep their
 * IEEE meaning, so a row holding one is always seen. Maxima are taken on the bits of |x| (for a
 * non-negative float the bits order like the value, NaN above +Inf): integer maxima vectorize.
 * Block maxima of signed values use order keys (negative floats get their magnitude bits
 * inverted). numpy_kernels.py computes the same tables without a compiler; the tests compare them.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define TOP_BLOCK 64
#define MAX_K 64
#define MAX_THREADS 64
#define DMAX 1.7976931348623157e308
#define TINY 2.2250738585072014e-308
#define LOG2E 1.4426950408889634f

/* params: f32 trust range (low, high), f64 trust range (low, high), 6 exp2 coefficients. */
typedef struct {
    double f32_low, f32_high, f64_low, f64_high;
    float c[6];
} Params;

typedef struct {
    double max_abs, sum_abs, dd, aa, bb, peak_a, peak_b;
} Sums;

/* Elements as they lie in a mapped file: at any byte offset. These types tell the compiler so
 * (its vector loads are then unaligned ones). */
typedef uint16_t u16 __attribute__((aligned(1)));
typedef float f32 __attribute__((aligned(1)));
typedef double f64 __attribute__((aligned(1)));

static inline float bf16(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, 4);
    return value;
}

/* max(a, b) as Python (and numpy_kernels' reading of it) takes it: a unless b is larger, so a
 * NaN first argument stays NaN. */
static inline double pymax(double a, double b) { return b > a ? b : a; }

static inline uint32_t bits32(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float from_bits32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint64_t bits64(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }
static inline double from_bits64(uint64_t u) { double x; memcpy(&x, &u, 8); return x; }

/* A float's order key: a signed integer that orders like the float (NaN above +Inf). */
static inline int32_t key32(float x) {
    int32_t b = (int32_t)bits32(x);
    return b ^ ((b >> 31) & 0x7FFFFFFF);
}
static inline float unkey32(int32_t k) { return from_bits32((uint32_t)(k ^ ((k >> 31) & 0x7FFFFFFF))); }
static inline int64_t key64(double x) {
    int64_t b = (int64_t)bits64(x);
    return b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFFLL);
}
static inline double unkey64(int64_t k) {
    return from_bits64((uint64_t)(k ^ ((k >> 63) & 0x7FFFFFFFFFFFFFFFLL)));
}

/* The fast sums. bfloat16: float32 within a block; float32, float64: float64 throughout. With
 * `maxima` (logit rows) also each TOP_BLOCK's maximum of both rows, as stored (order keys). */
static Sums fast_bf16(const u16 *a, const u16 *b, int64_t width, double *max_a, double *max_b) {
    double sum_abs = 0, dd = 0, aa = 0, bb = 0;
    uint32_t m = 0, pa = 0, pb = 0;
    for (int64_t start = 0; start < width; start += BLOCK) {
        int64_t stop = start + BLOCK < width ? start + BLOCK : width;
        float s = 0, d2 = 0, a2 = 0, b2 = 0;
        for (int64_t j = start; j < stop; j++) {
            float x = bf16(a[j]), y = bf16(b[j]), d = x - y;
            uint32_t ad = bits32(fabsf(d)), ax = bits32(fabsf(x)), ay = bits32(fabsf(y));
            m = ad > m ? ad : m;
            pa = ax > pa ? ax : pa;
            pb = ay > pb ? ay : pb;
            s += fabsf(d);
            d2 += d * d;
            a2 += x * x;
            b2 += y * y;
        }
        sum_abs += s; dd += d2; aa += a2; bb += b2;
        if (max_a)
            for (int64_t t = start; t < stop; t += TOP_BLOCK) {
                int64_t end = t + TOP_BLOCK < stop ? t + TOP_BLOCK : stop;
                int32_t ka = key32(bf16(a[t])), kb = key32(bf16(b[t]));
                for (int64_t j = t; j < end; j++) {
                    int32_t x = key32(bf16(a[j])), y = key32(bf16(b[j]));
                    ka = x > ka ? x : ka;
                    kb = y > kb ? y : kb;
                }
                max_a[t / TOP_BLOCK] = unkey32(ka);
                max_b[t / TOP_BLOCK] = unkey32(kb);
            }
    }
    Sums r = {from_bits32(m), sum_abs, dd, aa, bb, from_bits32(pa), from_bits32(pb)};
    return r;
}

#define FAST_WIDE(NAME, T, KEY, UNKEY)                                                              \
    static Sums NAME(const T *a, const T *b, int64_t width, double *max_a, double *max_b) {          \
        double sum_abs = 0, dd = 0, aa = 0, bb = 0;                                                  \
        uint64_t m = 0, pa = 0, pb = 0;                                                              \
        for (int64_t start = 0; start < width; start += BLOCK) {                                     \
            int64_t stop = start + BLOCK < width ? start + BLOCK : width;                            \
            double s = 0, d2 = 0, a2 = 0, b2 = 0;                                                    \
            for (int64_t j = start; j < stop; j++) {                                                 \
                double x = (double)a[j], y = (double)b[j], d = x - y;                                \
                uint64_t ad = bits64(fabs(d)), ax = bits64(fabs(x)), ay = bits64(fabs(y));           \
                m = ad > m ? ad : m;                                                                 \
                pa = ax > pa ? ax : pa;                                                              \
                pb = ay > pb ? ay : pb;                                                              \
                s += fabs(d);                                                                        \
                d2 += d * d;                                                                         \
                a2 += x * x;                                                                         \
                b2 += y * y;                                                                         \
            }                                                                                        \
            sum_abs += s; dd += d2; aa += a2; bb += b2;                                              \
            if (max_a)                                                                               \
                for (int64_t t = start; t < stop; t += TOP_BLOCK) {                                  \
                    int64_t end = t + TOP_BLOCK < stop ? t + TOP_BLOCK : stop;                       \
                    __typeof__(KEY(a[t])) ka = KEY(a[t]), kb = KEY(b[t]);                            \
                    for (int64_t j = t; j < end; j++) {                                              \
                        __typeof__(KEY(a[t])) x = KEY(a[j]), y = KEY(b[j]);                          \
                        ka = x > ka ? x : ka;                                                        \
                        kb = y > kb ? y : kb;                                                        \
                    }                                                                                \
                    max_a[t / TOP_BLOCK] = UNKEY(ka);                                                \
                    max_b[t / TOP_BLOCK] = UNKEY(kb);                                                \
                }                                                                                    \
        }                                                                                            \
        Sums r = {from_bits64(m), sum_abs, dd, aa, bb, from_bits64(pa), from_bits64(pb)};            \
        return r;                                                                                    \
    }

FAST_WIDE(fast_f32, f32, key32, unkey32)
FAST_WIDE(fast_f64, f64, key64, unkey64)

/* One element as a double, whatever the row's type. */
static inline double element(const void *row, int64_t itemsize, int64_t j) {
    if (itemsize == 2) return bf16(((const u16 *)row)[j]);
    if (itemsize == 4) return ((const f32 *)row)[j];
    return ((const f64 *)row)[j];
}

/* The careful sums: float64 throughout, both sides times `scale`, the same infinity on both sides
 * counted as 0. Only for rows the fast sums cannot be trusted on. */
static Sums masked(const void *a, const void *b, int64_t itemsize, int64_t width, double scale) {
    double sum_abs = 0, dd = 0, aa = 0, bb = 0;
    uint64_t m = 0, pa = 0, pb = 0;
    for (int64_t j = 0; j < width; j++) {
        double x = element(a, itemsize, j) * scale, y = element(b, itemsize, j) * scale;
        if (isinf(x) && x == y) x = y = 0;
        double d = x - y;
        uint64_t ad = bits64(fabs(d)), ax = bits64(fabs(x)), ay = bits64(fabs(y));
        m = ad > m ? ad : m;
        pa = ax > pa ? ax : pa;
        pb = ay > pb ? ay : pb;
        sum_abs += fabs(d);
        dd += d * d;
        aa += x * x;
        bb += y * y;
    }
    Sums r = {from_bits64(m), sum_abs, dd, aa, bb, from_bits64(pa), from_bits64(pb)};
    return r;
}

static int sums_hold(Sums s, const Params *p) {
    int finite = (s.max_abs + s.sum_abs + s.dd + s.aa + s.bb) <= DMAX;
    int in_a = s.peak_a == 0.0 || (s.peak_a >= p->f32_low && s.peak_a <= p->f32_high);
    int in_b = s.peak_b == 0.0 || (s.peak_b >= p->f32_low && s.peak_b <= p->f32_high);
    return finite && in_a && in_b;
}

/* 1, or the power of two that brings the larger finite peak outside the float64 trust range into
 * [1/2, 1). */
static double scale_for(double peak_a, double peak_b, const Params *p) {
    double peak = pymax(peak_a, peak_b);
    if (!(peak <= DMAX && (peak > p->f64_high || (peak > 0.0 && peak < p->f64_low)))) return 1.0;
    int exponent;
    frexp(peak, &exponent);
    return ldexp(1.0, -exponent);
}

/* Insert x into the k largest so far (the first `filled` slots), kept descending with their
 * indices (ties keep the earlier index); returns the slots filled now. Counting the slots, not
 * testing x against empty slots' -inf, lets -inf in. */
static int64_t insert(double *values, int64_t *where, int64_t k, int64_t filled, double x, int64_t j) {
    int64_t p = filled < k - 1 ? filled : k - 1;
    while (p > 0 && x > values[p - 1]) {
        values[p] = values[p - 1];
        where[p] = where[p - 1];
        p--;
    }
    values[p] = x;
    where[p] = j;
    return filled + 1 < k ? filled + 1 : k;
}

/* The k largest values of a row, descending, and their indices (ties: the earlier index). Only
 * blocks whose maximum reaches the k-th largest block maximum are scanned. */
static void top(const void *row, int64_t itemsize, int64_t width, const double *maxima, int64_t k,
                double *values, int64_t *where) {
    int64_t blocks = (width + TOP_BLOCK - 1) / TOP_BLOCK, filled = 0;
    for (int64_t i = 0; i < k; i++) { values[i] = -INFINITY; where[i] = -1; }
    for (int64_t block = 0; block < blocks; block++)
        if (filled < k || maxima[block] > values[k - 1])
            filled = insert(values, where, k, filled, maxima[block], block);
    double threshold = filled == k ? values[k - 1] : -INFINITY, kth = -INFINITY;
    for (int64_t i = 0; i < k; i++) { values[i] = -INFINITY; where[i] = -1; }
    filled = 0;
    for (int64_t block = 0; block < blocks; block++) {
        if (maxima[block] < threshold) continue;
        int64_t end = (block + 1) * TOP_BLOCK < width ? (block + 1) * TOP_BLOCK : width;
        for (int64_t j = block * TOP_BLOCK; j < end; j++) {
            double x = element(row, itemsize, j);
            if (x > kth || filled < k) {
                filled = insert(values, where, k, filled, x, j);
                kth = values[k - 1];
            }
        }
    }
}

/* 2^t for t <= 0 as 2^n * p(t - n), n the nearest integer (below -126 it is 2^-126). */
static inline float exp2_nonpositive(float t, const float *c) {
    t = t < -126.0f ? -126.0f : t;
    float n = rintf(t);
    float f = t - n;
    float poly = c[0] + f * (c[1] + f * (c[2] + f * (c[3] + f * (c[4] + f * c[5]))));
    int32_t exponent = n == n ? (int32_t)n : 0;  /* NaN t: the polynomial is NaN already */
    return poly * from_bits32((uint32_t)(exponent + 127) << 23);
}

/* KL(softmax(a) || softmax(b)) = sum p_a (u - v) - log sum e^u + log sum e^v, clamped at 0, with
 * u = a - max a, v = b - max b (the shifts cancel exactly). A NaN term (the same -inf on both
 * sides) counts as 0. */
#define KL(NAME, T, SHIFTED)                                                                       \
    static double NAME(const T *a, const T *b, int64_t width, double max_a, double max_b,         \
                       const float *c) {                                                          \
        double sum_a = 0, sum_b = 0, weighted = 0;                                                \
        for (int64_t start = 0; start < width; start += BLOCK) {                                  \
            int64_t stop = start + BLOCK < width ? start + BLOCK : width;                         \
            float sa = 0, sb = 0, w = 0;                                                          \
            for (int64_t j = start; j < stop; j++) {                                              \
                float u = SHIFTED(a[j], max_a), v = SHIFTED(b[j], max_b);                         \
                float ea = exp2_nonpositive(u * LOG2E, c);                                        \
                sa += ea;                                                                         \
                sb += exp2_nonpositive(v * LOG2E, c);                                             \
                float gap = u - v;                                                                \
                w += ea * (gap == gap ? gap : 0.0f);                                              \
            }                                                                                     \
            sum_a += sa; sum_b += sb; weighted += w;                                              \
        }                                                                                         \
        return pymax(weighted / sum_a - log(sum_a) + log(sum_b), 0.0);                            \
    }

#define SHIFT_BF16(x, m) (bf16(x) - (float)(m))
#define SHIFT_F32(x, m) ((x) - (float)(m))
#define SHIFT_F64(x, m) ((float)((x) - (m)))
KL(kl_bf16, u16, SHIFT_BF16)
KL(kl_f32, f32, SHIFT_F32)
KL(kl_f64, f64, SHIFT_F64)

/* One row pair into out[8] (NaN-filled by the caller). A NaN/Inf difference leaves all NaN. Cosine
 * comes from the norms as 1 - (|a-b|^2 - (|a|-|b|)^2) / (2|a||b|), exact near 1; with a side all
 * zero it is 1 if both are, 0 otherwise. */
static void row_metrics(const void *a, const void *b, int64_t itemsize, int64_t width, int logits,
                        int64_t k, const Params *p, double *maxima, double *out) {
    double *max_a = logits && width ? maxima : 0, *max_b = max_a ? maxima + width / TOP_BLOCK + 1 : 0;
    Sums s = itemsize == 2 ? fast_bf16(a, b, width, max_a, max_b)
             : itemsize == 4 ? fast_f32(a, b, width, max_a, max_b)
                             : fast_f64(a, b, width, max_a, max_b);
    double scale = 1.0;
    int trusted = sums_hold(s, p);
    if (!trusted) {
        s = masked(a, b, itemsize, width, 1.0);
        scale = scale_for(s.peak_a, s.peak_b, p);
        if (scale != 1.0) s = masked(a, b, itemsize, width, scale);
    }
    if (!(s.sum_abs <= DMAX)) return;
    double norm_d = sqrt(s.dd), norm_a = sqrt(s.aa), norm_b = sqrt(s.bb);
    out[0] = s.max_abs / scale;
    out[1] = width ? s.sum_abs / (double)width / scale : 0.0;
    out[2] = norm_d / pymax(norm_a, TINY);
    double span = 2.0 * norm_a * norm_b, gap = norm_a - norm_b;
    out[3] = span > 0.0 ? 1.0 - (s.dd - gap * gap) / span : (s.dd == 0.0 ? 1.0 : 0.0);
    out[4] = s.max_abs / pymax(s.peak_a, TINY);
    if (!max_a) return;
    if (trusted && s.dd == 0.0) {  /* finite rows equal everywhere: the same top-k, KL exactly 0 */
        out[5] = out[6] = 1.0;
        out[7] = 0.0;
        return;
    }
    double top_a[MAX_K], top_b[MAX_K];
    int64_t where_a[MAX_K], where_b[MAX_K], shared = 0;
    top(a, itemsize, width, max_a, k, top_a, where_a);
    top(b, itemsize, width, max_b, k, top_b, where_b);
    out[5] = where_a[0] == where_b[0] ? 1.0 : 0.0;
    for (int64_t i = 0; i < k; i++)
        for (int64_t j = 0; j < k; j++) shared += where_a[i] == where_b[j];
    out[6] = (double)shared / (double)k;
    out[7] = itemsize == 2 ? kl_bf16(a, b, width, top_a[0], top_b[0], p->c)
             : itemsize == 4 ? kl_f32(a, b, width, top_a[0], top_b[0], p->c)
                             : kl_f64(a, b, width, top_a[0], top_b[0], p->c);
}

typedef struct {
    const uint8_t *base_a, *base_b;
    const int64_t *at_a, *at_b;  /* byte offset of each row; NULL: rows lie one after another */
    int64_t lo, hi, width, itemsize, k;
    int logits;
    const Params *p;
    double *out;
    double *maxima;  /* scratch: 2 x (width / TOP_BLOCK + 1) block maxima */
} Work;

static void *run(void *arg) {
    Work *w = arg;
    int64_t row_bytes = w->width * w->itemsize;
    for (int64_t i = w->lo; i < w->hi; i++) {
        const uint8_t *a = w->base_a + (w->at_a ? w->at_a[i] : i * row_bytes);
        const uint8_t *b = w->base_b + (w->at_b ? w->at_b[i] : i * row_bytes);
        row_metrics(a, b, w->itemsize, w->width, w->logits, w->k, w->p, w->maxima, w->out + 8 * i);
    }
    return 0;
}

/* out[n, 8] (NaN-filled) of n row pairs: contiguous rows (at_a, at_b NULL) or rows at byte offsets
 * of two mapped files; `params` as Params (10 doubles); `maxima` scratch of threads x 2 x
 * (width / TOP_BLOCK + 1) doubles. Rows are split into `threads` contiguous ranges. Returns 0, or
 * -1 when k is out of range (nothing measured). */
int td_compare(const uint8_t *base_a, const int64_t *at_a, const uint8_t *base_b, const int64_t *at_b,
               int64_t n, int64_t width, int64_t itemsize, int logits, int64_t k, const double *params,
               double *maxima, double *out, int64_t threads) {
    if (k < 1 || k > MAX_K) return -1;
    Params p = {params[0], params[1], params[2], params[3], {0}};
    for (int i = 0; i < 6; i++) p.c[i] = (float)params[4 + i];
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (threads > n) threads = n > 0 ? n : 1;
    Work work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t per = (n + threads - 1) / threads, scratch = 2 * (width / TOP_BLOCK + 1);
    for (int64_t t = 0; t < threads; t++) {
        Work w = {base_a, base_b, at_a, at_b, t * per, (t + 1) * per < n ? (t + 1) * per : n, width,
                  itemsize, k, logits, &p, out, maxima + t * scratch};
        work[t] = w;
    }
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], 0, run, &work[t]) == 0;
    run(&work[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], 0);
        else run(&work[t]);  /* no thread to be had: this one does the range */
    }
    return 0;
}
