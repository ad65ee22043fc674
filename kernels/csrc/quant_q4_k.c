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

/* The exact integer dot of sub-block j's q and 32 activations in order. */
static int32_t q4_k_dot(const block_q4_K *b, int j, const int16_t *x) {
    int shift;
    const uint8_t *q = q4_k_sub(b, j, &shift);
    int32_t s = 0;
    for (int l = 0; l < QK; l++) s += ((q[l] >> shift) & 15) * x[l];
    return s;
}

/* One output at a time, sub-blocks in order. */
static void q4_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q4_K *row = (const block_q4_K *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb, *sx = xq->sx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++) {
                const block_q4_K *blk = row + b / KQ_SUBS;
                const int j = (int)(b % KQ_SUBS);
                float d, neg_m;
                kquant_sub_scales(&blk->h, j, &d, &neg_m);
                acc += (float)q4_k_dot(blk, j, x + b * QK) * (d * dx[b]);
                acc += neg_m * sx[b];
            }
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
extern ns_matmul_kernel q4_k_matmul_avx2, q4_k_matmul_avx512, q4_k_matmul_avx512_vnni;
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q4_K_FORMAT = {
    .code = 12, /* GGML_TYPE_Q4_K */
    .name = "q4_k",
    .block_bytes = sizeof(block_q4_K),
    .block_values = QK_K,
    .dequantize = q4_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .matmul = {[NS_PORTABLE] = q4_k_matmul_portable,
#if NS_X86
               [NS_AVX2] = q4_k_matmul_avx2,
               [NS_AVX512] = q4_k_matmul_avx512,
               [NS_AVX512_VNNI] = q4_k_matmul_avx512_vnni
#endif
    },
};
