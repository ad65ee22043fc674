/* Float32 rows to GGUF blocks and back (the Python entry points quantize and dequantize), each
 * block by its format's functions in quant.h's table: byte for byte what the gguf package's numpy
 * reference (gguf.quants.quantize and dequantize, the arithmetic of ggml's quantize_row_*_ref)
 * produces.
 */
#include "quant.h"

static void quantize_rows(char *out, const float *w, Py_ssize_t N, Py_ssize_t K,
                          const ns_block_format *f, int num_threads) {
    const int bv = ns_block_values(f);
    const Py_ssize_t nb = K / bv;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (Py_ssize_t n = 0; n < N; n++)
        for (Py_ssize_t b = 0; b < nb; b++)
            f->quantize(out + ((size_t)n * (size_t)nb + (size_t)b) * f->block_bytes,
                        w + n * K + b * bv);
}

/* out [R, K] = rows rows[r] of w (or every row, in order, when rows is NULL); an r16 format's
 * blocks gathered (quant_r16.c), then de-quantized by the file's format. */
static void dequantize_rows(float *out, const char *w, const int64_t *rows, Py_ssize_t R,
                            Py_ssize_t K, const ns_block_format *f, int num_threads) {
    const int bv = ns_block_values(f);
    const Py_ssize_t nb = K / bv;
    const size_t row_bytes = (size_t)nb * f->block_bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (Py_ssize_t r = 0; r < R; r++) {
        const size_t n = rows ? (size_t)rows[r] : (size_t)r;
        for (Py_ssize_t b = 0; b < nb; b++) {
            const char *block = w + (n * (size_t)nb + (size_t)b) * f->block_bytes;
            _Alignas(64) char gathered[NS_MAX_BLOCK_BYTES];
            if (f->rows) {
                ns_r16_block(gathered, w, row_bytes, f->block_bytes, (Py_ssize_t)n, b);
                block = gathered;
            }
            (f->rows ? f->rows : f)->dequantize(out + r * K + b * bv, block);
        }
    }
}

/* The format of qtype, or NULL with a ValueError naming what is out of range (sizes and threads a
 * kernel would misuse; kernels/python/quant.py checks the shapes a user gives). */
static const ns_block_format *check_format(const char *fn, Py_ssize_t N, Py_ssize_t K, int qtype,
                                           int num_threads) {
    const ns_block_format *f = ns_block_format_of(qtype);
    if (!f || N < 0 || K < 0 || K % ns_block_values(f) || num_threads < 1 ||
        (f && f->rows && N % NS_R16)) {
        PyErr_Format(PyExc_ValueError, "%s: qtype code %d, [N, K] = [%zd, %zd] or num_threads %d "
                     "out of range", fn, qtype, N, K, num_threads);
        return NULL;
    }
    return f;
}

PyObject *nanoserve_py_quantize(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "w", "N", "K", "qtype", "num_threads", NULL};
    unsigned long long out, w;
    Py_ssize_t N, K;
    int qtype, num_threads;
    const ns_block_format *f;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKnnii", kwlist, &out, &w, &N, &K, &qtype,
                                     &num_threads) ||
        !(f = check_format("quantize", N, K, qtype, num_threads)))
        return NULL;
    if (!f->quantize) {
        PyErr_Format(PyExc_ValueError, "quantize: nanoserve does not quantize to %s", f->name);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    quantize_rows((char *)(uintptr_t)out, (const float *)(uintptr_t)w, N, K, f, num_threads);
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
    const ns_block_format *f;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKnnnii", kwlist, &out, &w, &rows, &R, &N, &K,
                                     &qtype, &num_threads) ||
        !(f = check_format("dequantize", N, K, qtype, num_threads)))
        return NULL;
    const int64_t *idx = (const int64_t *)(uintptr_t)rows;
    if (R < 0 || (!idx && R != N)) {
        PyErr_Format(PyExc_ValueError, "dequantize: num_rows %zd for N = %zd rows", R, N);
        return NULL;
    }
    if (check_row_indices(idx, R, N) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    dequantize_rows((float *)(uintptr_t)out, (const char *)(uintptr_t)w, idx, R, K, f,
                    num_threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}
