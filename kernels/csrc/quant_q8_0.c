/* Q8_0 (block_q8_0: fp16 d, 32 int8 q; value q d): quantize and de-quantize a block as gguf does,
 * and the matmul's kernels, one per path: portable C (the reference), AVX2, AVX-512 and AVX-512
 * with VNNI. The SIMD kernels are quant_strips_*.h's drivers with this format's unpacking.
 */
#include "quant.h"
#include "quant_strips_avx2.h"
#include "quant_strips_avx512.h"

/* value j = qs[j] d */
typedef struct {
    uint16_t d; /* fp16 */
    int8_t qs[QK];
} block_q8_0;
_Static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q8_0) <= NS_MAX_BLOCK_BYTES, "GGUF Q8_0");

#include <math.h>

/* d = max|x| / 127, q = round(x / d), halves away from zero. */
static void q8_0_quantize(void *block, const float *x) {
    block_q8_0 *b = block;
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    b->d = ns_f32_to_f16(d);
    for (int j = 0; j < QK; j++) b->qs[j] = (int8_t)roundf(x[j] * id);
}

static void q8_0_dequantize(float *x, const void *block) {
    const block_q8_0 *b = block;
    const float d = ns_f16_to_f32(b->d);
    for (int j = 0; j < QK; j++) x[j] = (float)b->qs[j] * d;
}

/* ---------------------------------------------------------------- portable C */

/* The exact integer dot of a block and 32 activations in order. */
static int32_t q8_0_dot(const block_q8_0 *b, const int16_t *x) {
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += b->qs[j] * x[j];
    return s;
}

/* One output at a time, blocks in order. */
static void q8_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q8_0 *row = (const block_q8_0 *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++)
                acc += (float)q8_0_dot(row + b, x + b * QK) * (ns_f16_to_f32(row[b].d) * dx[b]);
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
/* ---------------------------------------------------------------- AVX2 */

/* The blocks at w of 8 rows: lane bytes b0..b3 (values 4q..4q+3 of a half) as the pairs
 * (b0, b2) and (b1, b3), sign-extended (NS_BYTE_PAIRS). */
AVX2_INLINE void q8_0_unpack_avx2(strip8 *s, const char *w, size_t stride) {
    const block_q8_0 *b = (const block_q8_0 *)w;
    strip_heads_avx2(&s->d, &s->m, w, stride, 0);
    __m256i g[4], g1[4];
    transpose_rows_avx2(g, (const char *)b->qs, stride);
    transpose_rows_avx2(g1, (const char *)b->qs + 16, stride);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        s->p[2 * q] = _mm256_srai_epi16(_mm256_slli_epi16(g[q], 8), 8);
        s->p[2 * q + 1] = _mm256_srai_epi16(g[q], 8);
        s->p[8 + 2 * q] = _mm256_srai_epi16(_mm256_slli_epi16(g1[q], 8), 8);
        s->p[8 + 2 * q + 1] = _mm256_srai_epi16(g1[q], 8);
    }
}

static const strip8_format Q8_0_AVX2 = {q8_0_unpack_avx2, sizeof(block_q8_0), 0};

AVX2_KERNEL void q8_0_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx2(a, n0, n1, Q8_0_AVX2);
}

/* ---------------------------------------------------------------- AVX-512 */

/* The blocks at w of 16 rows, as q8_0_unpack_avx2. */
AVX512_INLINE void q8_0_unpack_avx512(strip16 *s, const char *w, size_t stride) {
    const block_q8_0 *b = (const block_q8_0 *)w;
    strip_heads_avx512(&s->d, &s->m, w, stride, 0);
    __m512i g[4], g1[4];
    transpose_rows_avx512(g, (const char *)b->qs, stride);
    transpose_rows_avx512(g1, (const char *)b->qs + 16, stride);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        s->p[2 * q] = _mm512_srai_epi16(_mm512_slli_epi16(g[q], 8), 8);
        s->p[2 * q + 1] = _mm512_srai_epi16(g[q], 8);
        s->p[8 + 2 * q] = _mm512_srai_epi16(_mm512_slli_epi16(g1[q], 8), 8);
        s->p[8 + 2 * q + 1] = _mm512_srai_epi16(g1[q], 8);
    }
}

static const strip16_format Q8_0_AVX512 = {q8_0_unpack_avx512, sizeof(block_q8_0), 0};

AVX512_KERNEL void q8_0_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q8_0_AVX512, 0);
}

AVX512_KERNEL void q8_0_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0,
                                           Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q8_0_AVX512, 1);
}
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q8_0_FORMAT = {
    .code = 8, /* GGML_TYPE_Q8_0 */
    .name = "q8_0",
    .block_bytes = sizeof(block_q8_0),
    .quantize = q8_0_quantize,
    .dequantize = q8_0_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .matmul = {[NS_PORTABLE] = q8_0_matmul_portable,
#if NS_X86
               [NS_AVX2] = q8_0_matmul_avx2,
               [NS_AVX512] = q8_0_matmul_avx512,
               [NS_AVX512_VNNI] = q8_0_matmul_avx512_vnni
#endif
    },
};
