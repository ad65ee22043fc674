/* RMSNorm, in-place rotary embedding and the gated MLP's f(gate) * up for the CPU forward pass,
 * float32 or bfloat16 tensors.
 *
 * In torch each is six or more small ops (pow, mean, rsqrt, mul, ...; slice, neg, cat, mul, add),
 * which at decode batch sizes costs far more in dispatch than in arithmetic; here each is one
 * call. Math is in float32 with fixed summation orders, so results do not depend on the number of
 * rows or threads; bf16 values are rounded (to nearest even) where torch's ops would round them, so
 * the two agree but for the order of RMSNorm's sum of squares.
 */
#include "nanoserve.h"

/* No fused multiply-adds here (setup.py turns contraction on for the other files): a*c - b*s is
 * then rounded exactly as torch's mul, mul, add round it, and float32 RoPE matches torch's bits. */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum { NORM_LANES = 16, PARALLEL_ROWS = 16 };

/* out[r] = w * dtype(x[r] / sqrt(mean(x[r]^2) + eps)), as the reference Llama computes it. */
static ALWAYS_INLINE void rms_norm_rows(void *out, const void *x, const void *w, Py_ssize_t rows,
                                        Py_ssize_t hidden, float eps, int dtype, int threads) {
#pragma omp parallel for num_threads(rows >= PARALLEL_ROWS ? threads : 1) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++) {
        const Py_ssize_t base = r * hidden;
        float lanes[NORM_LANES] = {0};
        Py_ssize_t i = 0;
        for (; i + NORM_LANES <= hidden; i += NORM_LANES)
            for (int l = 0; l < NORM_LANES; l++) {
                const float v = ns_load(x, base + i + l, dtype);
                lanes[l] += v * v;
            }
        for (int l = 0; i + l < hidden; l++) {
            const float v = ns_load(x, base + i + l, dtype);
            lanes[l] += v * v;
        }
        for (int width = NORM_LANES / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
        const float inv = 1.0f / sqrtf(lanes[0] / (float)hidden + eps);
        for (Py_ssize_t j = 0; j < hidden; j++) {
            const float normed = ns_round(ns_load(x, base + j, dtype) * inv, dtype);
            ns_store(out, base + j, ns_load(w, j, dtype) * normed, dtype);
        }
    }
}

/* One head's rotation: lo, hi its two halves (half values each), c and s its position's cos and
 * sin rows (head_dim values). Distinct restrict pointers, so that the loop vectorises. */
static ALWAYS_INLINE void rope_head(void *restrict lo, void *restrict hi, const void *restrict c,
                                    const void *restrict s, Py_ssize_t half, int dtype) {
#pragma omp simd
    for (Py_ssize_t i = 0; i < half; i++) {
        const float a = ns_load(lo, i, dtype), b = ns_load(hi, i, dtype);
        const float c1 = ns_load(c, i, dtype), s1 = ns_load(s, i, dtype);
        const float c2 = ns_load(c, half + i, dtype), s2 = ns_load(s, half + i, dtype);
        /* rounded after each product, as torch's mul, mul, add are */
        const float ac = ns_round(a * c1, dtype), bs = ns_round(-b * s1, dtype);
        const float bc = ns_round(b * c2, dtype), as = ns_round(a * s2, dtype);
        ns_store(lo, i, ac + bs, dtype);
        ns_store(hi, i, bc + as, dtype);
    }
}

/* For each row t and each of `heads` heads of head_dim values starting at row t * row_stride:
 * x <- x * cos[pos[t]] + rotate_half(x) * sin[pos[t]], rotate_half(x) = (-x2, x1). */
