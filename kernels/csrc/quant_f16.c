/* F16 and BF16 matrices kept in their 16 bits, as rows of the table of formats: "blocks" of 32
 * plain values (64 bytes), so that QuantizedWeight, the loader and the one-call decode step take
 * them as they take the block formats. Unlike those, the activations stay float32 (float_x): a
 * kernel widens the weights to float32 in registers and multiplies x as it is, so the result is
 * the float32 matmul of the widened weights up to the order of the sums.
 *
 * Each out[m, n] is one dot product of row m of x and row n of W, the same operations whatever M,
 * the tile or the thread (bitwise row invariance): per row of x, 32 (AVX-512) or 16 (AVX2) lanes
 * accumulated along K in two registers, added and then reduced in a fixed order (the portable
 * path: 32 lanes, pairwise). Many rows of x pass over a chunk of W's rows that stays in L2
 * (NS_PANEL_BYTES), four rows of x at a time, so W is read from memory once whatever M.
 */
#include "quant.h"
#include "quant_strips_avx2.h"
#include "quant_strips_avx512.h"

/* As gguf.quants.quantize: numpy's float16 cast, and ggml's bf16 rounding (nearest even, NaN
 * kept quiet), both ns_*'s. */
static void f16_quantize(void *block, const float *x) {
    uint16_t *h = block;
    for (int j = 0; j < QK; j++) h[j] = ns_f32_to_f16(x[j]);
}

static void f16_dequantize(float *x, const void *block) {
    const uint16_t *h = block;
    for (int j = 0; j < QK; j++) x[j] = ns_f16_to_f32(h[j]);
}

static void bf16_quantize(void *block, const float *x) {
    uint16_t *h = block;
    for (int j = 0; j < QK; j++) h[j] = ns_f32_to_bf16(x[j]);
}

static void bf16_dequantize(float *x, const void *block) {
    const uint16_t *h = block;
    for (int j = 0; j < QK; j++) x[j] = ns_bf16_to_f32(h[j]);
}

/* out[r0 .. r0 + mr, n .. n + nc] from W's rows n .. n + nc (nc 1 or 2; row is W's row n),
 * bf16 or f16: a path's dot products. */
typedef void (*f16_dots_fn)(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n, int nc,
                            const char *row, int bf16);

/* dots with mr (1..NS_GEMV_ROWS) a constant. */
static ALWAYS_INLINE void f16_dots_nc(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n,
                                      const int nc, const char *row, const int bf16,
                                      const f16_dots_fn dots) {
    switch (mr) {
    case 1: dots(a, r0, 1, n, nc, row, bf16); break;
    case 2: dots(a, r0, 2, n, nc, row, bf16); break;
    case 3: dots(a, r0, 3, n, nc, row, bf16); break;
    default: dots(a, r0, 4, n, nc, row, bf16); break;
    }
}

/* out[:, n0:n1]: chunks of W's rows that fit in L2, under every tile of up to NS_GEMV_ROWS rows of
 * x, two of W's rows at a time. mr, nc and bf16 are constants in dots after inlining. */
static ALWAYS_INLINE void f16_matmul(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                     const int bf16, const f16_dots_fn dots) {
    Py_ssize_t chunk = (Py_ssize_t)(NS_PANEL_BYTES / a->row_bytes);
    chunk = chunk < 1 ? 1 : chunk;
    for (Py_ssize_t c0 = n0; c0 < n1; c0 += chunk) {
        const Py_ssize_t c1 = n1 - c0 < chunk ? n1 : c0 + chunk;
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += NS_GEMV_ROWS) {
            const int mr = a->M - r0 < NS_GEMV_ROWS ? (int)(a->M - r0) : NS_GEMV_ROWS;
            for (Py_ssize_t n = c0; n < c1; n += 2) {
                const char *row = a->w + (size_t)n * a->row_bytes;
                if (c1 - n < 2) {
                    f16_dots_nc(a, r0, mr, n, 1, row, bf16, dots);
                    continue;
                }
                f16_dots_nc(a, r0, mr, n, 2, row, bf16, dots);
            }
        }
    }
}

/* ---------------------------------------------------------------- portable C */

/* 32 lanes along K (lane l: k = l mod 32), then pairwise: the SIMD paths' number of roundings. */
static ALWAYS_INLINE void f16_dots_portable(const ns_qmm *a, Py_ssize_t r0, const int mr,
                                            Py_ssize_t n0, const int nc, const char *row0,
                                            const int bf16) {
    for (int c = 0; c < nc; c++) {
        const uint16_t *h = (const uint16_t *)(row0 + (size_t)c * a->row_bytes);
        for (int m = 0; m < mr; m++) {
            const float *x = a->xf + (r0 + m) * a->K;
            float lane[QK] = {0};
            for (Py_ssize_t k = 0; k < a->K; k++)
                lane[k % QK] += x[k] * (bf16 ? ns_bf16_to_f32(h[k]) : ns_f16_to_f32(h[k]));
            for (int width = QK / 2; width > 0; width /= 2)
                for (int l = 0; l < width; l++) lane[l] += lane[l + width];
            a->out[(r0 + m) * a->ldo + n0 + c] = lane[0];
        }
    }
}

