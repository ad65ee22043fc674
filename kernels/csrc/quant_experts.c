/* The experts' matmul of a mixture-of-experts layer (llama.cpp's MUL_MAT_ID): one call for all of
 * a step's chosen experts, each multiplying its own rows of x by its own matrix of a 3-D tensor of
 * GGUF blocks (experts x N x K, expert after expert).
 *
 * One call per expert (quant.c's matmul) cost a parallel region per 1-2 rows against a 1 MiB
 * matrix, each split over the threads: at decode most of the time went in starting and ending
 * regions and in threads waiting on each other. Here x's rows are quantized once, and one region
 * splits the work, every (expert, weight, chunk of CHUNK columns) in a row, into one contiguous
 * share per thread of equal cost (UNIT_BASE), so that each thread streams its own experts'
 * weights all the time.
 *
 * Each output is bitwise quant.c's: the same quantized rows and the same kernels, whose results
 * do not depend on the columns or rows they are given with (quant.h). On the VNNI paths a group
 * of up to NS_BYTE_ROWS rows takes the byte GEMV (quant_bytes.h), as quant.c's matmul of that
 * many rows does; a larger group the int16 kernels (the same results, bitwise). The AMX GEMM is
 * not used (its results are VNNI's, bitwise): its tiles take rows in sixteens, which experts'
 * row ranges do not start on.
 */
#include "quant.h"

#include <omp.h>
#include <stdlib.h>

/* Columns a unit of work: 64 rows of W (72 KiB of a Q4_K row of 2048), several strips, so that the
 * GEMV's prefetch of the next strip stays ahead; a multiple of NS_R16 (an r16 format's groups). */
enum { CHUNK = 64 };

/* A unit's cost, in rows of x, for the threads' shares: streaming a unit's weights costs about
 * what 2 rows' dots do (a 2880 x 2880 MXFP4 matrix on one AMD EPYC core: 0.39 ms at 1 row, 0.13
 * more a row up to 4), so equal numbers of units of a 1-row and a 4-row expert left a thread
 * waiting. */
enum { UNIT_BASE = 2 };

/* The first unit of the share that starts `target` into the units' total cost: each group's
 * `units` units cost UNIT_BASE + its rows each. */
static Py_ssize_t share_start(const int64_t *groups, Py_ssize_t G, Py_ssize_t units,
                              Py_ssize_t target) {
    Py_ssize_t u = 0, cost = 0;
    for (Py_ssize_t g = 0; g < G; g++) {
        const Py_ssize_t each = UNIT_BASE + groups[3 * g + 2];
        if (cost + each * units > target) return u + (target - cost + each - 1) / each;
        cost += each * units;
        u += units;
    }
    return u;
}

/* The matmul of one group of rows: rows [start, start + count) of the pairs' activations by the
 * expert's matrix of w (N rows of row_bytes), into rows start.. of out [pairs, N]. The view
 * keeps the activations' bytes (the byte GEMV) for a group of up to NS_BYTE_ROWS rows only. */
static ns_qmm group_matmul(const ns_xq *xq, ns_xq *view, const float *xf, const char *w,
                           float *out, Py_ssize_t ldo, const int64_t *group, Py_ssize_t N,
                           Py_ssize_t K, size_t row_bytes) {
    const Py_ssize_t expert = group[0], start = group[1], count = group[2];
    *view = *xq;
    if (xq->q) {
        view->q = xq->q + start * K;
        view->dx = xq->dx + start * xq->blocks;
        view->sx = xq->sx + start * xq->blocks;
    }
    if (xq->hi && count <= NS_BYTE_ROWS) {
        view->hi = xq->hi + start * K;
        view->lo = xq->lo + start * K;
        view->sum16 = xq->sum16 + start * (K / 16);
        view->hisum = xq->hisum + start * xq->blocks;
    } else {
        view->hi = NULL;
        view->lo = NULL;
    }
    const ns_qmm a = {out + start * ldo, w + (size_t)expert * (size_t)N * row_bytes, view, count,
                      N, K, ldo, row_bytes, xf ? xf + start * K : NULL, NULL, 1};
    return a;
}

