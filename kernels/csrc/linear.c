/* out[m, n] = sum_k x[m, k] * w[n, k] for a few input rows (M <= 4): the batch-1 decode GEMV.
 *
 * A GEMV reads every weight once and does two flops per weight read, so it runs at memory speed;
 * what matters is keeping enough loads in flight. Each thread takes a contiguous range of output
 * rows n (OpenMP static schedule) and walks R rows of w side by side, so R independent streams and
 * 2 * M * R vector accumulators are live; the next R rows are prefetched while these are read.
 *
 * Deterministic and batch invariant: each out[m, n] is one dot product over k with a fixed order
 * (16 lanes accumulated along k, the k % 16 tail added to lanes 0.., then the lanes combined
 * pairwise), whatever M, R, the row's place in a block or the number of threads. Float32
 * accumulation; a bf16 x is widened once, bf16 w as it is read, a bf16 out rounded to nearest even.
 * GCC vector extensions (no intrinsics): a 32-byte vector is one AVX register, or two SSE ones.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LIN_F32 = 0, LIN_BF16 = 1 };
enum { MAX_M = 4, MAX_R = 4, LANES = 16 };
#ifndef PF_AHEAD
#define PF_AHEAD 2 /* blocks ahead; 1-4 measure the same within noise */
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#define ALWAYS_INLINE __attribute__((always_inline)) inline

static ALWAYS_INLINE float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static ALWAYS_INLINE uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* 8 elements of w from element i of row, as float32 (unaligned loads through memcpy). */
static ALWAYS_INLINE v8f load8(const char *row, Py_ssize_t i, const int dtype) {
    v8f f;
    if (dtype == LIN_BF16) {
        v8h h;
        memcpy(&h, row + 2 * i, sizeof h);
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, row + 4 * i, sizeof f);
    }
    return f;
}

