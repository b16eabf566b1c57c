/*
 * The array filters undone (filters.h): the inverse of fanfs/image/filters.py, byte for byte.
 *
 * A filtered piece is decoded by zstd into the thread's scratch (codec.c), then undone from
 * there into the piece's buffer: this pass is all that a filter adds to zstd's own decode, so
 * each filter is one pass over the bytes, written to keep up with zstd (tools/decode_bench.py;
 * docs/performance.md, "Compression"). A word's bytes lie in 4 or 8 planes (byte b of word i
 * at in[b * words + i]): 16 words at a time are gathered with SSE2's unpacks, one 16-byte load
 * from each plane, and their running sum, unzigzag and scaling are done in registers. The
 * words a block of 16 (or 32) leaves over, and every word where there is no SSE2 (aarch64),
 * take the portable passes (rest4, rest8: the code before the vectors, which GCC vectorizes
 * for any machine), which compute the same bits. Where the CPU has AVX2 and FMA, decimal4
 * and decimal8 take 32 words a step instead (filters_avx2.c): their pass is bound by its
 * vector operations, which 256-bit vectors make about a third fewer. fanfs_vectors says which
 * width runs, and tests/unit/test_native.py checks every width the CPU runs (sizes that leave
 * a tail) against fanfs/image/filters.py and against each other.
 */
#include <errno.h>
#include <string.h>

#include "fanfs_native.h"
#include "filters.h"

#if defined(__SSE2__) && defined(__x86_64__)
#define VECTORS 1
#include <emmintrin.h>
#endif

int fanfs_filter_width(int fid) {
    switch (fid) {
    case FANFS_SHUFFLE4: case FANFS_DELTA4: case FANFS_DECIMAL4: return 4;
    case FANFS_SHUFFLE8: case FANFS_DELTA8: case FANFS_DECIMAL8: return 8;
    default: return 0;
    }
}

uint64_t fanfs_filtered_max(int fid, uint32_t size) {
    int w = fanfs_filter_width(fid);
    if (fid == FANFS_DECIMAL4 || fid == FANFS_DECIMAL8)
        return 8 + (uint64_t)(size / w) * (4 + w) + size;
    return size;
}

/* 10^e for decimal8 (a division, so every decimal round-trips) and the double nearest 10^-e
 * for decimal4 (a multiplication: rounding to float32 hides its last-bit error, and the
 * encoder keeps as exceptions the values it does not give back). Literals, as
 * fanfs/image/filters.py parses the same strings. */
static const double pow10[19] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9,
                                 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18};
static const double inv10[11] = {1e-0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8,
                                 1e-9, 1e-10};

/* -- the portable passes: every word where there are no vectors, the words a block of 16 (or
 * 32) leaves over where there are. Separate passes (unshuffle, running sum, scaling), so that all
 * but the running sum vectorize, which GCC does at -O3 only (Python's builds use -O2): asked
 * for per function. */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORIZE __attribute__((optimize("O3")))
#else
#define VECTORIZE
#endif

/* The passes view one buffer as words, then as numbers: views that may alias. */
typedef int32_t i32a __attribute__((may_alias));
typedef int64_t i64a __attribute__((may_alias));
typedef float f32a __attribute__((may_alias));
typedef double f64a __attribute__((may_alias));

/* Words [from, words) of a shuffled stream (byte b of word i is in plane b: in[b * words + i]). */
VECTORIZE static void unshuffle4(const unsigned char *in, uint64_t words, uint64_t from,
                                 uint32_t *out) {
    const unsigned char *p0 = in, *p1 = in + words, *p2 = in + 2 * words, *p3 = in + 3 * words;
    uint64_t i;
    for (i = from; i < words; i++)
        out[i] = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 |
                 (uint32_t)p3[i] << 24;
}

VECTORIZE static void unshuffle8(const unsigned char *in, uint64_t words, uint64_t from,
                                 uint64_t *out) {
    uint64_t i, n = words - from;
    int b;
    out += from;
    for (i = 0; i < n; i++)
        out[i] = 0;
    for (b = 0; b < 8; b++) {
        const unsigned char *plane = in + b * words + from;
        for (i = 0; i < n; i++)
            out[i] |= (uint64_t)plane[i] << (8 * b);
    }
}

/* Words [from, words) of a 4-byte filter's planes into `out`; `acc` is the running sum of the
 * words before (delta4: of the words; decimal4: of the unzigzagged differences, mod 2^32). */