static void f16_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 0, f16_dots_portable);
}

static void bf16_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 1, f16_dots_portable);
}

#if NS_X86
/* ---------------------------------------------------------------- AVX2 */

/* 8 values at p as float32. */
AVX2_INLINE __m256 widen_avx2(const char *p, const int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* The lanes of v added in a fixed order. */
AVX2_INLINE float sum_lanes_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_INLINE void f16_dots_avx2(const ns_qmm *a, Py_ssize_t r0, const int mr, Py_ssize_t n,
                               const char *row, const int bf16) {
    __m256 acc[NS_GEMV_ROWS][2];
#pragma GCC unroll 4
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const float *x = a->xf + r0 * a->K;
    for (Py_ssize_t k = 0; k < a->K; k += 16) {
        const __m256 w0 = widen_avx2(row + 2 * k, bf16), w1 = widen_avx2(row + 2 * k + 16, bf16);
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * a->K + k), w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * a->K + k + 8), w1, acc[m][1]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < mr; m++)
        a->out[(r0 + m) * a->ldo + n] = sum_lanes_avx2(_mm256_add_ps(acc[m][0], acc[m][1]));
}

/* One of W's rows at a time: AVX2's 16 registers hold one row's accumulators. */
AVX2_INLINE void f16_dots2_avx2(const ns_qmm *a, Py_ssize_t r0, const int mr, Py_ssize_t n,
                                const int nc, const char *row, const int bf16) {
    for (int c = 0; c < nc; c++) f16_dots_avx2(a, r0, mr, n + c, row + c * a->row_bytes, bf16);
}

AVX2_KERNEL void f16_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 0, f16_dots2_avx2);
}

AVX2_KERNEL void bf16_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 1, f16_dots2_avx2);
}

/* ---------------------------------------------------------------- AVX-512 */

/* 16 values at p as float32. */
AVX512_INLINE __m512 widen_avx512(const char *p, const int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Both of W's rows under each load of x (16 accumulators for 4 rows of x): one load of x for every
 * two FMAs, which keeps the FMA units, not the loads, the limit. Each output's operations are the
 * same whatever nc. */
AVX512_INLINE void f16_dots_avx512(const ns_qmm *a, Py_ssize_t r0, const int mr, Py_ssize_t n,
                                   const int nc, const char *row, const int bf16) {
    __m512 acc[NS_GEMV_ROWS][2][2];
#pragma GCC unroll 4
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++) acc[m][c][0] = acc[m][c][1] = _mm512_setzero_ps();
    const float *x = a->xf + r0 * a->K;
    for (Py_ssize_t k = 0; k < a->K; k += 32) {
        __m512 w[2][2];
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++) {
            w[c][0] = widen_avx512(row + c * a->row_bytes + 2 * k, bf16);
            w[c][1] = widen_avx512(row + c * a->row_bytes + 2 * k + 32, bf16);
        }
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            const __m512 x0 = _mm512_loadu_ps(x + m * a->K + k);
            const __m512 x1 = _mm512_loadu_ps(x + m * a->K + k + 16);
#pragma GCC unroll 2
            for (int c = 0; c < nc; c++) {
                acc[m][c][0] = _mm512_fmadd_ps(x0, w[c][0], acc[m][c][0]);
                acc[m][c][1] = _mm512_fmadd_ps(x1, w[c][1], acc[m][c][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++) {
            const __m512 v = _mm512_add_ps(acc[m][c][0], acc[m][c][1]);
            const __m256 top = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), top);
            a->out[(r0 + m) * a->ldo + n + c] = sum_lanes_avx2(h);
        }
}

AVX512_KERNEL void f16_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 0, f16_dots_avx512);
}

AVX512_KERNEL void bf16_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 1, f16_dots_avx512);
}
#endif

/* These formats' rows of the table of formats (quant.c); VNNI has nothing to add to floats. */
const ns_block_format F16_FORMAT = {
    .code = 1, /* GGML_TYPE_F16 */
    .name = "f16",
    .block_bytes = QK * sizeof(uint16_t),
    .quantize = f16_quantize,
    .dequantize = f16_dequantize,
    .pairs = NULL,
    .matmul = {[NS_PORTABLE] = f16_matmul_portable,
#if NS_X86
               [NS_AVX2] = f16_matmul_avx2,
               [NS_AVX512] = f16_matmul_avx512,
               [NS_AVX512_VNNI] = f16_matmul_avx512
#endif
    },
    .float_x = 1,
};

const ns_block_format BF16_FORMAT = {
    .code = 30, /* GGML_TYPE_BF16 */
    .name = "bf16",
    .block_bytes = QK * sizeof(uint16_t),
    .quantize = bf16_quantize,
    .dequantize = bf16_dequantize,
    .pairs = NULL,
    .matmul = {[NS_PORTABLE] = bf16_matmul_portable,
#if NS_X86
               [NS_AVX2] = bf16_matmul_avx2,
               [NS_AVX512] = bf16_matmul_avx512,
               [NS_AVX512_VNNI] = bf16_matmul_avx512
#endif
    },
    .float_x = 1,
};
