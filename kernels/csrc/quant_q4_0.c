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

/* Block b's term: the exact integer dot of its values q - 8 and x, scaled. */
static inline float q4_0_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q4_0 *blk = (const block_q4_0 *)row + b;
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++)
        s += ((blk->qs[j] & 15) - 8) * x[j] + ((blk->qs[j] >> 4) - 8) * x[j + QK / 2];
    (void)sx;
    return acc + (float)s * (ns_f16_to_f32(blk->d) * dx);
}

static void q4_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q4_0_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q4_0_FORMAT = {
    .code = GGML_Q4_0,
    .name = "q4_0",
    .block_bytes = sizeof(block_q4_0),
    .quantize = q4_0_quantize,
    .dequantize = q4_0_dequantize,
    .pairs = NS_NIBBLE_PAIRS,
    .portable = q4_0_matmul_portable,
};