/* Where unit u's rows of W start: its expert's matrix of weight i, from its chunk's first row. */
static const char *unit_rows(const char *const ws[], const int64_t *groups, Py_ssize_t u, int nw,
                             Py_ssize_t chunks, Py_ssize_t N, size_t row_bytes) {
    const Py_ssize_t g = u / (nw * chunks), i = u / chunks % nw, c = u % chunks;
    return ws[i] + ((size_t)groups[3 * g] * (size_t)N + (size_t)(c * CHUNK)) * row_bytes;
}

int nanoserve_quant_experts(float *const outs[], Py_ssize_t ldo, const char *const ws[], int nw,
                            const float *x, Py_ssize_t T, const int64_t *rows, Py_ssize_t P,
                            const int64_t *groups, Py_ssize_t G, Py_ssize_t N, Py_ssize_t K,
                            int qtype, int num_threads) {
    const ns_block_format *f = ns_block_format_of(qtype);
    int path = ns_quant_path();
    if (path == NS_AMX) path = NS_AVX512_VNNI;
    const uint8_t *order = path == NS_PORTABLE ? NULL : f->pairs;
    const ns_matmul_fn kernel = ns_path_kernel(f, path);
    const int bytes = path >= NS_AVX512_VNNI && f->byte_gemv;
    const size_t row_bytes = (size_t)(K / ns_block_values(f)) * f->block_bytes;
    /* The pairs' activations: x's rows quantized once each (xt), then gathered per pair (xq). A
     * float_x format gathers x's floats (xf) instead. */
    ns_xq xt = {0}, xq = {0};
    void *base_t = NULL, *base_q = NULL;
    float *xf = NULL;
    if (f->float_x) {
        if (rows && !(xf = malloc((size_t)(P * K) * sizeof(float)))) return -1;
    } else if (!(base_q = ns_xq_alloc(&xq, P, K, 0, bytes)) ||
               (rows && !(base_t = ns_xq_alloc(&xt, T, K, 0, bytes)))) {
        free(base_q);
        return -1;
    }
    const Py_ssize_t chunks = (N + CHUNK - 1) / CHUNK;
    const Py_ssize_t blocks = K / QK;
    Py_ssize_t total = 0;
    for (Py_ssize_t g = 0; g < G; g++) total += (UNIT_BASE + groups[3 * g + 2]) * nw * chunks;
#pragma omp parallel num_threads(num_threads)
    {
        if (f->float_x && rows) {
#pragma omp for schedule(static)
            for (Py_ssize_t p = 0; p < P; p++)
                memcpy(xf + p * K, x + rows[p] * K, (size_t)K * sizeof(float));
        } else if (!f->float_x && !rows) {
#pragma omp for schedule(static)
            for (Py_ssize_t p = 0; p < P; p++) ns_quantize_x_row(&xq, order, x, p);
        } else if (!f->float_x) {
#pragma omp for schedule(static)
            for (Py_ssize_t t = 0; t < T; t++) ns_quantize_x_row(&xt, order, x, t);
#pragma omp for schedule(static)
            for (Py_ssize_t p = 0; p < P; p++) {
                const Py_ssize_t t = rows[p];
                memcpy(xq.q + p * K, xt.q + t * K, (size_t)K * sizeof(int16_t));
                memcpy(xq.dx + p * blocks, xt.dx + t * blocks, (size_t)blocks * sizeof(float));
                memcpy(xq.sx + p * blocks, xt.sx + t * blocks, (size_t)blocks * sizeof(float));
                if (!bytes) continue;
                memcpy(xq.hi + p * K, xt.hi + t * K, (size_t)K);
                memcpy(xq.lo + p * K, xt.lo + t * K, (size_t)K);
                memcpy(xq.sum16 + p * (K / 16), xt.sum16 + t * (K / 16),
                       (size_t)(K / 16) * sizeof(int32_t));
                memcpy(xq.hisum + p * blocks, xt.hisum + t * blocks,
                       (size_t)blocks * sizeof(int32_t));
            }
        }
        /* A contiguous range of units per thread: (group, weight, chunk), chunk fastest; equal
         * shares of their cost. */
        const Py_ssize_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const float *xs = f->float_x ? (rows ? xf : x) : NULL;
        const Py_ssize_t end = share_start(groups, G, nw * chunks, total * (t + 1) / nt);
        for (Py_ssize_t u = share_start(groups, G, nw * chunks, total * t / nt); u < end; u++) {
            const Py_ssize_t g = u / (nw * chunks), i = u / chunks % nw, c = u % chunks;
            ns_xq view;
            ns_qmm a = group_matmul(&xq, &view, xs, ws[i], outs[i], ldo, groups + 3 * g, N, K,
                                    row_bytes);
            if (u + 1 < end) /* the next unit's rows: another matrix's first after c's last */
                a.then = unit_rows(ws, groups, u + 1, nw, chunks, N, row_bytes);
            const Py_ssize_t n1 = (c + 1) * CHUNK < N ? (c + 1) * CHUNK : N;
            if (a.M > 0) kernel(&a, c * CHUNK, n1);
        }
    }
    free(base_t);
    free(base_q);
    free(xf);
    return 0;
}

