/*
 * decimal4's and decimal8's vector steps 256 bits wide (filters.h), for filters.c's
 * fanfs_unfilter where the CPU has AVX2 and FMA (Intel since Haswell, AMD since Excavator; Zen 1
 * splits each 256-bit operation in two, Zen 2 and later run them whole): the decimal filters'
 * pass is bound by its vector operations, not by memory (docs/performance.md, "Filtered arrays
 * decoded at zstd's speed"), and these take about two thirds of the 128-bit steps' per word.
 *
 * 32 words a step, one 32-byte load from each plane. AVX2's unpacks work within each 128-bit
 * half, so a step's vectors hold words 0-15 of the step in their low halves and 16-31 in their
 * high ones, each half in filters.c's order: each half's running sum is taken on its own (the
 * same shifts, per half), then the sum before the step is added to both and the low half's
 * total to the high one. The numbers are made and stored half by half. The same bits as
 * filters.c's 128-bit steps and portable passes, which tests/unit/test_native.py checks
 * against each other and against fanfs/image/filters.py at every width the CPU runs.
 *
 * Only called after __builtin_cpu_supports says the CPU has both (filters.c): built for them
 * function by function (`TARGET`), so the rest of fanfs runs on any x86-64.
 */
#include <string.h>

#include "fanfs_native.h"
#include "filters.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))
#define UNROLL _Pragma("GCC unroll 8")

/* Words [i, i + 32) of 4 planes, 8 to a vector: words 4k..4k+3 in vector k's low half,
 * 16+4k..16+4k+3 in its high one. */
TARGET static inline void gather4(const unsigned char *in, uint64_t words, uint64_t i,
                                  __m256i w[4]) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(in + i));
    __m256i b = _mm256_loadu_si256((const __m256i *)(in + words + i));
    __m256i c = _mm256_loadu_si256((const __m256i *)(in + 2 * words + i));
    __m256i d = _mm256_loadu_si256((const __m256i *)(in + 3 * words + i));
    __m256i abl = _mm256_unpacklo_epi8(a, b), abh = _mm256_unpackhi_epi8(a, b);
    __m256i cdl = _mm256_unpacklo_epi8(c, d), cdh = _mm256_unpackhi_epi8(c, d);
    w[0] = _mm256_unpacklo_epi16(abl, cdl);
    w[1] = _mm256_unpackhi_epi16(abl, cdl);
    w[2] = _mm256_unpacklo_epi16(abh, cdh);
    w[3] = _mm256_unpackhi_epi16(abh, cdh);
}

/* Words [i, i + 32) of 8 planes, 4 to a vector: words 2k, 2k+1 in vector k's low half,
 * 16+2k, 17+2k in its high one (filters.c's gather8, per half). */
TARGET static inline void gather8(const unsigned char *in, uint64_t words, uint64_t i,
                                  __m256i w[8]) {
    __m256i p[8], q[8], r[8];
    int b;
    UNROLL
    for (b = 0; b < 8; b++)
        p[b] = _mm256_loadu_si256((const __m256i *)(in + b * words + i));
    UNROLL
    for (b = 0; b < 8; b += 2) {
        q[b] = _mm256_unpacklo_epi8(p[b], p[b + 1]);
        q[b + 1] = _mm256_unpackhi_epi8(p[b], p[b + 1]);
    }
    UNROLL
    for (b = 0; b < 8; b += 4) {
        r[b] = _mm256_unpacklo_epi16(q[b], q[b + 2]);
        r[b + 1] = _mm256_unpackhi_epi16(q[b], q[b + 2]);
        r[b + 2] = _mm256_unpacklo_epi16(q[b + 1], q[b + 3]);
        r[b + 3] = _mm256_unpackhi_epi16(q[b + 1], q[b + 3]);
    }
    UNROLL
    for (b = 0; b < 4; b++) {
        w[2 * b] = _mm256_unpacklo_epi32(r[b], r[b + 4]);
        w[2 * b + 1] = _mm256_unpackhi_epi32(r[b], r[b + 4]);
    }
}

/* The unzigzagged difference: (z >> 1) ^ -(z & 1). */
TARGET static inline __m256i unzigzag4(__m256i z) {
    return _mm256_xor_si256(_mm256_srli_epi32(z, 1),
                            _mm256_sub_epi32(_mm256_setzero_si256(),
                                             _mm256_and_si256(z, _mm256_set1_epi32(1))));
}

TARGET static inline __m256i unzigzag8(__m256i z) {
    return _mm256_xor_si256(_mm256_srli_epi64(z, 1),
                            _mm256_sub_epi64(_mm256_setzero_si256(),
                                             _mm256_and_si256(z, _mm256_set1_epi64x(1))));
}

/* decimal4: running sums (mod 2^32) of the unzigzagged differences, times 10^-e (the double
 * filters.c's inv10 holds), rounded to float32: the same operations as filters.c's. */
