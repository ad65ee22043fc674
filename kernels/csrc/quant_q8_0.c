/* Q8_0 (block_q8_0: fp16 d, 32 int8 q; value q d): quantize and de-quantize a block as gguf does,
 * the portable matmul (the reference) and the format's row of the table of formats (its SIMD
 * kernels: quant_simd.h).
 */
#include "quant_blocks.h"

#include <math.h>

/* d = max|x| / 127, q = round(x / d), halves away from zero: the KV cache's quantizer. */
static void q8_0_quantize(void *block, const float *x) { ns_q8_0_quantize(block, x, QK); }

static void q8_0_dequantize(float *x, const void *block) { ns_q8_0_load(x, block, QK); }

/* ---------------------------------------------------------------- portable C */

/* Block b's term: the exact integer dot of its q and x, scaled. */
static inline float q8_0_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx, float sx) {
    const block_q8_0 *blk = (const block_q8_0 *)row + b;
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += blk->qs[j] * x[j];
    (void)sx;
    return acc + (float)s * (ns_f16_to_f32(blk->d) * dx);
}

static void q8_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    ns_portable_matmul(a, n0, n1, q8_0_term);
}

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q8_0_FORMAT = {
    .code = GGML_Q8_0,
    .name = "q8_0",
    .block_bytes = sizeof(block_q8_0),
    .quantize = q8_0_quantize,
    .dequantize = q8_0_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .portable = q8_0_matmul_portable,
    .byte_gemv = 1,
};
