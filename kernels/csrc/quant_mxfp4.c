/* MXFP4 (block_mxfp4: an E8M0 scale byte e and 16 bytes of 4-bit E2M1 codes; value
 * NS_MXFP4_VALUES[code] 2^(e - 128), the table being E2M1's values doubled): quantize and
 * de-quantize a block as gguf does, the portable matmul (the reference) and the format's row of
 * the table of formats. The doubled values are integers -12..12, so the int16 activations' exact
 * dot holds as for Q4_0: |12 x| <= 393204, 32 of them under 2^24.
 */
#include "quant_blocks.h"

#include <math.h>

/* e = floor(log2 max|x|) - 2 + 127 (0 for an all-zero block), each code the first of the table's
 * values nearest to x / d, as gguf.quants' MXFP4.quantize_blocks. */
static void mxfp4_quantize(void *block, const float *x) {
    block_mxfp4 *b = block;
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    int exp2 = 0;
    if (amax > 0.0f) frexpf(amax, &exp2); /* amax = f 2^exp2, 0.5 <= f < 1 */
    b->e = amax > 0.0f ? (uint8_t)(exp2 - 1 - 2 + 127) : 0;
    const float d = ns_e8m0_half(b->e);
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        int best = 0;
        float err = fabsf(ns_unfused(d * (float)NS_MXFP4_VALUES[0]) - x[j]);
        for (int c = 1; c < 16; c++) {
            const float e = fabsf(ns_unfused(d * (float)NS_MXFP4_VALUES[c]) - x[j]);
            if (e < err) {
                err = e;
                best = c;
            }
        }
        q[j] = (uint8_t)best;
    }
    ns_pack_nibbles(b->qs, q);
}

static void mxfp4_dequantize(float *x, const void *block) {
    const block_mxfp4 *b = block;
    const float d = ns_e8m0_half(b->e);
    for (int j = 0; j < QK / 2; j++) {
        x[j] = d * (float)NS_MXFP4_VALUES[b->qs[j] & 15];
        x[j + QK / 2] = d * (float)NS_MXFP4_VALUES[b->qs[j] >> 4];
    }
}

/* ---------------------------------------------------------------- portable C */

/* Block b's term: the exact integer dot of its doubled values and x, scaled. */
static inline float mxfp4_term(float acc, const char *row, Py_ssize_t b, const int16_t *x,
                               float dx, float sx) {
    const block_mxfp4 *blk = (const block_mxfp4 *)row + b;
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++)
        s += NS_MXFP4_VALUES[blk->qs[j] & 15] * x[j] +
             NS_MXFP4_VALUES[blk->qs[j] >> 4] * x[j + QK / 2];
    (void)sx;
    return acc + (float)s * (ns_e8m0_half(blk->e) * dx);
}

static void mxfp4_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, mxfp4_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format MXFP4_FORMAT = {
    .code = GGML_MXFP4,
    .name = "mxfp4",
    .block_bytes = sizeof(block_mxfp4),
    .quantize = mxfp4_quantize,
    .dequantize = mxfp4_dequantize,
    .pairs = NS_NIBBLE_PAIRS,
    .portable = mxfp4_matmul_portable,
    .byte_gemv = 1,
};
