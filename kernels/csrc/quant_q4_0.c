/* Q4_0 (block_q4_0: fp16 d, 16 bytes of nibbles q; value (q - 8) d): quantize and de-quantize a
 * block as gguf does, the portable matmul (the reference) and the format's row of the table of
 * formats, whose SIMD kernels (quant_simd.h) take the 8 off each value as they widen it.
 */
#include "quant_blocks.h"

#include <math.h>

/* d = -(the value of largest magnitude, the first of equals) / 8, q = trunc(x / d + 8.5) capped at
 * 15. Starting from x[0] keeps the sign of a zero d as numpy gets it. */
static void q4_0_quantize(void *block, const float *x) {
    block_q4_0 *b = block;
    float amax = fabsf(x[0]), max = x[0];
    for (int j = 1; j < QK; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        const int v = (int)(ns_unfused(x[j] * id) + 8.5f);
        q[j] = (uint8_t)(v < 15 ? v : 15);
    }
    b->d = ns_f32_to_f16(d);
    ns_pack_nibbles(b->qs, q);
}

static void q4_0_dequantize(float *x, const void *block) {
    const block_q4_0 *b = block;
    const float d = ns_f16_to_f32(b->d);
    for (int j = 0; j < QK / 2; j++) {
        x[j] = d * (float)((b->qs[j] & 15) - 8);
        x[j + QK / 2] = d * (float)((b->qs[j] >> 4) - 8);
    }
}

/* ---------------------------------------------------------------- portable C */

/* The exact integer dot of a block's values q - 8 and 32 activations in order. */
static int32_t q4_0_dot(const block_q4_0 *b, const int16_t *x) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++)
        s += ((b->qs[j] & 15) - 8) * x[j] + ((b->qs[j] >> 4) - 8) * x[j + QK / 2];
    return s;
}

/* One output at a time, blocks in order. */
static void q4_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q4_0 *row = (const block_q4_0 *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++)
                acc += (float)q4_0_dot(row + b, x + b * QK) * (ns_f16_to_f32(row[b].d) * dx[b]);
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
extern ns_matmul_kernel q4_0_matmul_avx2, q4_0_matmul_avx512, q4_0_matmul_avx512_vnni;
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q4_0_FORMAT = {
    .code = 2, /* GGML_TYPE_Q4_0 */
    .name = "q4_0",
    .block_bytes = sizeof(block_q4_0),
    .quantize = q4_0_quantize,
    .dequantize = q4_0_dequantize,
    .pairs = NS_NIBBLE_PAIRS,
    .matmul = {[NS_PORTABLE] = q4_0_matmul_portable,
#if NS_X86
               [NS_AVX2] = q4_0_matmul_avx2,
               [NS_AVX512] = q4_0_matmul_avx512,
               [NS_AVX512_VNNI] = q4_0_matmul_avx512_vnni
#endif
    },
};
