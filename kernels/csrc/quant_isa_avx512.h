/* The AVX-512 (F, BW and VL) vocabulary of the quantized matmul's SIMD kernels (quant_simd.h), as
 * quant_isa_avx2.h's for AVX2; with NS_VNNI defined (quant_avx512_vnni.c), vpdpwssd takes each
 * dot step in one instruction. A strip is 16 output columns a register.
 */
#ifndef NANOSERVE_QUANT_ISA_H
#define NANOSERVE_QUANT_ISA_H

#include "quant.h"

#include <immintrin.h>

#ifdef NS_VNNI
#define ISA_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define ISA_NAME(name) name##_avx512_vnni
#else
#define ISA_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
/* A kernel's name on this path: q4_0_matmul_avx512 (its format's row points to it). */
#define ISA_NAME(name) name##_avx512
#endif

#define NS_INLINE static inline __attribute__((target(ISA_TARGET), always_inline))
#define NS_KERNEL __attribute__((target(ISA_TARGET)))

typedef __m512i ivec;
typedef __m512 fvec;

/* STRIP_W columns a strip. Tiles of 4 rows by 3 strips take 12 int32 and 12 float accumulators
 * of the 32 registers. The GEMV takes up to 8 rows in one tile of one strip (8 int32 and 8 float
 * accumulators): a batch of 8 decodes unpacks each block once, straight from W, instead of into a
 * panel that two tiles of 4 rows then read from L2 (0.84 ms against 0.72 ms on a Q4_K
 * 8192 x 2048 at M = 8). F16_ROWS: the F16 kernel takes both of W's rows under each load of x
 * (16 accumulators for 4 rows of x), which keeps the FMA units, not the loads, the limit. */
enum { STRIP_W = 16, TILE_MR = 4, TILE_NR = 3, GEMV_ROWS = 8, F16_ROWS = 2 };

NS_INLINE ivec iv_zero(void) { return _mm512_setzero_si512(); }
NS_INLINE ivec iv_set32(int v) { return _mm512_set1_epi32(v); }
NS_INLINE ivec iv_set16(int v) { return _mm512_set1_epi16((short)v); }
NS_INLINE ivec iv_set8(int v) { return _mm512_set1_epi8((char)v); }
NS_INLINE ivec iv_and(ivec a, ivec b) { return _mm512_and_si512(a, b); }
NS_INLINE ivec iv_or(ivec a, ivec b) { return _mm512_or_si512(a, b); }
/* a | (b & c), one ternary-logic step */
NS_INLINE ivec iv_or_and(ivec a, ivec b, ivec c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }
NS_INLINE ivec iv_shl32(ivec v, int s) { return _mm512_slli_epi32(v, s); }
NS_INLINE ivec iv_shr32(ivec v, int s) { return _mm512_srli_epi32(v, s); }
NS_INLINE ivec iv_sar32(ivec v, int s) { return _mm512_srai_epi32(v, s); }
NS_INLINE ivec iv_shl16(ivec v, int s) { return _mm512_slli_epi16(v, s); }
NS_INLINE ivec iv_shr16(ivec v, int s) { return _mm512_srli_epi16(v, s); }
NS_INLINE ivec iv_sar16(ivec v, int s) { return _mm512_srai_epi16(v, s); }
NS_INLINE ivec iv_sub16(ivec a, ivec b) { return _mm512_sub_epi16(a, b); }
NS_INLINE fvec iv_to_fv(ivec v) { return _mm512_cvtepi32_ps(v); }

/* acc plus the int32 sums of the int16 pairs of w times x. */
NS_INLINE ivec dot_pairs(ivec acc, ivec w, ivec x) {
#ifdef NS_VNNI
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

NS_INLINE fvec fv_zero(void) { return _mm512_setzero_ps(); }
NS_INLINE fvec fv_set(float v) { return _mm512_set1_ps(v); }
NS_INLINE fvec fv_add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
NS_INLINE fvec fv_sub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
NS_INLINE fvec fv_mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
/* a b + c, one rounding */
NS_INLINE fvec fv_fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
NS_INLINE fvec fv_load(const float *p) { return _mm512_loadu_ps(p); }

/* The lanes of v added in a fixed order: the halves, then as AVX2 does. */
NS_INLINE float fv_sum(fvec v) {
    const __m256 top = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), top);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* v's first n lanes to out. */
NS_INLINE void store_cols(float *out, int n, fvec v) {
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), v);
}

/* STRIP_W values (f16, or bf16) at p as float32. */
NS_INLINE fvec widen(const char *p, const int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Each of 16 rows' 32 bits at w (row c's at w + c stride): lane c, gathered in one instruction
 * (16 scalar stores read back as a vector would stall on store forwarding at every block). */
NS_INLINE ivec row_words(const char *w, size_t stride) {
    const ivec rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    return _mm512_i32gather_epi32(rows, w, 1);
}

/* The fp16 in the low (hi = 0) or high 16 bits of each lane of v, as floats. */
NS_INLINE fvec half_floats(ivec v, const int hi) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

/* 16 rows' 16 bytes (row r at src + r * stride) as 4 registers g[q] whose lane r is row r's
 * bytes 4q .. 4q + 3. */
NS_INLINE void transpose_rows(ivec g[4], const char *src, size_t stride) {
    ivec z[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const char *p = src + (size_t)(4 * i) * stride;
        ivec v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + stride)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * stride)), 2);
        z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 3);
    }
    /* z[i] element 4 l + q is row 4 i + l's dword q. First rows 0-7 (z0, z1) and 8-15 (z2, z3):
     * dwords 0 and 1 of the eight rows, then 2 and 3; then the two halves of the rows. */
    const ivec even = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const ivec odd = _mm512_add_epi32(even, _mm512_set1_epi32(2));
    const ivec a01 = _mm512_permutex2var_epi32(z[0], even, z[1]);
    const ivec b01 = _mm512_permutex2var_epi32(z[0], odd, z[1]);
    const ivec a23 = _mm512_permutex2var_epi32(z[2], even, z[3]);
    const ivec b23 = _mm512_permutex2var_epi32(z[2], odd, z[3]);
    const ivec lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const ivec hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    g[0] = _mm512_permutex2var_epi32(a01, lo, a23);
    g[1] = _mm512_permutex2var_epi32(a01, hi, a23);
    g[2] = _mm512_permutex2var_epi32(b01, lo, b23);
    g[3] = _mm512_permutex2var_epi32(b01, hi, b23);
}

#endif
