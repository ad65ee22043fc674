/* What the K-quant formats (quant_q4_k.c, quant_q5_k.c, quant_q6_k.c) share: super-blocks of
 * QK_K = 256 values whose sub-blocks of 32 (Q6_K: 16) values each have a scale. The matmul takes
 * a super-block one 32-value sub-block at a time, as a 32-value format's block (the activations'
 * blocks are 32 values), the sub-block's scale folded into the block's d:
 *
 *     out += (d sc) dx dot(q, x) - (dmin m) sx      (Q4_K, Q5_K: 8 sub-blocks of 32)
 *     out += (d sc_lo) dx dot_lo + (d sc_hi) dx dot_hi      (Q6_K: 16 sub-blocks of 16)
 *
 * Q4_K and Q5_K start alike: fp16 d and dmin, then 12 bytes holding 8 six-bit scales and 8
 * six-bit mins (ggml's get_scale_min_k4 layout): sub-block j < 4 has the low 6 bits of bytes j
 * (scale) and j + 4 (min); j >= 4 has byte j + 4's low (scale) and high (min) nibbles as low 4
 * bits, bytes j - 4's and j's top 2 bits as high ones.
 */
#ifndef NANOSERVE_QUANT_KQUANTS_H
#define NANOSERVE_QUANT_KQUANTS_H

#include "quant.h"
#include "quant_strips_avx2.h"
#include "quant_strips_avx512.h"

enum { KQ_SUBS = QK_K / QK }; /* 32-value sub-blocks of a super-block */

/* The 16 bytes that start a Q4_K and a Q5_K block. */
typedef struct {
    uint16_t d, dmin; /* fp16 */
    uint8_t scales[12];
} kquant_head;

/* Sub-block j's 6-bit scale and min. */
static inline void kquant_scale_min(const uint8_t s[12], int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Sub-block j's d sc and -(dmin m): what its dot and its activations' sx are scaled by. */
static inline void kquant_sub_scales(const kquant_head *h, int j, float *d, float *neg_m) {
    int sc, m;
    kquant_scale_min(h->scales, j, &sc, &m);
    *d = ns_f16_to_f32(h->d) * (float)sc;
    *neg_m = -(ns_f16_to_f32(h->dmin) * (float)m);
}

#if NS_X86
/* ---------------------------------------------------------------- AVX2 */

/* The fp16 in the low (hi = 0) or high 16 bits of each of v's 8 lanes, as floats. */
AVX2_INLINE __m256 half_lanes_avx2(__m256i v, const int hi) {
    const __m256i h =
        hi ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    const __m256i packed = _mm256_packus_epi32(h, _mm256_setzero_si256());
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

/* Each sub-block j's d sc and -(dmin m) (kquant_sub_scales) into s[j], for 8 rows of Q4_K /
 * Q5_K blocks at w. */
AVX2_INLINE void kquant_heads_avx2(strip8 s[KQ_SUBS], const char *w, size_t stride) {
    __m256i g[4]; /* lane r: row r's d and dmin, scales 0..3, 4..7, 8..11 */
    transpose_rows_avx2(g, w, stride);
    const __m256 d = half_lanes_avx2(g[0], 0);
    const __m256 dmin = half_lanes_avx2(g[0], 1);
    const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
    const __m256i top = _mm256_set1_epi32(3);
#pragma GCC unroll 8
    for (int j = 0; j < KQ_SUBS; j++) {
        const int sh = 8 * (j & 3);
        __m256i sc, m;
        if (j < 4) {
            sc = _mm256_and_si256(_mm256_srli_epi32(g[1], sh), six);
            m = _mm256_and_si256(_mm256_srli_epi32(g[2], sh), six);
        } else {
            sc = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(g[3], sh), four),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(g[1], sh + 6), top), 4));
            m = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(g[3], sh + 4), four),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(g[2], sh + 6), top), 4));
        }
        s[j].d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        s[j].m = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)));
        s[j].d2 = _mm256_setzero_ps();
    }
}

/* The pairs of a sub-block whose 32 values are bytes (v[q] lane bytes: values 4q..4q+3, v1's
 * 16 + 4q..), in NS_BYTE_PAIRS' order, less zero_point (Q6_K's 32). */
AVX2_INLINE void kquant_byte_pairs_avx2(__m256i p[16], const __m256i v[4], const __m256i v1[4],
                                        const int zero_point) {
    const __m256i low = _mm256_set1_epi32(0x00FF00FF), zp = _mm256_set1_epi16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        p[2 * q] = _mm256_sub_epi16(_mm256_and_si256(v[q], low), zp);
        p[2 * q + 1] = _mm256_sub_epi16(_mm256_srli_epi16(v[q], 8), zp);
        p[8 + 2 * q] = _mm256_sub_epi16(_mm256_and_si256(v1[q], low), zp);
        p[8 + 2 * q + 1] = _mm256_sub_epi16(_mm256_srli_epi16(v1[q], 8), zp);
    }
}

/* ---------------------------------------------------------------- AVX-512 */

/* Each sub-block j's d sc and -(dmin m) (kquant_sub_scales) into s[j], for 16 rows of Q4_K /
 * Q5_K blocks at w. */
AVX512_INLINE void kquant_heads_avx512(strip16 s[KQ_SUBS], const char *w, size_t stride) {
    __m512i g[4]; /* lane r: row r's d and dmin, scales 0..3, 4..7, 8..11 */
    transpose_rows_avx512(g, w, stride);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g[0]));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g[0], 16)));
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
    const __m512i top = _mm512_set1_epi32(3);
#pragma GCC unroll 8
    for (int j = 0; j < KQ_SUBS; j++) {
        const int sh = 8 * (j & 3);
        __m512i sc, m;
        if (j < 4) {
            sc = _mm512_and_si512(_mm512_srli_epi32(g[1], sh), six);
            m = _mm512_and_si512(_mm512_srli_epi32(g[2], sh), six);
        } else {
            sc = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(g[3], sh), four),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g[1], sh + 6), top), 4));
            m = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(g[3], sh + 4), four),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g[2], sh + 6), top), 4));
        }
        s[j].d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        s[j].m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));
        s[j].d2 = _mm512_setzero_ps();
    }
}

/* As kquant_byte_pairs_avx2, 16 rows. */
AVX512_INLINE void kquant_byte_pairs_avx512(__m512i p[16], const __m512i v[4], const __m512i v1[4],
                                            const int zero_point) {
    const __m512i low = _mm512_set1_epi32(0x00FF00FF), zp = _mm512_set1_epi16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        p[2 * q] = _mm512_sub_epi16(_mm512_and_si512(v[q], low), zp);
        p[2 * q + 1] = _mm512_sub_epi16(_mm512_srli_epi16(v[q], 8), zp);
        p[8 + 2 * q] = _mm512_sub_epi16(_mm512_and_si512(v1[q], low), zp);
        p[8 + 2 * q + 1] = _mm512_sub_epi16(_mm512_srli_epi16(v1[q], 8), zp);
    }
}
#endif

#endif
