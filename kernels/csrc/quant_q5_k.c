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

/* One output at a time, sub-blocks in order; each sub-block's dot exact in integers. */
static void q5_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q5_K *row = (const block_q5_K *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb, *sx = xq->sx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++) {
                const block_q5_K *blk = row + b / KQ_SUBS;
                const int j = (int)(b % KQ_SUBS);
                float d, neg_m;
                kquant_sub_scales(&blk->h, j, &d, &neg_m);
                int32_t dot = 0;
                for (int l = 0; l < QK; l++) dot += q5_k_value(blk, j, l) * x[b * QK + l];
                acc += (float)dot * (d * dx[b]);
                acc += neg_m * sx[b];
            }
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
extern ns_matmul_kernel q5_k_matmul_avx2, q5_k_matmul_avx512, q5_k_matmul_avx512_vnni;
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q5_K_FORMAT = {
    .code = 13, /* GGML_TYPE_Q5_K */
    .name = "q5_k",
    .block_bytes = sizeof(block_q5_K),
    .block_values = QK_K,
    .dequantize = q5_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .matmul = {[NS_PORTABLE] = q5_k_matmul_portable,
#if NS_X86
               [NS_AVX2] = q5_k_matmul_avx2,
               [NS_AVX512] = q5_k_matmul_avx512,
               [NS_AVX512_VNNI] = q5_k_matmul_avx512_vnni
#endif
    },
};