TARGET uint64_t fanfs_decimal4_wide(const unsigned char *in, uint64_t words, double inv,
                                    unsigned char *out, uint32_t *acc) {
    const __m256d scale = _mm256_set1_pd(inv);
    __m256i carry = _mm256_setzero_si256(), x[4];
    uint64_t i;
    int k;
    for (i = 0; i + 32 <= words; i += 32) {
        __m256i before = _mm256_setzero_si256(), low, both;
        gather4(in, words, i, x);
        UNROLL
        for (k = 0; k < 4; k++) { /* each half's running sums, as filters.c's sums4 */
            x[k] = unzigzag4(x[k]);
            x[k] = _mm256_add_epi32(x[k], _mm256_slli_si256(x[k], 4));
            x[k] = _mm256_add_epi32(x[k], _mm256_slli_si256(x[k], 8));
            x[k] = _mm256_add_epi32(x[k], before);
            before = _mm256_shuffle_epi32(x[k], 0xFF);
        }
        low = _mm256_permute2x128_si256(before, before, 0x08); /* (0 | low half's total) */
        both = _mm256_add_epi32(before, low);                  /* (. | the step's total) */
        low = _mm256_add_epi32(low, carry);
        carry = _mm256_add_epi32(carry, _mm256_permute2x128_si256(both, both, 0x11));
        UNROLL
        for (k = 0; k < 4; k++) {
            __m256i n = _mm256_add_epi32(x[k], low);
            __m128 lo = _mm256_cvtpd_ps(
                _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(n)), scale));
            __m128 hi = _mm256_cvtpd_ps(
                _mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(n, 1)), scale));
            _mm_storeu_ps((float *)(out + 4 * (i + 4 * k)), lo);
            _mm_storeu_ps((float *)(out + 4 * (i + 16 + 4 * k)), hi);
        }
    }
    *acc = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(carry)); /* (GCC 8-10 lack
                                                     _mm256_cvtsi256_si32: RHEL 8's is 8) */
    return i;
}

/* decimal8: running sums of the unzigzagged differences, divided by 10^e as filters.c's
 * `quotient` divides (its comment says why that is the division's result), made doubles as its
 * `to_double` makes them (the sums biased by 2^51); an integer beyond 2^51 (hostile) takes
 * the division alone. */
TARGET uint64_t fanfs_decimal8_wide(const unsigned char *in, uint64_t words, double p10d,
                                    unsigned char *out, uint64_t *acc) {
    const __m256d p10 = _mm256_set1_pd(p10d), y = _mm256_set1_pd(1 / p10d);
    const __m256d magic = _mm256_set1_pd(6755399441055744.0); /* 1.5 * 2^52 */
    const __m256i two52 = _mm256_set1_epi64x(0x4330000000000000LL);
    const __m256i high = _mm256_set1_epi64x((int64_t)0xFFF0000000000000ULL);
    const uint64_t bias = 1ULL << 51;
    __m256i carry = _mm256_set1_epi64x((int64_t)bias), x[8];
    uint64_t i;
    int k;
    for (i = 0; i + 32 <= words; i += 32) {
        __m256i s = _mm256_setzero_si256(), prev, totals, low, both, bad = _mm256_setzero_si256();
        __m256d v[8];
        gather8(in, words, i, x);
        UNROLL
        for (k = 0; k < 8; k++) { /* each half's running sums, as filters.c's sums8 */
            prev = s;
            s = _mm256_add_epi64(s, unzigzag8(x[k]));
            x[k] = _mm256_add_epi64(s, _mm256_castpd_si256(_mm256_shuffle_pd(
                                           _mm256_castsi256_pd(prev), _mm256_castsi256_pd(s), 5)));
        }
        totals = _mm256_unpackhi_epi64(x[7], x[7]);
        low = _mm256_permute2x128_si256(totals, totals, 0x08);
        both = _mm256_add_epi64(totals, low);
        low = _mm256_add_epi64(low, carry);
        carry = _mm256_add_epi64(carry, _mm256_permute2x128_si256(both, both, 0x11));
        UNROLL
        for (k = 0; k < 8; k++) {
            __m256i b = _mm256_add_epi64(x[k], low);
            __m256d n = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(b, two52)), magic);
            __m256d q0 = _mm256_mul_pd(n, y);
            bad = _mm256_or_si256(bad, b);
            x[k] = b;
            v[k] = _mm256_fmadd_pd(_mm256_fnmadd_pd(q0, p10, n), y, q0);
        }
        if (_mm256_testz_si256(bad, high)) {
            UNROLL
            for (k = 0; k < 8; k++) {
                _mm_storeu_pd((double *)(out + 8 * (i + 2 * k)), _mm256_castpd256_pd128(v[k]));
                _mm_storeu_pd((double *)(out + 8 * (i + 16 + 2 * k)),
                              _mm256_extractf128_pd(v[k], 1));
            }
            continue;
        }
        for (k = 0; k < 8; k++) { /* an integer beyond 2^51 (hostile): converted alone */
            uint64_t b[4];
            double d[4];
            int j;
            _mm256_storeu_si256((__m256i *)b, x[k]);
            for (j = 0; j < 4; j++)
                d[j] = (double)(int64_t)(b[j] - bias) / p10d;
            memcpy(out + 8 * (i + 2 * k), d, 16);
            memcpy(out + 8 * (i + 16 + 2 * k), d + 2, 16);
        }
    }
    *acc = (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(carry)) - bias;
    return i;
}
#endif
