/* Q5_1 (block_q5_1: fp16 d, fp16 m, 32 bits qh of fifth bits, 16 bytes of nibbles; value q d + m):
 * quantize and de-quantize a block as gguf does, the portable matmul (the reference) and the
 * format's row of the table of formats (its SIMD kernels: quant_simd.h). The min's share of a
 * block's dot is m dx sum(q): m times the activations' sx, as Q4_1's.
 */
#include "quant_q5.h"

static uint32_t q5_1_qh(const block_q5_1 *b) {
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    return qh;
}

/* m = min x, d = (max x - m) / 31, q = trunc((x - m) / d + 0.5) capped at 31. */
static void q5_1_quantize(void *block, const float *x) {
    block_q5_1 *b = block;
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; j++) {
        min = x[j] < min ? x[j] : min;
        max = x[j] > max ? x[j] : max;
    }
    const float d = (max - min) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        const int v = (int)(ns_unfused((x[j] - min) * id) + 0.5f);
        q[j] = (uint8_t)(v < 31 ? v : 31);
    }
    b->d = ns_f32_to_f16(d);
    b->m = ns_f32_to_f16(min);
    q5_pack(b->qs, b->qh, q);
}

static void q5_1_dequantize(float *x, const void *block) {
    const block_q5_1 *b = block;
    const float d = ns_f16_to_f32(b->d), m = ns_f16_to_f32(b->m);
    const uint32_t qh = q5_1_qh(b);
    for (int j = 0; j < QK; j++) x[j] = ns_unfused(d * (float)q5_value(b->qs, qh, j)) + m;
}

/* ---------------------------------------------------------------- portable C */

/* Block b's term: the exact integer dot of its q and x, scaled, and its min's. */
static inline float q5_1_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q5_1 *blk = (const block_q5_1 *)row + b;
    const uint32_t qh = q5_1_qh(blk);
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += q5_value(blk->qs, qh, j) * x[j];
    acc += (float)s * (ns_f16_to_f32(blk->d) * dx);
    return acc + ns_f16_to_f32(blk->m) * sx;
}

static void q5_1_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q5_1_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q5_1_FORMAT = {
    .code = GGML_Q5_1,
    .name = "q5_1",
    .block_bytes = sizeof(block_q5_1),
    .quantize = q5_1_quantize,
    .dequantize = q5_1_dequantize,
    .pairs = NS_NIBBLE_PAIRS,
    .byte_gemv = 1,
    .portable = q5_1_matmul_portable,
};
