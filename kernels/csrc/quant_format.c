/* The GGUF block formats Q8_0, Q4_0 and Q4_1: float32 rows to blocks and back, byte for byte what
 * the gguf package's numpy reference (gguf.quants.quantize and dequantize, the same arithmetic as
 * ggml's quantize_row_*_ref) produces. Every product that numpy rounds before an add is kept apart
 * from the add (ns_unfused), since this file is built with FMA contraction on.
 */
#include "quant.h"

#include <math.h>

static void put_f16(char *p, float f) {
    const uint16_t h = ns_f32_to_f16(f);
    memcpy(p, &h, sizeof h);
}

/* Q8_0: d = max|x| / 127, q = round(x / d), halves away from zero. */
static void quantize_q8_0(char *blk, const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(blk, d);
    for (int j = 0; j < QK; j++) blk[2 + j] = (char)(int8_t)roundf(x[j] * id);
}

/* Byte j of a 4-bit block: value j in the low nibble, value j + 16 in the high one. */
static void pack_nibbles(char *qs, const uint8_t *q) {
    for (int j = 0; j < QK / 2; j++) qs[j] = (char)(q[j] | (q[j + QK / 2] << 4));
}

/* Q4_0: d = -(the value of largest magnitude, the first of equals) / 8, q = trunc(x / d + 8.5)
 * capped at 15. Starting from x[0] keeps the sign of a zero d as numpy gets it. */
static void quantize_q4_0(char *blk, const float *x) {
    float amax = fabsf(x[0]), max = x[0];
    for (int j = 1; j < QK; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        const int v = (int)(ns_unfused(x[j] * id) + 8.5f);
        q[j] = (uint8_t)(v < 15 ? v : 15);
    }
    put_f16(blk, d);
    pack_nibbles(blk + 2, q);
}

/* Q4_1: m = min x, d = (max x - m) / 15, q = trunc((x - m) / d + 0.5) capped at 15. */
static void quantize_q4_1(char *blk, const float *x) {
    float min = x[0], max = x[0];
    for (int j = 1; j < QK; j++) {
        min = x[j] < min ? x[j] : min;
        max = x[j] > max ? x[j] : max;
    }
    const float d = (max - min) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
        const int v = (int)(ns_unfused((x[j] - min) * id) + 0.5f);
        q[j] = (uint8_t)(v < 15 ? v : 15);
    }
    put_f16(blk, d);
    put_f16(blk + 2, min);
    pack_nibbles(blk + 4, q);
}

/* The 32 values of one block. */
static void dequantize_block(float *x, const char *blk, int qtype) {
    const float d = ns_f16_at(blk);
    if (qtype == NS_Q8_0) {
        for (int j = 0; j < QK; j++) x[j] = (float)(int8_t)blk[2 + j] * d;
        return;
    }
    const uint8_t *qs = (const uint8_t *)blk + (qtype == NS_Q4_1 ? 4 : 2);
    const float m = qtype == NS_Q4_1 ? ns_f16_at(blk + 2) : 0.0f;
    for (int j = 0; j < QK / 2; j++) {
        const int lo = qs[j] & 15, hi = qs[j] >> 4;
        if (qtype == NS_Q4_1) {
            x[j] = ns_unfused(d * (float)lo) + m;
            x[j + QK / 2] = ns_unfused(d * (float)hi) + m;
        } else {
            x[j] = d * (float)(lo - 8);
            x[j + QK / 2] = d * (float)(hi - 8);
        }
    }
}

static void quantize_rows(char *out, const float *w, Py_ssize_t N, Py_ssize_t K, int qtype,
                          int num_threads) {
    const Py_ssize_t nb = K / QK;
    const size_t bb = ns_block_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (Py_ssize_t n = 0; n < N; n++)
        for (Py_ssize_t b = 0; b < nb; b++) {
            char *blk = out + ((size_t)n * (size_t)nb + (size_t)b) * bb;
            const float *x = w + n * K + b * QK;
            if (qtype == NS_Q8_0)
                quantize_q8_0(blk, x);
            else if (qtype == NS_Q4_0)
                quantize_q4_0(blk, x);
            else
                quantize_q4_1(blk, x);
        }
}

/* out [R, K] = rows rows[r] of w (or every row, in order, when rows is NULL). */
static void dequantize_rows(float *out, const char *w, const int64_t *rows, Py_ssize_t R,
                            Py_ssize_t K, int qtype, int num_threads) {
    const Py_ssize_t nb = K / QK;
    const size_t bb = ns_block_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (Py_ssize_t r = 0; r < R; r++) {
        const size_t n = rows ? (size_t)rows[r] : (size_t)r;
        for (Py_ssize_t b = 0; b < nb; b++)
            dequantize_block(out + r * K + b * QK, w + (n * (size_t)nb + (size_t)b) * bb, qtype);
    }
}

/* 0, or -1 with a ValueError naming what is wrong (the Python API checked it already). */
static int check_format(const char *fn, Py_ssize_t N, Py_ssize_t K, int qtype, int num_threads) {
    if (!ns_block_bytes(qtype) || N < 0 || K < 0 || K % QK || num_threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: qtype code %d, [N, K] = [%zd, %zd] or num_threads %d "
                     "out of range (K a multiple of 32)", fn, qtype, N, K, num_threads);
        return -1;
    }
    return 0;
}

PyObject *nanoserve_py_quantize(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "w", "N", "K", "qtype", "num_threads", NULL};
    unsigned long long out, w;
    Py_ssize_t N, K;
    int qtype, num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKnnii", kwlist, &out, &w, &N, &K, &qtype,
                                     &num_threads) ||
        check_format("quantize", N, K, qtype, num_threads) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    quantize_rows((char *)(uintptr_t)out, (const float *)(uintptr_t)w, N, K, qtype, num_threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* 0, or -1 with a ValueError when a row index is outside [0, N). */
static int check_row_indices(const int64_t *rows, Py_ssize_t R, Py_ssize_t N) {
    for (Py_ssize_t r = 0; rows && r < R; r++)
        if (rows[r] < 0 || rows[r] >= N) {
            PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is outside [0, %zd)", r,
                         (long long)rows[r], N);
            return -1;
        }
    return 0;
}

PyObject *nanoserve_py_dequantize(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "w", "rows", "num_rows", "N", "K", "qtype", "num_threads",
                             NULL};
    unsigned long long out, w, rows;
    Py_ssize_t R, N, K;
    int qtype, num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKnnnii", kwlist, &out, &w, &rows, &R, &N, &K,
                                     &qtype, &num_threads) ||
        check_format("dequantize", N, K, qtype, num_threads) < 0)
        return NULL;
    const int64_t *idx = (const int64_t *)(uintptr_t)rows;
    if (R < 0 || (!idx && R != N)) {
        PyErr_Format(PyExc_ValueError, "dequantize: num_rows %zd for N = %zd rows", R, N);
        return NULL;
    }
    if (check_row_indices(idx, R, N) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    dequantize_rows((float *)(uintptr_t)out, (const char *)(uintptr_t)w, idx, R, K, qtype,
                    num_threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}
