/* What Q5_0 and Q5_1 share (quant_q5_0.c, quant_q5_1.c): a 5-bit value is its nibble in qs (as
 * Q4_0's) and a fifth bit, bit j of the block's 32-bit qh for value j. The SIMD unpacking takes
 * the nibble pairs as the 4-bit formats do (NS_NIBBLE_PAIRS) and moves each value's bit of qh to
 * bit 4 of its int16: a pair's two values are 2 apart (quant.h), so each takes its own shift.
 */
#ifndef NANOSERVE_QUANT_Q5_H
#define NANOSERVE_QUANT_Q5_H

#include "quant.h"
#include "quant_strips_avx2.h"
#include "quant_strips_avx512.h"

/* Value j (0..31) of a block from its qs and qh, 0..31. */
static inline int q5_value(const uint8_t qs[QK / 2], uint32_t qh, int j) {
    const int nibble = j < QK / 2 ? qs[j] & 15 : qs[j - QK / 2] >> 4;
    return nibble | (int)((qh >> j) & 1u) << 4;
}

/* The 32 values of x as 5-bit q (in 0..31) packed into qs and qh, gguf's layout. */
static inline void q5_pack(uint8_t qs[QK / 2], uint8_t qh[4], const uint8_t q[QK]) {
    uint32_t bits = 0;
    uint8_t low[QK];
    for (int j = 0; j < QK; j++) {
        low[j] = q[j] & 15;
        bits |= (uint32_t)(q[j] >> 4) << j;
    }
    ns_pack_nibbles(qs, low);
    memcpy(qh, &bits, 4); /* little-endian, as gguf's packbits(bitorder="little") */
}

/* The value index of the low int16 of pair p (4 q + i) in NS_NIBBLE_PAIRS; the high one is 2
 * further. */
#define Q5_PAIR_LOW(q, i) (4 * (q) + ((i) & 1) * 16 + ((i) >> 1))

#if NS_X86
/* v shifted left by s bits (right by -s), s a constant after unrolling. */
#define Q5_SHIFT_AVX2(v, s) ((s) >= 0 ? _mm256_slli_epi32(v, (s)) : _mm256_srli_epi32(v, -(s)))
#define Q5_SHIFT_AVX512(v, s) ((s) >= 0 ? _mm512_slli_epi32(v, (s)) : _mm512_srli_epi32(v, -(s)))

/* p[j] of a 5-bit block: nibble pairs (nibble_pairs_avx2 of g) with qh's bits (lane c: row c's
 * qh) at bit 4 of each int16, less zero_point (Q5_0's 16). */
AVX2_INLINE void q5_pairs_avx2(__m256i p[16], const __m256i g[4], __m256i qh,
                               const int zero_point) {
    nibble_pairs_avx2(p, g, 0);
    const __m256i lo = _mm256_set1_epi32(0x10), hi = _mm256_set1_epi32(0x100000);
    const __m256i zp = _mm256_set1_epi16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const int l = Q5_PAIR_LOW(q, i);
            const __m256i b = _mm256_or_si256(_mm256_and_si256(Q5_SHIFT_AVX2(qh, 4 - l), lo),
                                              _mm256_and_si256(Q5_SHIFT_AVX2(qh, 18 - l), hi));
            const __m256i v = _mm256_or_si256(p[4 * q + i], b);
            p[4 * q + i] = zero_point ? _mm256_sub_epi16(v, zp) : v;
        }
}

/* Each of 8 rows' 32 bits at w + offset (row c's at w + c stride + offset): lane c. */
AVX2_INLINE __m256i q5_qh_avx2(const char *w, size_t stride, size_t offset) {
    uint32_t h[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) memcpy(&h[c], w + (size_t)c * stride + offset, 4);
    return _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4], (int)h[5],
                             (int)h[6], (int)h[7]);
}

/* As q5_pairs_avx2, 16 rows; bit 4 set in one ternary-logic step (a | (b & c)). */
AVX512_INLINE void q5_pairs_avx512(__m512i p[16], const __m512i g[4], __m512i qh,
                                   const int zero_point) {
    nibble_pairs_avx512(p, g, 0);
    const __m512i lo = _mm512_set1_epi32(0x10), hi = _mm512_set1_epi32(0x100000);
    const __m512i zp = _mm512_set1_epi16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const int l = Q5_PAIR_LOW(q, i);
            __m512i v = p[4 * q + i];
            v = _mm512_ternarylogic_epi32(v, Q5_SHIFT_AVX512(qh, 4 - l), lo, 0xF8);
            v = _mm512_ternarylogic_epi32(v, Q5_SHIFT_AVX512(qh, 18 - l), hi, 0xF8);
            p[4 * q + i] = zero_point ? _mm512_sub_epi16(v, zp) : v;
        }
}

/* Each of 16 rows' 32 bits at w + offset, gathered: lane c. */
AVX512_INLINE __m512i q5_qh_avx512(const char *w, size_t stride, size_t offset) {
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    return _mm512_i32gather_epi32(rows, w + offset, 1);
}
#endif
#endif
