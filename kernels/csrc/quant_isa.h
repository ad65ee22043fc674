/* The vocabulary of the quantized matmul's SIMD kernels (quant_strips.h, quant_simd.h) for the
 * instruction set the including file picks: AVX-512 (F, BW and VL) where it defines NS_AVX512,
 * with vpdpwssd where it also defines NS_VNNI (and AMX-INT8 where NS_AMX), else AVX2 (with FMA
 * and F16C). The vector types and width, the instructions the kernels name (each line:
 * AVX-512's, then AVX2's), the transposes and the constants that differ. The one place that
 * names a vector intrinsic, but for the AMX GEMM's own (quant_amx.h).
 */
#ifndef NANOSERVE_QUANT_ISA_H
#define NANOSERVE_QUANT_ISA_H

#include "quant.h"

#include <immintrin.h>

#if defined(NS_AVX512) && defined(NS_VNNI) && defined(NS_AMX)
#define ISA_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8"
#elif defined(NS_AVX512) && defined(NS_VNNI)
#define ISA_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#elif defined(NS_AVX512)
#define ISA_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#else
#define ISA_TARGET "avx2,fma,f16c"
#endif

#ifdef NS_AVX512
#define ISA(avx512, avx2) avx512
#else
#define ISA(avx512, avx2) avx2
#endif

#define NS_INLINE static inline __attribute__((target(ISA_TARGET), always_inline))
#define NS_KERNEL __attribute__((target(ISA_TARGET)))

typedef ISA(__m512i, __m256i) ivec;
typedef ISA(__m512, __m256) fvec;

/* A strip: STRIP_W output columns, an int32 lane each. Tiles of TILE_MR rows of x by TILE_NR
 * strips: AVX-512's 4 x 3 take 12 int32 and 12 float accumulators of its 32 registers, AVX2's
 * 3 x 2 6 and 6 of its 16, with 2 weights and a broadcast. AVX-512's GEMV takes up to 8 rows in
 * one tile of one strip (8 and 8 accumulators): a batch of 8 decodes unpacks each block once,
 * straight from W, instead of into a panel that two tiles of 4 rows then read from L2 (0.84 ms
 * against 0.72 ms on a Q4_K 8192 x 2048 at M = 8). F16_ROWS: W's rows the F16 kernel takes under
 * each load of x; AVX-512's two (16 accumulators for 4 rows of x) keep the FMA units, not the
 * loads, the limit, while one row's accumulators fill AVX2's registers. */
enum {
    STRIP_W = ISA(16, 8),
    TILE_MR = ISA(4, 3),
    TILE_NR = ISA(3, 2),
    GEMV_ROWS = ISA(8, NS_GEMV_ROWS),
    F16_ROWS = ISA(2, 1),
};

