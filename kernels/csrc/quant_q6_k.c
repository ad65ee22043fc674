/* Q6_K (block_q6_K: 128 bytes of low nibbles ql, 64 bytes of 2-bit highs qh, 16 int8 scales, fp16
 * d; 256 values in 16 sub-blocks of 16, value (q - 32) (d sc)): de-quantize a block as gguf does,
 * the portable matmul (quant_kquants.h: a 32-value sub-block at a time, its two halves' dots
 * scaled on their own) and the format's row of the table of formats (its SIMD kernels:
 * quant_simd.h). Not quantized here: llama.cpp's quantizer searches the scales. The layout:
 * quant_blocks.h. The int32 dots cannot overflow: |q - 32| <= 32.
 */
#include "quant_kquants.h"

/* Sub-block t's ql bytes (their nibble at *shift) and qh bytes (their 2 bits at *hshift). */
static inline const uint8_t *q6_k_sub(const block_q6_K *b, int t, int *shift, const uint8_t **qh,
                                      int *hshift) {
    const int h = t / 4, u = t % 4;
    *shift = 4 * (u >> 1);
    *qh = b->qh + 32 * h;
    *hshift = 2 * u;
    return b->ql + 64 * h + 32 * (u & 1);
}

/* Sub-block t's 32 values q - 32. */
static void q6_k_values(int v[QK], const block_q6_K *b, int t) {
    int shift, hshift;
    const uint8_t *qh;
    const uint8_t *ql = q6_k_sub(b, t, &shift, &qh, &hshift);
    for (int l = 0; l < QK; l++)
        v[l] = (((ql[l] >> shift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
}

static void q6_k_dequantize(float *x, const void *block) {
    const block_q6_K *b = block;
    const float d = ns_f16_to_f32(b->d);
    for (int t = 0; t < KQ_SUBS; t++) {
        int v[QK];
        q6_k_values(v, b, t);
        for (int l = 0; l < QK; l++)
            x[QK * t + l] = (d * (float)b->scales[2 * t + l / 16]) * (float)v[l];
    }
}

/* ---------------------------------------------------------------- portable C */

/* 32-value sub-block b's term: each 16-value half's exact integer dot with x, scaled. */
static inline float q6_k_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q6_K *blk = (const block_q6_K *)row + b / KQ_SUBS;
    const int t = (int)(b % KQ_SUBS);
    const float d = ns_f16_to_f32(blk->d);
    int v[QK];
    q6_k_values(v, blk, t);
    for (int half = 0; half < 2; half++) {
        int32_t s = 0;
        for (int l = 16 * half; l < 16 * half + 16; l++) s += v[l] * x[l];
        acc += (float)s * ((d * (float)blk->scales[2 * t + half]) * dx);
    }
    (void)sx;
    return acc;
}

static void q6_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q6_k_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q6_K_FORMAT = {
    .code = GGML_Q6_K,
    .name = "q6_k",
    .block_bytes = sizeof(block_q6_K),
    .block_values = QK_K,
    .dequantize = q6_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .portable = q6_k_matmul_portable,
    .byte_gemv = 1,
};
