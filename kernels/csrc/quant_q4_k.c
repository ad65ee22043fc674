/* Q4_K (block_q4_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; 256
 * values in 8 sub-blocks of 32, value q (d sc) - (dmin m)): de-quantize a block as gguf does, the
 * portable matmul (quant_kquants.h: a sub-block at a time) and the format's row of the table of
 * formats (its SIMD kernels: quant_simd.h). Not quantized here: llama.cpp's quantizer searches the
 * scales, and files come made by it. The layout: quant_blocks.h.
 */
#include "quant_kquants.h"

/* Sub-block j's q: bytes 32 (j / 2) .. of qs, the nibble at `shift`. */
static inline const uint8_t *q4_k_sub(const block_q4_K *b, int j, int *shift) {
    *shift = 4 * (j & 1);
    return b->qs + 32 * (j / 2);
}

static void q4_k_dequantize(float *x, const void *block) {
    const block_q4_K *b = block;
    for (int j = 0; j < KQ_SUBS; j++) {
        float d, neg_m;
        int shift;
        kquant_sub_scales(&b->h, j, &d, &neg_m);
        const uint8_t *q = q4_k_sub(b, j, &shift);
        for (int l = 0; l < QK; l++)
            x[QK * j + l] = ns_unfused(d * (float)((q[l] >> shift) & 15)) + neg_m;
    }
}

/* ---------------------------------------------------------------- portable C */

/* Sub-block b's term: the exact integer dot of its q and x, scaled, and its min's. */
static inline float q4_k_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q4_K *blk = (const block_q4_K *)row + b / KQ_SUBS;
    const int j = (int)(b % KQ_SUBS);
    int shift;
    const uint8_t *q = q4_k_sub(blk, j, &shift);
    int32_t s = 0;
    for (int l = 0; l < QK; l++) s += ((q[l] >> shift) & 15) * x[l];
    float d, neg_m;
    kquant_sub_scales(&blk->h, j, &d, &neg_m);
    acc += (float)s * (d * dx);
    return acc + neg_m * sx;
}

static void q4_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q4_k_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q4_K_FORMAT = {
    .code = GGML_Q4_K,
    .name = "q4_k",
    .block_bytes = sizeof(block_q4_K),
    .block_values = QK_K,
    .dequantize = q4_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .portable = q4_k_matmul_portable,
    .byte_gemv = 1,
};