static ALWAYS_INLINE void rope_rows(void *qk, const int64_t *positions, const void *cos,
                                    const void *sin, Py_ssize_t rows, Py_ssize_t heads,
                                    Py_ssize_t head_dim, Py_ssize_t row_stride, int dtype,
                                    int threads) {
    const Py_ssize_t half = head_dim / 2;
    const size_t size = dtype == NS_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(rows >= PARALLEL_ROWS ? threads : 1) schedule(static)
    for (Py_ssize_t t = 0; t < rows; t++) {
        const size_t table = (size_t)(positions[t] * head_dim) * size;
        for (Py_ssize_t h = 0; h < heads; h++) {
            char *x = (char *)qk + (size_t)(t * row_stride + h * head_dim) * size;
            rope_head(x, x + (size_t)half * size, (const char *)cos + table,
                      (const char *)sin + table, half, dtype);
        }
    }
}

void nanoserve_rms_norm_rows(void *out, const void *x, const void *w, Py_ssize_t rows,
                             Py_ssize_t hidden, float eps, int dtype, int num_threads) {
    /* a constant dtype in each call, so each loop is specialised */
    if (dtype == NS_BF16)
        rms_norm_rows(out, x, w, rows, hidden, eps, NS_BF16, num_threads);
    else
        rms_norm_rows(out, x, w, rows, hidden, eps, NS_F32, num_threads);
}

/* silu(g) = g sigmoid(g), the sigmoid from e = exp(-|g|) (ns_exp_nonpos, which vectorises; a
 * call of libm's expf per value bounded the gated MLP at 0.3-0.4 G values/s on two cores): 1 / (1
 * + e) for g >= 0, e / (1 + e) below. Within a few ulp of torch's F.silu. */
static inline float ns_silu(float g) {
    const float e = ns_exp_nonpos(-fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/* Row r's act[i] = silu(gate[i]) * up[i], rounded like torch's F.silu(gate) * up: typed rows, so
 * that the loop vectorises. */
static ALWAYS_INLINE void silu_row(void *act, const void *gate_up, Py_ssize_t r, Py_ssize_t inter,
                                   int dtype) {
    if (dtype == NS_BF16) {
        const uint16_t *restrict g = (const uint16_t *)gate_up + r * 2 * inter;
        const uint16_t *restrict u = g + inter;
        uint16_t *restrict a = (uint16_t *)act + r * inter;
#pragma omp simd
        for (Py_ssize_t i = 0; i < inter; i++) {
            const float f = ns_round(ns_silu(ns_bf16_to_f32(g[i])), NS_BF16);
            a[i] = ns_f32_to_bf16(f * ns_bf16_to_f32(u[i]));
        }
    } else {
        const float *restrict g = (const float *)gate_up + r * 2 * inter;
        const float *restrict u = g + inter;
        float *restrict a = (float *)act + r * inter;
#pragma omp simd
        for (Py_ssize_t i = 0; i < inter; i++) a[i] = ns_silu(g[i]) * u[i];
    }
}

/* act[r, i] = f(gate[r, i]) * up[r, i] of gate_up rows [gate | up], f SwiGLU's silu (ns_silu) or
 * Gemma's GELU-tanh (libm's tanhf), rounded like torch's F.silu(gate) * up or F.gelu(gate,
 * approximate="tanh") * up, whose vectorised exp and tanh differ from these in the last bits for
 * some inputs: the one-call decode step and the layer-by-layer path both come here, so a row's
 * result does not depend on which path its step took. */
static ALWAYS_INLINE void gated_rows(void *act, const void *gate_up, Py_ssize_t rows,
                                     Py_ssize_t inter, int dtype, int gelu, int threads) {
    const float beta = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for num_threads(rows >= PARALLEL_ROWS ? threads : 1) schedule(static)
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (!gelu) {
            silu_row(act, gate_up, r, inter, dtype);
            continue;
        }
        for (Py_ssize_t i = 0; i < inter; i++) {
            const float g = ns_load(gate_up, r * 2 * inter + i, dtype);
            const float up = ns_load(gate_up, r * 2 * inter + inter + i, dtype);
            const float f = 0.5f * g * (1.0f + tanhf(beta * (g + 0.044715f * g * g * g)));
            ns_store(act, r * inter + i, ns_round(f, dtype) * up, dtype);
        }
    }
}

void nanoserve_gated_rows(void *act, const void *gate_up, Py_ssize_t rows, Py_ssize_t inter,
                          int dtype, int gelu, int num_threads) {
    /* constant dtype and activation in each call, so each loop is specialised (and silu's
     * vectorised) */
    if (gelu)
        gated_rows(act, gate_up, rows, inter, dtype == NS_BF16 ? NS_BF16 : NS_F32, 1, num_threads);
    else if (dtype == NS_BF16)
        gated_rows(act, gate_up, rows, inter, NS_BF16, 0, num_threads);
    else
        gated_rows(act, gate_up, rows, inter, NS_F32, 0, num_threads);
}

void nanoserve_rope_rows(void *qk, const int64_t *positions, const void *cos, const void *sin,
                         Py_ssize_t rows, Py_ssize_t heads, Py_ssize_t head_dim,
                         Py_ssize_t row_stride, int dtype, int num_threads) {
    if (dtype == NS_BF16)
        rope_rows(qk, positions, cos, sin, rows, heads, head_dim, row_stride, NS_BF16,
                  num_threads);
    else
        rope_rows(qk, positions, cos, sin, rows, heads, head_dim, row_stride, NS_F32,
                  num_threads);
}

int nanoserve_check_positions(const int64_t *positions, Py_ssize_t n, Py_ssize_t table_rows) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) {
            PyErr_Format(PyExc_ValueError, "positions[%zd] = %lld is outside [0, %zd)", t,
                         (long long)positions[t], table_rows);
            return -1;
        }
    return 0;
}

