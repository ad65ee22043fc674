/* An experiment, not a kernel of the module: the decode GEMV (M = 1) of Q4_K and Q6_K with the
 * activations as int8 (a scale per 32 values, vpdpbusd: 4 products per int32 lane) instead of the
 * module's int16 pairs (vpdpwssd: 2), in the module's strip scheme (lane r: output row r of a
 * strip of 16), W read either as GGUF rows (each block's 16-byte groups transposed across the 16
 * rows, as the module's unpacking does) or interleaved at load: within each super-block, the 16
 * rows' 4-byte words side by side (word q of rows 0..15 in 64 bytes), so a group is 4 plain loads
 * and W streams in order. Built by int8_gemv.py with -march=native (AVX-512 VNNI needed).
 *
 * xlo (Q4_K, optional): x as 128 xq + xlo, two int8 dots per value for 15-bit activations.
 * x: xq (int8), dx (its scale per 32), sx (dx times the sum of xq per 32, Q4_K's min term) and
 * bsum16 (the sum of xq per 16, Q6_K's offset of 32). PF: super-blocks prefetched ahead.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define INLINE static inline TARGET __attribute__((always_inline))

enum { Q4K_BYTES = 144, Q6K_BYTES = 210, PF = 2 };

/* 16 rows' 16 bytes at src (row r at src + r stride): g[q] lane r = row r's bytes 4q .. 4q + 3. */
INLINE void transpose_rows(__m512i g[4], const char *src, size_t stride) {
    __m512i z[4];
    for (int i = 0; i < 4; i++) {
        const char *p = src + (size_t)(4 * i) * stride;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + stride)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * stride)), 2);
        z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 3);
    }
    const __m512i even = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(2));
    const __m512i a01 = _mm512_permutex2var_epi32(z[0], even, z[1]);
    const __m512i b01 = _mm512_permutex2var_epi32(z[0], odd, z[1]);
    const __m512i a23 = _mm512_permutex2var_epi32(z[2], even, z[3]);
    const __m512i b23 = _mm512_permutex2var_epi32(z[2], odd, z[3]);
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    g[0] = _mm512_permutex2var_epi32(a01, lo, a23);
    g[1] = _mm512_permutex2var_epi32(a01, hi, a23);
    g[2] = _mm512_permutex2var_epi32(b01, lo, b23);
    g[3] = _mm512_permutex2var_epi32(b01, hi, b23);
}

/* The four words from byte `at` of the strip's super-block: blk is the interleaved block (16
 * rows' words side by side) or row 0's block (rows stride apart). */
INLINE void words(__m512i g[4], const char *blk, int at, size_t stride, int inter) {
    if (!inter) {
        transpose_rows(g, blk + at, stride);
        return;
    }
    for (int i = 0; i < 4; i++) g[i] = _mm512_loadu_si512(blk + 16 * at + 64 * i);
}

/* Prefetch a super-block PF ahead: the interleaved layout's next bytes, or the next strip's rows. */
INLINE void prefetch(const char *blk, int bytes, size_t stride, int inter) {
    if (inter) {
        for (int l = 0; l < 16 * bytes / 64; l++) _mm_prefetch(blk + PF * 16 * bytes + 64 * l, _MM_HINT_T0);
        return;
    }
    for (int r = 0; r < 16; r++)
        for (int l = 0; l < bytes; l += 64) _mm_prefetch(blk + (16 + r) * stride + l, _MM_HINT_T0);
}

INLINE __m512i dot4(__m512i acc, __m512i w, const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
}

TARGET void q4k_gemv_int8(float *out, const int8_t *xq, const int8_t *xlo, const float *dx,
                          const float *sx, const char *w, int N, int K, int inter) {
    const int nb = K / 256;
    const size_t stride = (size_t)nb * Q4K_BYTES;
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15),
                  top = _mm512_set1_epi32(3), nib = _mm512_set1_epi8(15);
