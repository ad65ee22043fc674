/* F16 and BF16 matrices kept in their 16 bits, as rows of the table of formats: "blocks" of 32
 * plain values (64 bytes), so that QuantizedWeight, the loader and the one-call decode step take
 * them as they take the block formats. Unlike those, the activations stay float32 (float_x): a
 * kernel widens the weights to float32 in registers and multiplies x as it is, so the result is
 * the float32 matmul of the widened weights up to the order of the sums.
 *
 * Each out[m, n] is one dot product of row m of x and row n of W, the same operations whatever M,
 * the tile or the thread (bitwise row invariance): per row of x, 32 (AVX-512) or 16 (AVX2) lanes
 * accumulated along K in two registers, added and then reduced in a fixed order (the portable
 * path: 32 lanes, pairwise). Many rows of x pass over a chunk of W's rows that stays in L2
 * (NS_PANEL_BYTES), four rows of x at a time, so W is read from memory once whatever M.
 */
#include "quant_f16.h"

/* As gguf.quants.quantize: numpy's float16 cast, and ggml's bf16 rounding (nearest even, NaN
 * kept quiet), both ns_*'s. */
static void f16_quantize(void *block, const float *x) {
    uint16_t *h = block;
    for (int j = 0; j < QK; j++) h[j] = ns_f32_to_f16(x[j]);
}

static void f16_dequantize(float *x, const void *block) {
    const uint16_t *h = block;
    for (int j = 0; j < QK; j++) x[j] = ns_f16_to_f32(h[j]);
}

static void bf16_quantize(void *block, const float *x) {
    uint16_t *h = block;
    for (int j = 0; j < QK; j++) h[j] = ns_f32_to_bf16(x[j]);
}

static void bf16_dequantize(float *x, const void *block) {
    const uint16_t *h = block;
    for (int j = 0; j < QK; j++) x[j] = ns_bf16_to_f32(h[j]);
}

/* ---------------------------------------------------------------- portable C */

/* 32 lanes along K (lane l: k = l mod 32), then pairwise: the SIMD paths' number of roundings. */
static ALWAYS_INLINE void f16_dots_portable(const ns_qmm *a, Py_ssize_t r0, const int mr,
                                            Py_ssize_t n0, const int nc, const char *row0,
                                            const int bf16) {
    for (int c = 0; c < nc; c++) {
        const uint16_t *h = (const uint16_t *)(row0 + (size_t)c * a->row_bytes);
        for (int m = 0; m < mr; m++) {
            const float *x = a->xf + (r0 + m) * a->K;
            float lane[QK] = {0};
            for (Py_ssize_t k = 0; k < a->K; k++)
                lane[k % QK] += x[k] * (bf16 ? ns_bf16_to_f32(h[k]) : ns_f16_to_f32(h[k]));
            for (int width = QK / 2; width > 0; width /= 2)
                for (int l = 0; l < width; l++) lane[l] += lane[l + width];
            a->out[(r0 + m) * a->ldo + n0 + c] = lane[0];
        }
    }
}

static void f16_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 0, f16_dots_portable);
}

static void bf16_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 1, f16_dots_portable);
}

/* These formats' rows of the table of formats (quant.c), whose SIMD kernels are quant_simd.h's;
 * VNNI has nothing to add to floats. */
const ns_block_format F16_FORMAT = {
    .code = GGML_F16,
    .name = "f16",
    .block_bytes = QK * sizeof(uint16_t),
    .quantize = f16_quantize,
    .dequantize = f16_dequantize,
    .pairs = NULL,
    .portable = f16_matmul_portable,
    .float_x = 1,
};

const ns_block_format BF16_FORMAT = {
    .code = GGML_BF16,
    .name = "bf16",
    .block_bytes = QK * sizeof(uint16_t),
    .quantize = bf16_quantize,
    .dequantize = bf16_dequantize,
    .pairs = NULL,
    .portable = bf16_matmul_portable,
    .float_x = 1,
};
