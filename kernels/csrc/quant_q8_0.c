/* Q8_0 (block_q8_0: fp16 d, 32 int8 q; value q d): quantize and de-quantize a block as gguf does,
 * the portable matmul (the reference) and the format's row of the table of formats (its SIMD
 * kernels: quant_simd.h).
 */
#include "quant_blocks.h"

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
extern ns_matmul_kernel q8_0_matmul_avx2, q8_0_matmul_avx512, q8_0_matmul_avx512_vnni;
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
