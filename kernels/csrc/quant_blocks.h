/* The GGUF block formats' structs (ggml's, byte for byte): what a format's file (quant_<name>.c:
 * its reference and its row of the table of formats) and its SIMD unpacking (quant_simd.h) both
 * read. Each struct's comment says how its values are stored; its format's file says the rest.
 */
#ifndef NANOSERVE_QUANT_BLOCKS_H
#define NANOSERVE_QUANT_BLOCKS_H

#include "quant.h"

/* value j = (q_j - 8) d, q_j a nibble of qs */
typedef struct {
    uint16_t d; /* fp16 */
    uint8_t qs[QK / 2];
} block_q4_0;
_Static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_0) <= NS_MAX_BLOCK_BYTES, "GGUF Q4_0");

/* value j = q_j d + m, q_j a nibble of qs */
typedef struct {
    uint16_t d, m; /* fp16 */
    uint8_t qs[QK / 2];
} block_q4_1;
_Static_assert(sizeof(block_q4_1) == 20 && sizeof(block_q4_1) <= NS_MAX_BLOCK_BYTES, "GGUF Q4_1");

/* value j = (q_j - 16) d, q_j = nibble j of qs | bit j of qh << 4 */
typedef struct {
    uint16_t d; /* fp16 */
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_0;
_Static_assert(sizeof(block_q5_0) == 22 && sizeof(block_q5_0) <= NS_MAX_BLOCK_BYTES, "GGUF Q5_0");

/* value j = q_j d + m, q_j = nibble j of qs | bit j of qh << 4 */
typedef struct {
    uint16_t d, m; /* fp16 */
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_1;
_Static_assert(sizeof(block_q5_1) == 24 && sizeof(block_q5_1) <= NS_MAX_BLOCK_BYTES, "GGUF Q5_1");

/* block_q8_0: in nanoserve.h, being the q8_0 KV cache's block too */
_Static_assert((int)NS_Q8_0_VALUES == (int)QK && sizeof(block_q8_0) <= NS_MAX_BLOCK_BYTES,
               "GGUF Q8_0");

/* value j = NS_MXFP4_VALUES[q_j] 2^(e - 128), q_j a nibble of qs (as Q4_0's); e is E8M0 */
typedef struct {
    uint8_t e;
    uint8_t qs[QK / 2];
} block_mxfp4;
_Static_assert(sizeof(block_mxfp4) == 17 && sizeof(block_mxfp4) <= NS_MAX_BLOCK_BYTES,
               "GGUF MXFP4");

/* E2M1's values doubled (ggml's kvalues_mxfp4), by 4-bit code: bit 3 the sign. */
static const int8_t NS_MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128): the E8M0 scale e halved, as the doubled values want (ggml_e8m0_to_fp32_half);
 * e < 2 gives a subnormal. */
static inline float ns_e8m0_half(uint8_t e) {
    return ns_bits_to_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* ---------------------------------------------------------------- K-quants (quant_kquants.h) */

enum { KQ_SUBS = QK_K / QK }; /* 32-value sub-blocks of a super-block */

/* The 16 bytes that start a Q4_K and a Q5_K block. */
typedef struct {
    uint16_t d, dmin; /* fp16 */
    uint8_t scales[12];
} kquant_head;

/* Nibbles: bytes 32c .. 32c + 31 of qs hold sub-block 2c in their low nibbles, 2c + 1 in their
 * high ones. */
typedef struct {
    kquant_head h;
    uint8_t qs[QK_K / 2];
} block_q4_K;
_Static_assert(sizeof(block_q4_K) == 144 && sizeof(block_q4_K) <= NS_MAX_BLOCK_BYTES, "GGUF Q4_K");

/* Sub-block j's value l: the nibble (low for even j, high for odd) of qs[32 (j / 2) + l], plus 16
 * times bit j of qh[l]. */
typedef struct {
    kquant_head h;
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;
_Static_assert(sizeof(block_q5_K) == 176 && sizeof(block_q5_K) <= NS_MAX_BLOCK_BYTES, "GGUF Q5_K");

/* Value l of 32-value sub-block t (half h = t / 4 of the block, u = t % 4): the nibble (low for
 * u < 2, high else) of ql[64 h + 32 (u & 1) + l], bits 2u, 2u + 1 of qh[32 h + l] above it; its
 * scale scales[2t + l / 16]. */
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d; /* fp16 */
} block_q6_K;
_Static_assert(sizeof(block_q6_K) == 210 && sizeof(block_q6_K) <= NS_MAX_BLOCK_BYTES, "GGUF Q6_K");

/* A format's term of out[m, n] for block b of row n (a K-quant's 32-value sub-block b): acc plus
 * the block's scaled dot with x, the block's 32 activations, whose scale is dx and sum sx. */
typedef float ns_block_term(float acc, const char *row, Py_ssize_t b, const int16_t *x, float dx,
                            float sx);

/* The portable kernels (the reference): one output at a time, the terms of its blocks in order. */
static inline __attribute__((always_inline)) void
ns_portable_matmul(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1, ns_block_term *term) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const char *row = a->w + (size_t)n * a->row_bytes;
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb, *sx = xq->sx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++) acc = term(acc, row, b, x + b * QK, dx[b], sx[b]);
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#endif