VECTORIZE static void rest4(int fid, const unsigned char *in, uint64_t words, uint64_t from,
                            uint32_t acc, double inv, unsigned char *out) {
    uint32_t *z = (uint32_t *)out + from;
    i32a *nn = (i32a *)z;
    f32a *f = (f32a *)z;
    uint64_t i, n = words - from;
    unshuffle4(in, words, from, (uint32_t *)out);
    if (fid == FANFS_DELTA4) {
        for (i = 0; i < n; i++)
            z[i] = acc += z[i];
    } else if (fid == FANFS_DECIMAL4) {
        for (i = 0; i < n; i++) {
            acc += (z[i] >> 1) ^ (0u - (z[i] & 1u));
            z[i] = acc;
        }
        for (i = 0; i < n; i++)
            f[i] = (float)((double)nn[i] * inv);
    }
}

/* The same for 8-byte words (decimal8 divides by `p10`). */
VECTORIZE static void rest8(int fid, const unsigned char *in, uint64_t words, uint64_t from,
                            uint64_t acc, double p10, unsigned char *out) {
    uint64_t *z = (uint64_t *)out + from, i, n = words - from;
    i64a *nn = (i64a *)z;
    f64a *v = (f64a *)z;
    unshuffle8(in, words, from, (uint64_t *)out);
    if (fid == FANFS_DELTA8) {
        for (i = 0; i < n; i++)
            z[i] = acc += z[i];
    } else if (fid == FANFS_DECIMAL8) {
        for (i = 0; i < n; i++) {
            acc += (z[i] >> 1) ^ (0u - (z[i] & 1u));
            z[i] = acc;
        }
        for (i = 0; i < n; i++)
            v[i] = (double)nn[i] / p10;
    }
}