static ALWAYS_INLINE float elem1(const char *row, Py_ssize_t i, const int dtype) {
    if (dtype == LIN_BF16) return bf16_f32(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

/* out[m, n0 + r] for m < M, r < R: x float32 [M, K], w rows n0.. of dtype. pf: the rows to
 * prefetch (the next block), or NULL. M, R and dtype are constants after inlining. */
static ALWAYS_INLINE void rows_block(const float *restrict x, const char *restrict w,
                                     void *restrict out, Py_ssize_t n0, Py_ssize_t N, Py_ssize_t K,
                                     const char *pf, const int M, const int R, const int dtype) {
    const size_t es = dtype == LIN_BF16 ? 2 : 4;
    const size_t row_bytes = (size_t)K * es;
    const char *rows[MAX_R];
    for (int r = 0; r < R; r++) rows[r] = w + (size_t)(n0 + r) * row_bytes;
    v8f acc[MAX_M][MAX_R][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[m][r][0] = acc[m][r][1] = (v8f){0};
    Py_ssize_t i = 0;
    for (; i + LANES <= K; i += LANES) {
        if (pf && (dtype == LIN_F32 || (i & 31) == 0)) { /* one prefetch per 64-byte line */
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * row_bytes + i * es, 0, 0);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const v8f w0 = load8(rows[r], i, dtype), w1 = load8(rows[r], i + 8, dtype);
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                v8f x0, x1;
                memcpy(&x0, x + m * K + i, sizeof x0);
                memcpy(&x1, x + m * K + i + 8, sizeof x1);
                acc[m][r][0] += x0 * w0;
                acc[m][r][1] += x1 * w1;
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            float part[LANES];
            memcpy(part, &acc[m][r][0], sizeof acc[m][r][0]);
            memcpy(part + 8, &acc[m][r][1], sizeof acc[m][r][1]);
            for (int l = 0; i + l < K; l++) part[l] += x[m * K + i + l] * elem1(rows[r], i + l, dtype);
            for (int l = 0; l < 8; l++) part[l] += part[l + 8];
            for (int l = 0; l < 4; l++) part[l] += part[l + 4];
            const float s = (part[0] + part[2]) + (part[1] + part[3]);
            const size_t o = (size_t)m * (size_t)N + (size_t)(n0 + r);
            if (dtype == LIN_BF16)
                ((uint16_t *)out)[o] = f32_bf16(s);
            else
                ((float *)out)[o] = s;
        }
}

typedef struct {
    const float *x; /* float32 [M, K] */
    const char *w;
    void *out;
    Py_ssize_t M, N, K;
} lin_args;

/* Rows [n_begin, n_end) in blocks of R, the remainder one row at a time. */
static ALWAYS_INLINE void rows_range(const lin_args *a, Py_ssize_t n_begin, Py_ssize_t n_end,
                                     const int M, const int R, const int dtype) {
    const size_t row_bytes = (size_t)a->K * (dtype == LIN_BF16 ? 2 : 4);
    Py_ssize_t n = n_begin;
    for (; n + R <= n_end; n += R) {
        const char *pf = n + (PF_AHEAD + 1) * R <= n_end ? a->w + (size_t)(n + PF_AHEAD * R) * row_bytes : NULL;
        rows_block(a->x, a->w, a->out, n, a->N, a->K, pf, M, R, dtype);
    }
    for (; n < n_end; n++) rows_block(a->x, a->w, a->out, n, a->N, a->K, NULL, M, 1, dtype);
}

static ALWAYS_INLINE void rows_m(const lin_args *a, Py_ssize_t b, Py_ssize_t e, const int dtype) {
    switch (a->M) { /* about 8 accumulator registers: R = 4 / M rows side by side */
    case 1: rows_range(a, b, e, 1, 4, dtype); break;
    case 2: rows_range(a, b, e, 2, 2, dtype); break;
    case 3: rows_range(a, b, e, 3, 1, dtype); break;
    default: rows_range(a, b, e, 4, 1, dtype); break;
    }
}

static void linear_all(const lin_args *a, int dtype, int num_threads) {
    /* Whole blocks of 4 rows per thread, so that a thread's range is contiguous and only the
     * last thread has a partial block; the split never changes a result. */
    const Py_ssize_t blocks = (a->N + MAX_R - 1) / MAX_R;
    if (num_threads > blocks) num_threads = blocks > 0 ? (int)blocks : 1;
#pragma omp parallel num_threads(num_threads)
    {
        const Py_ssize_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const Py_ssize_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        const Py_ssize_t n0 = b0 * MAX_R, n1 = b1 * MAX_R < a->N ? b1 * MAX_R : a->N;
        if (n0 < n1) {
            if (dtype == LIN_BF16)
                rows_m(a, n0, n1, LIN_BF16);
            else
                rows_m(a, n0, n1, LIN_F32);
        }
    }
}

PyObject *nanoserve_small_linear(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long out, x, w;
    Py_ssize_t M, N, K;
    int dtype, num_threads;
    if (!PyArg_ParseTuple(args, "KKKnnnii", &out, &x, &w, &M, &N, &K, &dtype, &num_threads))
        return NULL;
    if (M < 1 || M > MAX_M || N < 0 || K < 0 || (dtype != LIN_F32 && dtype != LIN_BF16) ||
        num_threads < 1) {
        PyErr_SetString(PyExc_ValueError, "small_linear: inconsistent sizes or dtype code");
        return NULL;
    }
    lin_args a = {(const float *)(uintptr_t)x, (const char *)(uintptr_t)w, (void *)(uintptr_t)out,
                  M, N, K};
    float *x32 = NULL;
    if (dtype == LIN_BF16) { /* widen x once: [M, K] is small */
        x32 = malloc((size_t)(M * K + 1) * sizeof(float));
        if (!x32) return PyErr_NoMemory();
        const uint16_t *xh = (const uint16_t *)(uintptr_t)x;
        for (Py_ssize_t i = 0; i < M * K; i++) x32[i] = bf16_f32(xh[i]);
        a.x = x32;
    }
    if (N > 0) {
        Py_BEGIN_ALLOW_THREADS linear_all(&a, dtype, num_threads);
        Py_END_ALLOW_THREADS
    }
    free(x32);
    Py_RETURN_NONE;
}
