/* Q5_K (block_q5_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 32 bytes of high bits qh,
 * 128 bytes of nibbles qs; 256 values in 8 sub-blocks of 32, value q (d sc) - (dmin m)):
 * de-quantize a block as gguf does, the portable matmul (quant_kquants.h: a sub-block at a time)
 * and the format's row of the table of formats (its SIMD kernels: quant_simd.h). Not quantized
 * here: llama.cpp's quantizer searches the scales. The layout: quant_blocks.h.
 */
#include "quant_kquants.h"

/* Value l of sub-block j. */
static inline int q5_k_value(const block_q5_K *b, int j, int l) {
    return ((b->qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15) | (((b->qh[l] >> j) & 1) << 4);
}

static void q5_k_dequantize(float *x, const void *block) {
    const block_q5_K *b = block;
    for (int j = 0; j < KQ_SUBS; j++) {
        float d, neg_m;
        kquant_sub_scales(&b->h, j, &d, &neg_m);
        for (int l = 0; l < QK; l++)
            x[QK * j + l] = ns_unfused(d * (float)q5_k_value(b, j, l)) + neg_m;
    }
}

/* ---------------------------------------------------------------- portable C */

/* Sub-block b's term: the exact integer dot of its q and x, scaled, and its min's. */
static inline float q5_k_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q5_K *blk = (const block_q5_K *)row + b / KQ_SUBS;
    const int j = (int)(b % KQ_SUBS);
    int32_t s = 0;
    for (int l = 0; l < QK; l++) s += q5_k_value(blk, j, l) * x[l];
    float d, neg_m;
    kquant_sub_scales(&blk->h, j, &d, &neg_m);
    acc += (float)s * (d * dx);
    return acc + neg_m * sx;
}

static void q5_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q5_k_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q5_K_FORMAT = {
    .code = GGML_Q5_K,
    .name = "q5_k",
    .block_bytes = sizeof(block_q5_K),
    .block_values = QK_K,
    .dequantize = q5_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .portable = q5_k_matmul_portable,
    .byte_gemv = 1,
};