#if defined(VECTORS)
#define BLOCK 16 /* words per vector step: one 16-byte load from each plane */
/* The loops over a block's vectors unrolled (GCC does so at -O3 only; Python's builds use
 * -O2), so that the vectors stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

/* Words [i, i + 16) of 4 planes, 4 to a vector. */
static inline void gather4(const unsigned char *in, uint64_t words, uint64_t i, __m128i w[4]) {
    __m128i a = _mm_loadu_si128((const __m128i *)(in + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(in + words + i));
    __m128i c = _mm_loadu_si128((const __m128i *)(in + 2 * words + i));
    __m128i d = _mm_loadu_si128((const __m128i *)(in + 3 * words + i));
    __m128i abl = _mm_unpacklo_epi8(a, b), abh = _mm_unpackhi_epi8(a, b);
    __m128i cdl = _mm_unpacklo_epi8(c, d), cdh = _mm_unpackhi_epi8(c, d);
    w[0] = _mm_unpacklo_epi16(abl, cdl);
    w[1] = _mm_unpackhi_epi16(abl, cdl);
    w[2] = _mm_unpacklo_epi16(abh, cdh);
    w[3] = _mm_unpackhi_epi16(abh, cdh);
}

/* Words [i, i + 16) of 8 planes, 2 to a vector: bytes paired, then pairs, then quads. */
static inline void gather8(const unsigned char *in, uint64_t words, uint64_t i, __m128i w[8]) {
    __m128i p[8], q[8], r[8];
    int b;
    UNROLL
    for (b = 0; b < 8; b++)
        p[b] = _mm_loadu_si128((const __m128i *)(in + b * words + i));
    UNROLL
    for (b = 0; b < 8; b += 2) { /* q[b]: bytes b, b+1 of words 0-7; q[b+1]: of 8-15 */
        q[b] = _mm_unpacklo_epi8(p[b], p[b + 1]);
        q[b + 1] = _mm_unpackhi_epi8(p[b], p[b + 1]);
    }
    UNROLL
    for (b = 0; b < 8; b += 4) { /* r[b..b+3]: bytes b..b+3 of words 0-3, 4-7, 8-11, 12-15 */
        r[b] = _mm_unpacklo_epi16(q[b], q[b + 2]);
        r[b + 1] = _mm_unpackhi_epi16(q[b], q[b + 2]);
        r[b + 2] = _mm_unpacklo_epi16(q[b + 1], q[b + 3]);
        r[b + 3] = _mm_unpackhi_epi16(q[b + 1], q[b + 3]);
    }
    UNROLL
    for (b = 0; b < 4; b++) {
        w[2 * b] = _mm_unpacklo_epi32(r[b], r[b + 4]);
        w[2 * b + 1] = _mm_unpackhi_epi32(r[b], r[b + 4]);
    }
}

/* Running sums (mod 2^32) of the block's 16 words, `carry` (all lanes) the sum before it.
 * The block's own sums do not wait for `carry`: only one add per block does, so blocks
 * overlap. */
static inline void sums4(__m128i x[4], __m128i *carry) {
    __m128i before = _mm_setzero_si128(); /* the block's words before vector k */
    int k;
    UNROLL
    for (k = 0; k < 4; k++) {
        x[k] = _mm_add_epi32(x[k], _mm_slli_si128(x[k], 4));
        x[k] = _mm_add_epi32(x[k], _mm_slli_si128(x[k], 8));
        x[k] = _mm_add_epi32(x[k], before);
        before = _mm_shuffle_epi32(x[k], 0xFF);
    }
    UNROLL
    for (k = 0; k < 4; k++)
        x[k] = _mm_add_epi32(x[k], *carry);
    *carry = _mm_add_epi32(*carry, before);
}

/* For 8-byte words, 2 to a vector, with one shuffle per vector (a shift and a broadcast,
 * sums4's way, took two and were a fifth of delta8's pass):
 * s, the lanewise sum of the block's vectors 0..k, holds in its low lane the sum of the
 * even words up to 2k and in its high lane of the odd ones up to 2k + 1; word 2k's sum is
 * then s's low lane plus the high lane of the s before it, word 2k+1's s's two lanes. The
 * sum before the block starts s's low lane: `carry` is (that sum, 0). */
static inline void sums8(__m128i x[8], __m128i *carry) {
    __m128i s = *carry, prev;
    int k;
    UNROLL
    for (k = 0; k < 8; k++) {
        prev = s;
        s = _mm_add_epi64(s, x[k]);
        x[k] = _mm_add_epi64(s, _mm_castpd_si128(_mm_shuffle_pd(_mm_castsi128_pd(prev),
                                                                _mm_castsi128_pd(s), 1)));
    }
    *carry = _mm_unpackhi_epi64(x[7], _mm_setzero_si128());
}

/* The vector steps of a 4-byte filter; the words done, `*acc` the running sum after them.
 * Inlined for each filter (blocks4, blocks8 below), so that each loop holds only its own
 * filter's work and its vectors stay in registers. */
static inline __attribute__((always_inline)) uint64_t
steps4(const int fid, const unsigned char *in, uint64_t words, double inv, unsigned char *out,
       uint32_t *acc) {
    const __m128i one = _mm_set1_epi32(1), zero = _mm_setzero_si128();
    const __m128d scale = _mm_set1_pd(inv);
    __m128i carry = zero, x[4];
    uint64_t i;
    int k;
    for (i = 0; i + BLOCK <= words; i += BLOCK) {
        gather4(in, words, i, x);
        if (fid == FANFS_DECIMAL4) {
            UNROLL
            for (k = 0; k < 4; k++) /* unzigzag */
                x[k] = _mm_xor_si128(_mm_srli_epi32(x[k], 1),
                                     _mm_sub_epi32(zero, _mm_and_si128(x[k], one)));
            sums4(x, &carry);
            UNROLL
            for (k = 0; k < 4; k++) { /* float(double(n) * inv), as rest4 */
                __m128d lo = _mm_mul_pd(_mm_cvtepi32_pd(x[k]), scale);
                __m128d hi = _mm_mul_pd(_mm_cvtepi32_pd(_mm_unpackhi_epi64(x[k], x[k])), scale);
                x[k] = _mm_castps_si128(_mm_movelh_ps(_mm_cvtpd_ps(lo), _mm_cvtpd_ps(hi)));
            }
        } else if (fid == FANFS_DELTA4) {
            sums4(x, &carry);
        }
        UNROLL
        for (k = 0; k < 4; k++)
            _mm_storeu_si128((__m128i *)(out + 4 * i + 16 * k), x[k]);
    }
    *acc = (uint32_t)_mm_cvtsi128_si32(carry);
    return i;
}

/* decimal8's quotient n / 10^e, correctly rounded as a division gives it, without one where
 * the CPU has FMA (x86-64 since 2013; a division takes the divider several times as long as
 * a multiply-add takes its unit): with y = RN(10^-e),
 *     q0 = RN(n * y),  r = RN(n - q0 * 10^e),  q = RN(q0 + r * y),
 * the last two fused (one rounding each). Why q = RN(n / 10^e), for -2^51 <= n < 2^51, e <= 18
 * (what the vectors take; t = n / 10^e, u = ulp(t), the gap between doubles at t):
 * - y = (1 + d) / 10^e with |d| <= 2^-53, so |q0 - t| <= 2u (u for n * y's error, u for
 *   the rounding of it, which may cross into the binade above);
 * - r = (n - q0 * 10^e)(1 + d2), |d2| <= 2^-53, so q0 + r * y = t + (t - q0)(d + d2 + d d2),
 *   within 2u * 2^-52 (and a hair) < u * 2^-50 of t;
 * - a tie point m of rounding near t (a midpoint between doubles, gap u or u/2) is
 *   m = M * 2^(k-1) with 2^(k-1) >= u / 4; n - m * 10^e is then a nonzero multiple of
 *   2^(k-1+e) (k - 1 + e < 0, as u < 2^-1 / 10^e; zero would make t = m, whose odd part
 *   needs 54 bits, from an n of 51), so |t - m| >= 2^(k-1) / 5^e >= u / 4 / 5^18 > u * 2^-44;
 * so no tie point lies between t and the value rounded: q = RN(t). (Markstein's correction
 * step, here with the bound made sharp by 10^e's small odd part, 5^e.) The same bits as
 * `rest8`'s division, checked against numpy's by tests/unit/test_native.py. The two fused
 * steps are asm: their intrinsics would need every function they are inlined into built for
 * FMA, which blocks8 picks at run time (`__builtin_cpu_supports`). */
static inline __m128d fnmadd(__m128d a, __m128d b, __m128d c) { /* RN(c - a * b) */
    __asm__("vfnmadd231pd {%2, %1, %0|%0, %1, %2}" : "+x"(c) : "x"(a), "x"(b));
    return c;
}

static inline __m128d fmadd(__m128d a, __m128d b, __m128d c) { /* RN(c + a * b) */
    __asm__("vfmadd231pd {%2, %1, %0|%0, %1, %2}" : "+x"(c) : "x"(a), "x"(b));
    return c;
}

static inline __m128d quotient(__m128d n, __m128d p10, __m128d y) {
    __m128d q0 = _mm_mul_pd(n, y);
    return fmadd(fnmadd(q0, p10, n), y, q0);
}

/* decimal8's doubles of 2 int64 n in -2^51..2^51-1, given as b = n + 2^51 (the running sum
 * starts at 2^51, so the bias costs nothing): for b in 0..2^52-1, the bits of 2^52 with b as
 * the mantissa are the double 2^52 + b, exact, from which 1.5 * 2^52 taken away, exact,
 * leaves n: (double)n without AVX-512's conversion. `*bad` gathers the bs: a bit above 51 is
 * set there only if some n is beyond (hostile). */
static inline __m128d to_double(__m128i b, __m128i *bad) {
    const __m128i two52 = _mm_set1_epi64x(0x4330000000000000LL); /* 2^52 */
    const __m128d magic = _mm_set1_pd(6755399441055744.0);        /* 1.5 * 2^52 */
    *bad = _mm_or_si128(*bad, b);
    return _mm_sub_pd(_mm_castsi128_pd(_mm_or_si128(b, two52)), magic);
}

static inline __attribute__((always_inline)) uint64_t
steps8(const int fid, const int fused, const unsigned char *in, uint64_t words, double p10,
       unsigned char *out, uint64_t *acc) {
    const __m128i one = _mm_set1_epi64x(1), zero = _mm_setzero_si128();
    const __m128d scale = _mm_set1_pd(p10), inv = _mm_set1_pd(1 / p10);
    const uint64_t bias = fid == FANFS_DECIMAL8 ? 1ULL << 51 : 0; /* to_double's */
    __m128i carry = _mm_set_epi64x(0, (int64_t)bias), x[8];
    uint64_t i;
    int k;
    for (i = 0; i + BLOCK <= words; i += BLOCK) {
        gather8(in, words, i, x);
        if (fid == FANFS_DECIMAL8) {
            __m128i bad = zero;
            __m128d v[8];
            UNROLL
            for (k = 0; k < 8; k++)
                x[k] = _mm_xor_si128(_mm_srli_epi64(x[k], 1),
                                     _mm_sub_epi64(zero, _mm_and_si128(x[k], one)));
            sums8(x, &carry);
            UNROLL
            for (k = 0; k < 8; k++)
                v[k] = fused ? quotient(to_double(x[k], &bad), scale, inv)
                             : _mm_div_pd(to_double(x[k], &bad), scale);
            bad = _mm_srli_epi64(bad, 52);
            if (_mm_movemask_epi8(_mm_cmpeq_epi32(bad, zero)) == 0xFFFF) {
                UNROLL
                for (k = 0; k < 8; k++)
                    _mm_storeu_pd((double *)(out + 8 * i + 16 * k), v[k]);
                continue;
            }
            for (k = 0; k < 8; k++) { /* an integer beyond 2^51 (hostile): converted alone */
                uint64_t b[2];
                double d[2];
                _mm_storeu_si128((__m128i *)b, x[k]);
                d[0] = (double)(int64_t)(b[0] - bias) / p10;
                d[1] = (double)(int64_t)(b[1] - bias) / p10;
                memcpy(out + 8 * i + 16 * k, d, 16);
            }
            continue;
        }
        if (fid == FANFS_DELTA8)
            sums8(x, &carry);
        UNROLL
        for (k = 0; k < 8; k++)
            _mm_storeu_si128((__m128i *)(out + 8 * i + 16 * k), x[k]);
    }
    *acc = (uint64_t)_mm_cvtsi128_si64(carry) - bias;
    return i;
}

static uint64_t blocks4(int fid, const unsigned char *in, uint64_t words, double inv,
                        unsigned char *out, uint32_t *acc) {
    if (fid == FANFS_DELTA4)
        return steps4(FANFS_DELTA4, in, words, inv, out, acc);
    if (fid == FANFS_DECIMAL4)
        return steps4(FANFS_DECIMAL4, in, words, inv, out, acc);
    return steps4(FANFS_SHUFFLE4, in, words, inv, out, acc);
}

static uint64_t blocks8(int fid, const unsigned char *in, uint64_t words, double p10,
                        unsigned char *out, uint64_t *acc) {
    if (fid == FANFS_DELTA8)
        return steps8(FANFS_DELTA8, 0, in, words, p10, out, acc);
    if (fid == FANFS_DECIMAL8 && __builtin_cpu_supports("fma"))
        return steps8(FANFS_DECIMAL8, 1, in, words, p10, out, acc);
    if (fid == FANFS_DECIMAL8)
        return steps8(FANFS_DECIMAL8, 0, in, words, p10, out, acc);
    return steps8(FANFS_SHUFFLE8, 0, in, words, p10, out, acc);
}
#endif

int fanfs_vectors(void) {
#if defined(VECTORS)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 256 : 128;
#else
    return 0;
#endif
}

int fanfs_unfilter(int fid, const unsigned char *in, uint64_t n, unsigned char *out,
                   uint32_t size) {
    return fanfs_unfilter_at(fid, in, n, out, size, fanfs_vectors());
}

int fanfs_unfilter_at(int fid, const unsigned char *in, uint64_t n, unsigned char *out,
                      uint32_t size, int vectors) {
    int w = fanfs_filter_width(fid);
    const unsigned char *pos = in, *kept = in;
    uint64_t words, i = 0, k = 0;
    double scale = 1;
    uint32_t acc4 = 0;
    uint64_t acc8 = 0;
    if (vectors > fanfs_vectors())
        return EINVAL;
    if (w == 0 || size % w)
        return FANFS_EBADDATA;
    words = size / w;
    if (fid == FANFS_DECIMAL4 || fid == FANFS_DECIMAL8) {
        uint32_t e, k32;
        if (n < 8)
            return FANFS_EBADDATA;
        e = in[0];
        memcpy(&k32, in + 4, 4);
        if (e > (uint32_t)(w == 4 ? 10 : 18) || k32 > words ||
            n != 8 + (uint64_t)k32 * (4 + w) + size)
            return FANFS_EBADDATA;
        k = k32;
        pos = in + 8;
        kept = pos + k * 4;
        in = kept + k * w; /* the shuffled zigzagged differences */
        scale = w == 4 ? inv10[e] : pow10[e];
    } else if (n != size) {
        return FANFS_EBADDATA;
    }
    if (w == 4) {
#if defined(VECTORS)
        if (vectors >= 256 && fid == FANFS_DECIMAL4)
            i = fanfs_decimal4_wide(in, words, scale, out, &acc4);
        else if (vectors >= 128)
            i = blocks4(fid, in, words, scale, out, &acc4);
#endif
        rest4(fid, in, words, i, acc4, scale, out);
    } else {
#if defined(VECTORS)
        if (vectors >= 256 && fid == FANFS_DECIMAL8)
            i = fanfs_decimal8_wide(in, words, scale, out, &acc8);
        else if (vectors >= 128)
            i = blocks8(fid, in, words, scale, out, &acc8);
#endif
        rest8(fid, in, words, i, acc8, scale, out);
    }
    for (i = 0; i < k; i++) { /* decimal's exceptions: the original words */
        uint32_t at;
        memcpy(&at, pos + i * 4, 4);
        if (at >= words)
            return FANFS_EBADDATA;
        memcpy(out + (uint64_t)at * w, kept + i * w, w);
    }
    return 0;
}