NS_INLINE ivec iv_zero(void) { return ISA(_mm512_setzero_si512, _mm256_setzero_si256)(); }
NS_INLINE ivec iv_set32(int v) { return ISA(_mm512_set1_epi32, _mm256_set1_epi32)(v); }
NS_INLINE ivec iv_set16(int v) { return ISA(_mm512_set1_epi16, _mm256_set1_epi16)((short)v); }
NS_INLINE ivec iv_set8(int v) { return ISA(_mm512_set1_epi8, _mm256_set1_epi8)((char)v); }
NS_INLINE ivec iv_and(ivec a, ivec b) { return ISA(_mm512_and_si512, _mm256_and_si256)(a, b); }
NS_INLINE ivec iv_or(ivec a, ivec b) { return ISA(_mm512_or_si512, _mm256_or_si256)(a, b); }
NS_INLINE ivec iv_xor(ivec a, ivec b) { return ISA(_mm512_xor_si512, _mm256_xor_si256)(a, b); }
NS_INLINE ivec iv_add32(ivec a, ivec b) { return ISA(_mm512_add_epi32, _mm256_add_epi32)(a, b); }
NS_INLINE ivec iv_shl32(ivec v, int s) { return ISA(_mm512_slli_epi32, _mm256_slli_epi32)(v, s); }
NS_INLINE ivec iv_shr32(ivec v, int s) { return ISA(_mm512_srli_epi32, _mm256_srli_epi32)(v, s); }
NS_INLINE ivec iv_sar32(ivec v, int s) { return ISA(_mm512_srai_epi32, _mm256_srai_epi32)(v, s); }
NS_INLINE ivec iv_shl16(ivec v, int s) { return ISA(_mm512_slli_epi16, _mm256_slli_epi16)(v, s); }
NS_INLINE ivec iv_shr16(ivec v, int s) { return ISA(_mm512_srli_epi16, _mm256_srli_epi16)(v, s); }
NS_INLINE ivec iv_sar16(ivec v, int s) { return ISA(_mm512_srai_epi16, _mm256_srai_epi16)(v, s); }
NS_INLINE ivec iv_sub16(ivec a, ivec b) { return ISA(_mm512_sub_epi16, _mm256_sub_epi16)(a, b); }
NS_INLINE fvec iv_to_fv(ivec v) { return ISA(_mm512_cvtepi32_ps, _mm256_cvtepi32_ps)(v); }
NS_INLINE fvec iv_as_fv(ivec v) { return ISA(_mm512_castsi512_ps, _mm256_castsi256_ps)(v); }
NS_INLINE ivec iv_max32(ivec a, ivec b) { return ISA(_mm512_max_epi32, _mm256_max_epi32)(a, b); }
/* The 16 bytes at t in every 128-bit lane: a table for iv_lookup8. */
NS_INLINE ivec iv_table16(const void *t) {
    return ISA(_mm512_broadcast_i32x4, _mm256_broadcastsi128_si256)(_mm_loadu_si128(t));
}
/* The STRIP_W bytes at p, each zero-extended into its int32 lane. */
NS_INLINE ivec iv_bytes32(const char *p) {
    return ISA(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)),
               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* Each byte of v (0..15) looked up in table (iv_table16's). */
NS_INLINE ivec iv_lookup8(ivec table, ivec v) {
    return ISA(_mm512_shuffle_epi8, _mm256_shuffle_epi8)(table, v);
}
/* v with bits or'ed into each byte whose byte of x has a bit of mask's (a test, then one masked
 * add: bits are clear in v where it is used). */
NS_INLINE ivec iv_or_where(ivec v, ivec x, ivec mask, ivec bits) {
#ifdef NS_AVX512
    return _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(x, mask), v, bits);
#else
    const ivec masked = _mm256_and_si256(x, mask);
    return iv_or(v, _mm256_andnot_si256(_mm256_cmpeq_epi8(masked, iv_zero()), bits));
#endif
}
NS_INLINE fvec fv_zero(void) { return ISA(_mm512_setzero_ps, _mm256_setzero_ps)(); }
NS_INLINE fvec fv_set(float v) { return ISA(_mm512_set1_ps, _mm256_set1_ps)(v); }
NS_INLINE fvec fv_add(fvec a, fvec b) { return ISA(_mm512_add_ps, _mm256_add_ps)(a, b); }
NS_INLINE fvec fv_sub(fvec a, fvec b) { return ISA(_mm512_sub_ps, _mm256_sub_ps)(a, b); }
NS_INLINE fvec fv_mul(fvec a, fvec b) { return ISA(_mm512_mul_ps, _mm256_mul_ps)(a, b); }
NS_INLINE fvec fv_load(const float *p) { return ISA(_mm512_loadu_ps, _mm256_loadu_ps)(p); }
NS_INLINE ivec iv_loadu(const char *p) {
    return ISA(_mm512_loadu_si512, _mm256_loadu_si256)((const void *)p);
}
NS_INLINE void fv_store(float *p, fvec v) { ISA(_mm512_storeu_ps, _mm256_storeu_ps)(p, v); }
NS_INLINE fvec fv_max(fvec a, fvec b) { return ISA(_mm512_max_ps, _mm256_max_ps)(a, b); }
NS_INLINE fvec fv_min(fvec a, fvec b) { return ISA(_mm512_min_ps, _mm256_min_ps)(a, b); }
/* v (integral values) as int32 lanes */
NS_INLINE ivec fv_to_iv(fvec v) { return ISA(_mm512_cvtps_epi32, _mm256_cvtps_epi32)(v); }
/* a b + c, one rounding */
NS_INLINE fvec fv_fma(fvec a, fvec b, fvec c) {
    return ISA(_mm512_fmadd_ps, _mm256_fmadd_ps)(a, b, c);
}

/* a | (b & c): one ternary-logic step on AVX-512 */
NS_INLINE ivec iv_or_and(ivec a, ivec b, ivec c) {
    return ISA(_mm512_ternarylogic_epi32(a, b, c, 0xF8), iv_or(a, iv_and(b, c)));
}

/* acc plus the int32 sums of the int16 pairs of w times x. */
NS_INLINE ivec dot_pairs(ivec acc, ivec w, ivec x) {
#ifdef NS_VNNI
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return ISA(_mm512_add_epi32(acc, _mm512_madd_epi16(w, x)),
               _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)));
