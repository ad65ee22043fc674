/* The portable path of the quantized matmul (see quant.h): plain C, one output at a time, blocks
 * in order. It is the reference the SIMD paths are tested against (they add the same exact integer
 * dot products in another order) and what runs on CPUs without AVX2.
 */
#include "quant.h"

ns_xq_layout ns_layout_portable(int qtype) {
    /* Blocks one at a time, values in order, one lane: the Q4_0 zero point as a correction. */
    return (ns_xq_layout){1, 1, 0, qtype == NS_Q4_0 ? 8 : 0};
}

/* sum_j q_j x_j over a 4-bit block's stored nibbles (0..15). */
static int32_t dot_nibbles(const uint8_t *qs, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++) s += (qs[j] & 15) * x[j] + (qs[j] >> 4) * x[j + QK / 2];
    return s;
}

static int32_t dot_int8(const int8_t *qs, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < QK; j++) s += qs[j] * x[j];
    return s;
}

/* out[m, n] for one row of blocks and row m of the activations. */
static float dot_row(const char *row, const ns_xq *xq, Py_ssize_t m, Py_ssize_t nb, int qtype) {
    const int8_t *x = xq->q + m * xq->q_stride;
    const float *dx = xq->dx + m * xq->lane_stride, *sx = xq->sx + m * xq->lane_stride;
    const int32_t *corr = xq->corr + m * xq->lane_stride;
    const size_t bb = ns_block_bytes(qtype);
    float acc = 0.0f;
    for (Py_ssize_t b = 0; b < nb; b++) {
        const char *blk = row + (size_t)b * bb;
        const float d = ns_f16_at(blk);
        if (qtype == NS_Q8_0) {
            acc += (float)dot_int8((const int8_t *)blk + 2, x + b * QK) * (d * dx[b]);
        } else if (qtype == NS_Q4_0) {
            const int32_t dot = dot_nibbles((const uint8_t *)blk + 2, x + b * QK) + corr[b];
            acc += (float)dot * (d * dx[b]);
        } else {
            acc += (float)dot_nibbles((const uint8_t *)blk + 4, x + b * QK) * (d * dx[b]);
            acc += ns_f16_at(blk + 2) * sx[b];
        }
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