PyObject *nanoserve_py_check_positions(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"positions", "num_positions", "table_rows", NULL};
    unsigned long long positions;
    Py_ssize_t n, table_rows;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Knn", kwlist, &positions, &n, &table_rows) ||
        nanoserve_check_positions((const int64_t *)(uintptr_t)positions, n, table_rows) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_rms_norm(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "x", "w", "rows", "hidden", "eps", "dtype_code", "num_threads",
                             NULL};
    unsigned long long out, x, w;
    Py_ssize_t rows, hidden;
    float eps;
    int dtype, threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKnnfii", kwlist, &out, &x, &w, &rows, &hidden,
                                     &eps, &dtype, &threads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    nanoserve_rms_norm_rows((void *)(uintptr_t)out, (const void *)(uintptr_t)x,
                            (const void *)(uintptr_t)w, rows, hidden, eps, dtype, threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_gated(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"act", "gate_up", "rows", "inter", "dtype_code", "gelu", "num_threads",
                             NULL};
    unsigned long long act, gate_up;
    Py_ssize_t rows, inter;
    int dtype, gelu, threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKnnipi", kwlist, &act, &gate_up, &rows,
                                     &inter, &dtype, &gelu, &threads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    nanoserve_gated_rows((void *)(uintptr_t)act, (const void *)(uintptr_t)gate_up, rows, inter,
                         dtype, gelu, threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_rope(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"qk", "positions", "cos", "sin", "rows", "heads", "head_dim",
                             "row_stride", "table_rows", "dtype_code", "num_threads", NULL};
    unsigned long long qk, positions, cos, sin;
    Py_ssize_t rows, heads, head_dim, row_stride, table_rows;
    int dtype, threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKnnnnnii", kwlist, &qk, &positions, &cos,
                                     &sin, &rows, &heads, &head_dim, &row_stride, &table_rows,
                                     &dtype, &threads))
        return NULL;
    const int64_t *pos = (const int64_t *)(uintptr_t)positions;
    if (nanoserve_check_positions(pos, rows, table_rows) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    nanoserve_rope_rows((void *)(uintptr_t)qk, pos, (const void *)(uintptr_t)cos,
                        (const void *)(uintptr_t)sin, rows, heads, head_dim, row_stride, dtype,
                        threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}