#endif
}

#ifdef NS_VNNI
/* acc plus the dots of 4 bytes of W (lanes, unsigned) with 4 activations at x (signed,
 * broadcast). */
NS_INLINE ivec dot_w_x(ivec acc, ivec w, const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
}

/* acc plus the dots of 4 activations at x (unsigned, broadcast) with 4 bytes of W (lanes,
 * signed). */
NS_INLINE ivec dot_x_w(ivec acc, ivec w, const uint8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(v), w);
}

NS_INLINE ivec iv_sub32(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
#endif

/* STRIP_W values (f16, or bf16) at p as float32. */
NS_INLINE fvec widen(const char *p, const int bf16) {
    const ISA(__m256i, __m128i) h = ISA(_mm256_loadu_si256, _mm_loadu_si128)((const void *)p);
    if (bf16) return ISA(_mm512_castsi512_ps, _mm256_castsi256_ps)(
                  iv_shl32(ISA(_mm512_cvtepu16_epi32, _mm256_cvtepu16_epi32)(h), 16));
    return ISA(_mm512_cvtph_ps, _mm256_cvtph_ps)(h);
}

/* The lanes of v folded in a fixed order (AVX-512: its halves first): added, or their max
 * where max. */
NS_INLINE float fv_fold(fvec v, const int max) {
#ifdef NS_AVX512
    const __m256 top = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 low = _mm512_castps512_ps256(v);
    const __m256 h = max ? _mm256_max_ps(low, top) : _mm256_add_ps(low, top);
#else
    const __m256 h = v;
#endif
    const __m128 a = _mm256_castps256_ps128(h), b = _mm256_extractf128_ps(h, 1);
    __m128 s = max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
    s = max ? _mm_max_ps(s, _mm_movehl_ps(s, s)) : _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = max ? _mm_max_ss(s, _mm_movehdup_ps(s)) : _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

NS_INLINE float fv_sum(fvec v) { return fv_fold(v, 0); }
NS_INLINE float fv_hmax(fvec v) { return fv_fold(v, 1); }

/* v where x >= lo, else 0 (x NaN: v) */
NS_INLINE fvec fv_zero_below(fvec x, fvec lo, fvec v) {
#ifdef NS_AVX512
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), v, _mm512_setzero_ps());
#else
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), v);
#endif
}

/* Lane i: the sum of v[i]'s lanes, for STRIP_W vectors at once (a transpose and add, in a fixed
 * order): pairs of vectors, then pairs of pairs, within 128-bit lanes, then across them. */
NS_INLINE fvec fv_sums(const fvec v[STRIP_W]) {
    fvec u[STRIP_W / 2], w[STRIP_W / 4];
#pragma GCC unroll 8
    for (int i = 0; i < STRIP_W / 2; i++)
        u[i] = fv_add(ISA(_mm512_unpacklo_ps, _mm256_unpacklo_ps)(v[2 * i], v[2 * i + 1]),
                      ISA(_mm512_unpackhi_ps, _mm256_unpackhi_ps)(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < STRIP_W / 4; i++) {
#ifdef NS_AVX512
        const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = fv_add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                      _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
#else
        const __m256d a = _mm256_castps_pd(u[2 * i]), b = _mm256_castps_pd(u[2 * i + 1]);
        w[i] = fv_add(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                      _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
#endif
    }
    /* w[i]'s 128-bit lane k: the sums over lane k of v[4 i] .. v[4 i + 3] */
#ifdef NS_AVX512
    const fvec z01 = fv_add(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                            _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    const fvec z23 = fv_add(_mm512_shuffle_f32x4(w[2], w[3], 0x88),
                            _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return fv_add(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
#else
    return fv_add(_mm256_permute2f128_ps(w[0], w[1], 0x20),
                  _mm256_permute2f128_ps(w[0], w[1], 0x31));
#endif
}

#ifdef NS_AVX512
/* v's first n lanes to out. */
NS_INLINE void store_cols(float *out, int n, fvec v) {
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), v);
}

/* out's first n floats, zeros after them (none read). */
NS_INLINE fvec load_cols(const float *out, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), out);
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
#else
/* v's first n lanes to out. */
NS_INLINE void store_cols(float *out, int n, fvec v) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
}

/* out's first n floats, zeros after them (none read). */
NS_INLINE fvec load_cols(const float *out, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
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

#endif
