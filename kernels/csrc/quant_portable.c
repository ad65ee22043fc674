/* The portable path of the quantized matmul (see quant.h): plain C, one output at a time, blocks
 * in order. It is the reference the SIMD paths are tested against (they add the same exact integer
 * dot products in another order) and what runs on CPUs without AVX2.
 */
#include "quant.h"

ns_xq_layout ns_layout_portable(int qtype, int wide) {
    /* Blocks one at a time, values in order, one lane: the Q4_0 zero point as a correction. */
    return (ns_xq_layout){1, 1, QK, qtype == NS_Q4_0 ? 8 : 0, wide};
}

/* sum_j q_j x_j over a 4-bit block's stored nibbles (0..15), for int8 and int16 x; exact in
 * int32 (|sum| <= 32 x 15 x 32767). */
#define DOT_NIBBLES(name, xtype)                                                                  \
    static int32_t name(const uint8_t *qs, const xtype *x) {                                      \
        int32_t s = 0;                                                                            \
        for (int j = 0; j < QK / 2; j++) s += (qs[j] & 15) * x[j] + (qs[j] >> 4) * x[j + QK / 2]; \
        return s;                                                                                 \
    }
DOT_NIBBLES(dot_nibbles, int8_t)
DOT_NIBBLES(dot_nibbles16, int16_t)

static int32_t dot_int8(const int8_t *qs, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += qs[j] * x[j];
    return s;
}

static int32_t dot_int8_16(const int8_t *qs, const int16_t *x) {
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += qs[j] * x[j];
    return s;
}

/* The exact integer dot of block b of a weight row (its quantized values, as stored) and of row m
 * of the activations, Q4_0's zero point included. */
static int32_t block_dot(const char *blk, const ns_xq *xq, Py_ssize_t m, Py_ssize_t b, int qtype) {
    const Py_ssize_t at = m * xq->q_stride + b * QK;
    const int8_t *q8 = (const int8_t *)blk + 2;
    const uint8_t *qs = (const uint8_t *)blk + (qtype == NS_Q4_1 ? 4 : 2);
    int32_t dot;
    if (xq->wide)
        dot = qtype == NS_Q8_0 ? dot_int8_16(q8, xq->q16 + at) : dot_nibbles16(qs, xq->q16 + at);
    else
        dot = qtype == NS_Q8_0 ? dot_int8(q8, xq->q + at) : dot_nibbles(qs, xq->q + at);
    return qtype == NS_Q4_0 ? dot + xq->corr[m * xq->lane_stride + b] : dot;
}

/* out[m, n] for one row of blocks and row m of the activations. */
static float dot_row(const char *row, const ns_xq *xq, Py_ssize_t m, Py_ssize_t nb, int qtype) {
    const float *dx = xq->dx + m * xq->lane_stride, *sx = xq->sx + m * xq->lane_stride;
    const size_t bb = ns_block_bytes(qtype);
    float acc = 0.0f;
    for (Py_ssize_t b = 0; b < nb; b++) {
        const char *blk = row + (size_t)b * bb;
        acc += (float)block_dot(blk, xq, m, b, qtype) * (ns_f16_at(blk) * dx[b]);
        if (qtype == NS_Q4_1) acc += ns_f16_at(blk + 2) * sx[b];
    }
    return acc;
}

void ns_qmm_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const char *row = a->w + (size_t)n * a->row_bytes;
        for (Py_ssize_t m = 0; m < a->M; m++)
            a->out[m * a->N + n] = dot_row(row, a->x, m, nb, a->qtype);
    }
}
