/* out[m, n] = sum_k x[m, k] * w[n, k] for a few input rows (M <= NS_GEMV_ROWS, 4): the batch-1
 * decode GEMV.
 *
 * A GEMV reads every weight once and does two flops per weight read, so it runs at memory speed.
 * Each thread takes a contiguous range of output rows n and reads its part of w front to back, one
 * row after the next: a single linear stream that the hardware prefetcher follows, with no
 * software prefetch to get in its way.
 *
 * Deterministic and batch invariant: each out[m, n] is one dot product over k with a fixed order
 * (32 lanes accumulated along k, the k % 32 tail added to lanes 0.., then the lanes combined
 * pairwise), whatever M, the row's place or the number of threads. Float32 accumulation; a bf16 x
 * is widened once, bf16 w as it is read, a bf16 out rounded to nearest even. GCC vector extensions
 * (no intrinsics): a 64-byte vector is one AVX-512 register, or two AVX ones.
 */
#include "nanoserve.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GEMV_LANES = 32 };

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* 16 elements of w from element i of row, as float32 (unaligned loads through memcpy). */
static ALWAYS_INLINE v16f load16(const char *row, Py_ssize_t i, const int dtype) {
    v16f f;
    if (dtype == NS_BF16) {
        v16h h;
        memcpy(&h, row + 2 * i, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, row + 4 * i, sizeof f);
    }
    return f;
}

static ALWAYS_INLINE float elem1(const char *row, Py_ssize_t i, const int dtype) {
    if (dtype == NS_BF16) return ns_bf16_to_f32(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

/* out[m, n] for m < M and rows n in [n_begin, n_end): x float32 [M, K], w [N, K] of dtype.
 * M and dtype are constants after inlining. */
static ALWAYS_INLINE void rows_range(const float *restrict x, const char *restrict w,
                                     void *restrict out, Py_ssize_t n_begin, Py_ssize_t n_end,
                                     Py_ssize_t N, Py_ssize_t K, const int M, const int dtype) {
    const size_t row_bytes = (size_t)K * ns_dtype_size(dtype);
    for (Py_ssize_t n = n_begin; n < n_end; n++) {
        const char *row = w + (size_t)n * row_bytes;
        v16f acc[NS_GEMV_ROWS][2];
#pragma GCC unroll 4
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = (v16f){0};
        Py_ssize_t i = 0;
        for (; i + GEMV_LANES <= K; i += GEMV_LANES) {
            const v16f w0 = load16(row, i, dtype), w1 = load16(row, i + 16, dtype);
#pragma GCC unroll 4
            for (int m = 0; m < M; m++) {
                v16f x0, x1;
                memcpy(&x0, x + m * K + i, sizeof x0);
                memcpy(&x1, x + m * K + i + 16, sizeof x1);
                acc[m][0] += x0 * w0;
                acc[m][1] += x1 * w1;
            }
        }
        for (int m = 0; m < M; m++) {
            float part[GEMV_LANES];
            memcpy(part, &acc[m][0], sizeof acc[m][0]);
            memcpy(part + 16, &acc[m][1], sizeof acc[m][1]);
            for (int l = 0; i + l < K; l++) part[l] += x[m * K + i + l] * elem1(row, i + l, dtype);
            for (int width = GEMV_LANES / 2; width > 0; width /= 2)
                for (int l = 0; l < width; l++) part[l] += part[l + width];
            const size_t o = (size_t)m * (size_t)N + (size_t)n;
            if (dtype == NS_BF16)
                ((uint16_t *)out)[o] = ns_f32_to_bf16(part[0]);
            else
                ((float *)out)[o] = part[0];
        }
    }
}

typedef struct {
    const float *x; /* float32 [M, K] */
    const char *w;
    void *out;
    Py_ssize_t M, N, K;
} lin_args;

_Static_assert(NS_GEMV_ROWS == 4, "rows_m has a case for each M from 1 to NS_GEMV_ROWS");

static ALWAYS_INLINE void rows_m(const lin_args *a, Py_ssize_t b, Py_ssize_t e, const int dtype) {
    switch (a->M) {
    case 1: rows_range(a->x, a->w, a->out, b, e, a->N, a->K, 1, dtype); break;
    case 2: rows_range(a->x, a->w, a->out, b, e, a->N, a->K, 2, dtype); break;
    case 3: rows_range(a->x, a->w, a->out, b, e, a->N, a->K, 3, dtype); break;
    default: rows_range(a->x, a->w, a->out, b, e, a->N, a->K, 4, dtype); break;
    }
}

static void linear_all(const lin_args *a, int dtype, int num_threads) {
    /* A contiguous range of rows per thread; the split never changes a result. */
    if (num_threads > a->N) num_threads = a->N > 0 ? (int)a->N : 1;
#pragma omp parallel num_threads(num_threads)
    {
        const Py_ssize_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const Py_ssize_t n0 = a->N * t / nt, n1 = a->N * (t + 1) / nt;
        if (n0 < n1) {
            if (dtype == NS_BF16)
                rows_m(a, n0, n1, NS_BF16);
            else
                rows_m(a, n0, n1, NS_F32);
        }
    }
}

int nanoserve_gemv(void *out, const void *x, const void *w, Py_ssize_t M, Py_ssize_t N,
                   Py_ssize_t K, int dtype, int num_threads) {
    lin_args a = {(const float *)x, (const char *)w, out, M, N, K};
    float *x32 = NULL;
    if (dtype == NS_BF16) { /* widen x once: [M, K] is small */
        x32 = malloc((size_t)(M * K + 1) * sizeof(float));
        if (!x32) return -1;
        const uint16_t *xh = (const uint16_t *)x;
        for (Py_ssize_t i = 0; i < M * K; i++) x32[i] = ns_bf16_to_f32(xh[i]);
        a.x = x32;
    }
    if (N > 0) linear_all(&a, dtype, num_threads);
    free(x32);
    return 0;
}

PyObject *nanoserve_py_small_linear(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "x", "w", "M", "N", "K", "dtype_code", "num_threads", NULL};
    unsigned long long out, x, w;
    Py_ssize_t M, N, K;
    int dtype, num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKnnnii", kwlist, &out, &x, &w, &M, &N, &K,
                                     &dtype, &num_threads))
        return NULL;
    if (M < 1 || M > NS_GEMV_ROWS || N < 0 || K < 0 || (dtype != NS_F32 && dtype != NS_BF16) ||
        num_threads < 1) {
        PyErr_SetString(PyExc_ValueError, "small_linear: inconsistent sizes or dtype code");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = nanoserve_gemv((void *)(uintptr_t)out, (const void *)(uintptr_t)x,
                        (const void *)(uintptr_t)w, M, N, K, dtype, num_threads);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