#pragma omp parallel for schedule(static)
    for (int s = 0; s < N / 16; s++) {
        const char *base = w + (size_t)s * 16 * stride;
        __m512 acc = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const char *blk = base + (size_t)b * Q4K_BYTES * (inter ? 16 : 1);
            if (inter || s + 1 < N / 16) prefetch(blk, Q4K_BYTES, stride, inter);
            __m512i g[4];
            words(g, blk, 0, stride, inter);
            const __m512i dw = g[0];
            const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw));
            const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16)));
            for (int c = 0; c < 4; c++) {
                __m512i q0[4], q1[4];
                words(q0, blk, 16 + 32 * c, stride, inter);
                words(q1, blk, 32 + 32 * c, stride, inter);
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * c + h, sh = 8 * (j & 3);
                    __m512i sc, m;
                    if (j < 4) {
                        sc = _mm512_and_si512(_mm512_srli_epi32(g[1], sh), six);
                        m = _mm512_and_si512(_mm512_srli_epi32(g[2], sh), six);
                    } else {
                        sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(g[3], sh), four),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g[1], sh + 6), top), 4));
                        m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(g[3], sh + 4), four),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g[2], sh + 6), top), 4));
                    }
                    const int8_t *x = xq + 256 * b + 32 * j;
                    __m512i dot = _mm512_setzero_si512();
                    for (int i = 0; i < 4; i++)
                        dot = dot4(dot, _mm512_and_si512(_mm512_srli_epi32(q0[i], 4 * h), nib), x + 4 * i);
                    for (int i = 0; i < 4; i++)
                        dot = dot4(dot, _mm512_and_si512(_mm512_srli_epi32(q1[i], 4 * h), nib), x + 16 + 4 * i);
                    if (xlo) { /* x = 128 hi + lo: the low 7 bits' dot too, exact in int32 */
                        const int8_t *lo = xlo + 256 * b + 32 * j;
                        __m512i dlo = _mm512_setzero_si512();
                        for (int i = 0; i < 4; i++)
                            dlo = dot4(dlo, _mm512_and_si512(_mm512_srli_epi32(q0[i], 4 * h), nib), lo + 4 * i);
                        for (int i = 0; i < 4; i++)
                            dlo = dot4(dlo, _mm512_and_si512(_mm512_srli_epi32(q1[i], 4 * h), nib), lo + 16 + 4 * i);
                        dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 7), dlo);
                    }
                    const int at = 8 * b + j;
                    const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(dx[at])), acc);
                    acc = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)), _mm512_set1_ps(sx[at]), acc);
                }
            }
        }
        _mm512_storeu_ps(out + 16 * s, acc);
    }
}

/* Q6_K: ql[128], qh[64], scales[16] (int8, one per 16 values), d. Values 0..63 less 32: the dot
 * of the unsigned values, less 32 times the 16 activations' sum. The interleaved layout holds the
 * first 208 bytes as words and then the 16 rows' d side by side. */
TARGET void q6k_gemv_int8(float *out, const int8_t *xq, const float *dx, const int32_t *bsum16,
                          const char *w, int N, int K, int inter) {
    const int nb = K / 256;
    const size_t stride = (size_t)nb * Q6K_BYTES;
    const __m512i nib = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3 << 4);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
#pragma omp parallel for schedule(static)
    for (int s = 0; s < N / 16; s++) {
        const char *base = w + (size_t)s * 16 * stride;
        __m512 acc = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const char *blk = base + (size_t)b * Q6K_BYTES * (inter ? 16 : 1);
            if (inter || s + 1 < N / 16) prefetch(blk, Q6K_BYTES, stride, inter);
            const __m512 d = inter
                ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 16 * 208)))
                : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                      _mm512_srli_epi32(_mm512_i32gather_epi32(rows, blk + 206, 1), 16)));
            __m512i sc[4];
            words(sc, blk, 192, stride, inter);
            for (int half = 0; half < 2; half++) {
                __m512i h[4], h1[4];
                words(h, blk, 128 + 32 * half, stride, inter);
                words(h1, blk, 128 + 32 * half + 16, stride, inter);
                for (int k = 0; k < 2; k++) {
                    __m512i g[4], g1[4];
                    words(g, blk, 64 * half + 32 * k, stride, inter);
                    words(g1, blk, 64 * half + 32 * k + 16, stride, inter);
                    for (int u = k; u < 4; u += 2) {
                        const int t = 4 * half + u, shift = 4 * (u >> 1), up = 4 - 2 * u;
                        const int8_t *x = xq + 256 * b + 32 * t;
                        __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
                        for (int i = 0; i < 4; i++) {
                            const __m512i hb = up >= 0 ? _mm512_slli_epi32(h[i], up) : _mm512_srli_epi32(h[i], -up);
                            const __m512i hb1 = up >= 0 ? _mm512_slli_epi32(h1[i], up) : _mm512_srli_epi32(h1[i], -up);
                            const __m512i v = _mm512_ternarylogic_epi32(
                                _mm512_and_si512(_mm512_srli_epi32(g[i], shift), nib), hb, two, 0xF8);
                            const __m512i v1 = _mm512_ternarylogic_epi32(
                                _mm512_and_si512(_mm512_srli_epi32(g1[i], shift), nib), hb1, two, 0xF8);
                            dot0 = dot4(dot0, v, x + 4 * i);
                            dot1 = dot4(dot1, v1, x + 16 + 4 * i);
                        }
                        const int at = (256 * b + 32 * t) / 16;
                        dot0 = _mm512_sub_epi32(dot0, _mm512_set1_epi32(32 * bsum16[at]));
                        dot1 = _mm512_sub_epi32(dot1, _mm512_set1_epi32(32 * bsum16[at + 1]));
                        const int byte = 2 * (t & 1);
                        const __m512i s0 = _mm512_srai_epi32(_mm512_slli_epi32(sc[t / 2], 24 - 8 * byte), 24);
                        const __m512i s1 = _mm512_srai_epi32(_mm512_slli_epi32(sc[t / 2], 16 - 8 * byte), 24);
                        const __m512 dxs = _mm512_mul_ps(d, _mm512_set1_ps(dx[at / 2]));
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(dxs, _mm512_cvtepi32_ps(s0)), acc);
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(dxs, _mm512_cvtepi32_ps(s1)), acc);
                    }
                }
            }
        }
        _mm512_storeu_ps(out + 16 * s, acc);
    }
}