PyObject *nanoserve_py_quant_experts(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"outs", "ws", "x", "T", "rows", "P", "groups", "G", "E", "N", "K",
                             "qtype", "num_threads", "ldo", NULL};
    PyObject *outs_obj, *ws_obj;
    unsigned long long x, rows, groups;
    Py_ssize_t T, P, G, E, N, K, ldo = -1;
    int qtype, num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!KnKnKnnnnii|n", kwlist, &PyTuple_Type,
                                     &outs_obj, &PyTuple_Type, &ws_obj, &x, &T, &rows, &P,
                                     &groups, &G, &E, &N, &K, &qtype, &num_threads, &ldo))
        return NULL;
    const ns_block_format *f = ns_block_format_of(qtype);
    const Py_ssize_t nw = PyTuple_GET_SIZE(ws_obj);
    if (!f || nw < 1 || nw > 2 || PyTuple_GET_SIZE(outs_obj) != nw || T < 0 || P < 0 || G < 0 ||
        E < 1 || N < 0 || K < 0 || K % ns_block_values(f) || num_threads < 1 ||
        (ldo != -1 && ldo < N) || (f->rows && N % NS_R16)) {
        PyErr_Format(PyExc_ValueError, "quant_experts: qtype code %d, %zd weights, [T, P, G, E, N, "
                     "K, ldo] = [%zd, %zd, %zd, %zd, %zd, %zd, %zd] or num_threads %d out of range",
                     qtype, nw, T, P, G, E, N, K, ldo, num_threads);
        return NULL;
    }
    float *outs[2];
    const char *ws[2];
    for (Py_ssize_t i = 0; i < nw; i++) {
        outs[i] = (float *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(outs_obj, i));
        ws[i] = (const char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ws_obj, i));
    }
    if (PyErr_Occurred()) return NULL;
    /* The groups and rows index memory: checked here, so that a bad one is an error, not a crash. */
    const int64_t *g = (const int64_t *)(uintptr_t)groups, *r = (const int64_t *)(uintptr_t)rows;
    for (Py_ssize_t i = 0; i < G; i++)
        if (g[3 * i] < 0 || g[3 * i] >= E || g[3 * i + 1] < 0 || g[3 * i + 2] < 0 ||
            g[3 * i + 1] + g[3 * i + 2] > P) {
            PyErr_Format(PyExc_ValueError, "quant_experts: group %zd (expert %lld, start %lld, "
                         "count %lld) outside %zd experts or %zd pairs", i, (long long)g[3 * i],
                         (long long)g[3 * i + 1], (long long)g[3 * i + 2], E, P);
            return NULL;
        }
    for (Py_ssize_t p = 0; r && p < P; p++)
        if (r[p] < 0 || r[p] >= T) {
            PyErr_Format(PyExc_ValueError, "quant_experts: rows[%zd] = %lld outside x's %zd rows",
                         p, (long long)r[p], T);
            return NULL;
        }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    if (P > 0 && N > 0)
        rc = nanoserve_quant_experts(outs, ldo == -1 ? N : ldo, ws, (int)nw,
                                     (const float *)(uintptr_t)x, T, r, P, g, G, N, K, qtype,
                                     num_threads);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
