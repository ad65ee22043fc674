/* Q4_1 (block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles q; value q d + m): quantize and
 * de-quantize a block as gguf does, the portable matmul (the reference) and the format's row of
 * the table of formats (its SIMD kernels: quant_simd.h). The min's share of a block's dot is
 * m dx sum(q): m times the activations' sx.
 */
#include "quant_blocks.h"

/* m = min x, d = (max x - m) / 15, q = trunc((x - m) / d + 0.5) capped at 15. */
static void q4_1_quantize(void *block, const float *x) {
    block_q4_1 *b = block;
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; j++) {
        min = x[j] < min ? x[j] : min;
        max = x[j] > max ? x[j] : max;
    }
    const float d = (max - min) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        const int v = (int)(ns_unfused((x[j] - min) * id) + 0.5f);
        q[j] = (uint8_t)(v < 15 ? v : 15);
    }
    b->d = ns_f32_to_f16(d);
    b->m = ns_f32_to_f16(min);
    ns_pack_nibbles(b->qs, q);
}

static void q4_1_dequantize(float *x, const void *block) {
    const block_q4_1 *b = block;
    const float d = ns_f16_to_f32(b->d), m = ns_f16_to_f32(b->m);
    for (int j = 0; j < QK / 2; j++) {
        x[j] = ns_unfused(d * (float)(b->qs[j] & 15)) + m;
        x[j + QK / 2] = ns_unfused(d * (float)(b->qs[j] >> 4)) + m;
    }
}

/* ---------------------------------------------------------------- portable C */

/* Block b's term: the exact integer dot of its q and x, scaled, and its min's. */
static inline float q4_1_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q4_1 *blk = (const block_q4_1 *)row + b;
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++)
        s += (blk->qs[j] & 15) * x[j] + (blk->qs[j] >> 4) * x[j + QK / 2];
    acc += (float)s * (ns_f16_to_f32(blk->d) * dx);
    return acc + ns_f16_to_f32(blk->m) * sx;
}

static void q4_1_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q4_1_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q4_1_FORMAT = {
    .code = GGML_Q4_1,
    .name = "q4_1",
    .block_bytes = sizeof(block_q4_1),
    .quantize = q4_1_quantize,
    .dequantize = q4_1_dequantize,
    .pairs = NS_NIBBLE_PAIRS,
    .portable = q4_1_matmul_portable,
};
