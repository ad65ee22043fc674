/* The AVX2 (with FMA and F16C) vocabulary of the quantized matmul's SIMD kernels (quant_simd.h):
 * the vector types and width, the instructions the kernels name, the transposes and the constants
 * that differ from AVX-512's. With quant_isa_avx512.h, the one place that names a vector intrinsic.
 * A strip is 8 output columns a register; without VNNI, vpmaddwd + vpaddd take the dot steps.
 */
#ifndef NANOSERVE_QUANT_ISA_H
#define NANOSERVE_QUANT_ISA_H

#include "quant.h"

#include <immintrin.h>

#define ISA_TARGET "avx2,fma,f16c"
/* A kernel's name on this path: q4_0_matmul_avx2 (its format's row points to it). */
#define ISA_NAME(name) name##_avx2

#define NS_INLINE static inline __attribute__((target(ISA_TARGET), always_inline))
#define NS_KERNEL __attribute__((target(ISA_TARGET)))

typedef __m256i ivec;
typedef __m256 fvec;

/* STRIP_W columns a strip. 16 registers: tiles of 3 rows by 2 strips take 6 int32 and 6 float
 * accumulators, 2 weights and a broadcast; the GEMV takes NS_GEMV_ROWS rows. F16_ROWS: the F16
 * kernel's rows of W under each load of x (one: a row's accumulators fill the registers). */
enum { STRIP_W = 8, TILE_MR = 3, TILE_NR = 2, GEMV_ROWS = NS_GEMV_ROWS, F16_ROWS = 1 };

NS_INLINE ivec iv_zero(void) { return _mm256_setzero_si256(); }
NS_INLINE ivec iv_set32(int v) { return _mm256_set1_epi32(v); }
NS_INLINE ivec iv_set16(int v) { return _mm256_set1_epi16((short)v); }
NS_INLINE ivec iv_set8(int v) { return _mm256_set1_epi8((char)v); }
NS_INLINE ivec iv_and(ivec a, ivec b) { return _mm256_and_si256(a, b); }
NS_INLINE ivec iv_or(ivec a, ivec b) { return _mm256_or_si256(a, b); }
/* a | (b & c) */
NS_INLINE ivec iv_or_and(ivec a, ivec b, ivec c) { return iv_or(a, iv_and(b, c)); }
NS_INLINE ivec iv_shl32(ivec v, int s) { return _mm256_slli_epi32(v, s); }
NS_INLINE ivec iv_shr32(ivec v, int s) { return _mm256_srli_epi32(v, s); }
NS_INLINE ivec iv_sar32(ivec v, int s) { return _mm256_srai_epi32(v, s); }
NS_INLINE ivec iv_shl16(ivec v, int s) { return _mm256_slli_epi16(v, s); }
NS_INLINE ivec iv_shr16(ivec v, int s) { return _mm256_srli_epi16(v, s); }
NS_INLINE ivec iv_sar16(ivec v, int s) { return _mm256_srai_epi16(v, s); }
NS_INLINE ivec iv_sub16(ivec a, ivec b) { return _mm256_sub_epi16(a, b); }
NS_INLINE fvec iv_to_fv(ivec v) { return _mm256_cvtepi32_ps(v); }

/* acc plus the int32 sums of the int16 pairs of w times x. */
NS_INLINE ivec dot_pairs(ivec acc, ivec w, ivec x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}

NS_INLINE fvec fv_zero(void) { return _mm256_setzero_ps(); }
NS_INLINE fvec fv_set(float v) { return _mm256_set1_ps(v); }
NS_INLINE fvec fv_add(fvec a, fvec b) { return _mm256_add_ps(a, b); }
NS_INLINE fvec fv_sub(fvec a, fvec b) { return _mm256_sub_ps(a, b); }
NS_INLINE fvec fv_mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
/* a b + c, one rounding */
NS_INLINE fvec fv_fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
NS_INLINE fvec fv_load(const float *p) { return _mm256_loadu_ps(p); }

/* The lanes of v added in a fixed order. */
NS_INLINE float fv_sum(fvec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* v's first n lanes to out. */
NS_INLINE void store_cols(float *out, int n, fvec v) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
}

/* STRIP_W values (f16, or bf16) at p as float32. */
NS_INLINE fvec widen(const char *p, const int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Each of 8 rows' 32 bits at w (row c's at w + c stride): lane c, assembled in registers. */
NS_INLINE ivec row_words(const char *w, size_t stride) {
    uint32_t h[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) memcpy(&h[c], w + (size_t)c * stride, 4);
    return _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4], (int)h[5],
                             (int)h[6], (int)h[7]);
}

/* The fp16 in the low (hi = 0) or high 16 bits of each lane of v, as floats: packus of values
 * under 2^16 keeps them, per 128-bit half, so the halves are put together. */
NS_INLINE fvec half_floats(ivec v, const int hi) {
    const ivec h = hi ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    const ivec packed = _mm256_packus_epi32(h, _mm256_setzero_si256());
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

/* 8 rows' 16 bytes (row r at src + r * stride) as g[q], lane r row r's bytes 4q..4q+3: rows r
 * and r + 4 in the halves of one register, then a 4 x 4 transpose of dwords within each half. */
NS_INLINE void transpose_rows(ivec g[4], const char *src, size_t stride) {
    ivec y[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        y[i] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(src + (size_t)i * stride))),
            _mm_loadu_si128((const __m128i *)(src + (size_t)(i + 4) * stride)), 1);
    const ivec t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
    const ivec t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
    g[0] = _mm256_unpacklo_epi64(t0, t2);
    g[1] = _mm256_unpackhi_epi64(t0, t2);
    g[2] = _mm256_unpacklo_epi64(t1, t3);
    g[3] = _mm256_unpackhi_epi64(t1, t3);
}

#endif
