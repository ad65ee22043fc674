/* Q5_0 (block_q5_0: fp16 d, 32 bits qh of fifth bits, 16 bytes of nibbles; value (q - 16) d):
 * quantize and de-quantize a block as gguf does, the portable matmul (the reference) and the
 * format's row of the table of formats, whose SIMD kernels (quant_simd.h) take the 16 off each
 * value.
 */
#include "quant_q5.h"

#include <math.h>

static uint32_t q5_0_qh(const block_q5_0 *b) {
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    return qh;
}

/* d = -(the value of largest magnitude, the first of equals) / 16, q = trunc(x / d + 16.5) capped
 * at 31 (as Q4_0, a bit more). */
static void q5_0_quantize(void *block, const float *x) {
    block_q5_0 *b = block;
    float amax = fabsf(x[0]), max = x[0];
    for (int j = 1; j < QK; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    const float d = max / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        const int v = (int)(ns_unfused(x[j] * id) + 16.5f);
        q[j] = (uint8_t)(v < 31 ? v : 31);
    }
    b->d = ns_f32_to_f16(d);
    q5_pack(b->qs, b->qh, q);
}

static void q5_0_dequantize(float *x, const void *block) {
    const block_q5_0 *b = block;
    const float d = ns_f16_to_f32(b->d);
    const uint32_t qh = q5_0_qh(b);
    for (int j = 0; j < QK; j++) x[j] = d * (float)(q5_value(b->qs, qh, j) - 16);
}

/* ---------------------------------------------------------------- portable C */

/* Block b's term: the exact integer dot of its values q - 16 and x, scaled. */
static inline float q5_0_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q5_0 *blk = (const block_q5_0 *)row + b;
    const uint32_t qh = q5_0_qh(blk);
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += (q5_value(blk->qs, qh, j) - 16) * x[j];
    (void)sx;
    return acc + (float)s * (ns_f16_to_f32(blk->d) * dx);
}

static void q5_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q5_0_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q5_0_FORMAT = {
    .code = GGML_Q5_0,
    .name = "q5_0",
    .block_bytes = sizeof(block_q5_0),
    .quantize = q5_0_quantize,
    .dequantize = q5_0_dequantize,
    .pairs = NS_NIBBLE_PAIRS,
    .byte_gemv = 1,
    .portable = q5_0_matmul_portable,
};
