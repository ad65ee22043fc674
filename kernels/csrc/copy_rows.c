/* Loading a GGUF's blocks: every matrix's rows copied from the file's memory map into huge pages in
 * one call that holds no GIL (model/gguf_file.py), so that the loader builds the tokenizer, which
 * holds the GIL throughout, while the bytes move.
 *
 * A job copies `rows` rows of `row_bytes` bytes; with `heads` > 0 it also puts back each head's
 * rotary halves, which llama.cpp's converter interleaved row-wise: destination row (h, j, i) of
 * [heads, 2, rows / heads / 2] is source row (h, i, j) of [heads, rows / heads / 2, 2]. With
 * `repack` > 0 (the block bytes of a format quant_r16.c lays out) the rows land in the r16 layout,
 * the heads' halves put back first (through a buffer).
 */
#include "nanoserve.h"
#include "quant.h"

#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#endif

typedef struct {
    char *dst;
    const char *src;
    Py_ssize_t rows, row_bytes, heads, repack;
} copy_job;

/* The destination's pages faulted in by one call ahead of the copy: on a fresh huge-page mapping,
 * faults taken one by one inside the copy's loop cost more than one populating call. A kernel
 * without the advice (before 5.14) refuses it and the copy faults them in. */
static void populate(char *dst, size_t bytes) {
#if defined(__linux__)
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), start = (uintptr_t)dst & ~(page - 1);
    if (bytes) (void)madvise((void *)start, (uintptr_t)dst + bytes - start, MADV_POPULATE_WRITE);
#else
    (void)dst, (void)bytes;
#endif
}

/* The job's rows in their order (the heads' halves put back) at dst. */
static void copy_in_order(char *dst, const copy_job *j) {
    if (!j->heads) {
        memcpy(dst, j->src, (size_t)(j->rows * j->row_bytes));
        return;
    }
    const Py_ssize_t half = j->rows / j->heads / 2;
    for (Py_ssize_t h = 0; h < j->heads; h++)
        for (Py_ssize_t i = 0; i < half; i++)
            for (Py_ssize_t k = 0; k < 2; k++) {
                const Py_ssize_t to = (h * 2 + k) * half + i, from = (h * half + i) * 2 + k;
                memcpy(dst + to * j->row_bytes, j->src + from * j->row_bytes,
                       (size_t)j->row_bytes);
            }
}

/* 0, or -1 without memory for a repacked job's heads. */
static int copy_one(const copy_job *j) {
    const size_t bytes = (size_t)(j->rows * j->row_bytes);
    populate(j->dst, bytes);
    if (!j->repack) {
        copy_in_order(j->dst, j);
        return 0;
    }
    char *ordered = j->heads ? malloc(bytes ? bytes : 1) : NULL;
    if (j->heads && !ordered) return -1;
    if (ordered) copy_in_order(ordered, j);
    ns_r16_repack(j->dst, ordered ? ordered : j->src, j->rows, (size_t)j->row_bytes,
                  (size_t)j->repack);
    free(ordered);
    return 0;
}

PyObject *nanoserve_py_copy_rows(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"jobs", NULL};
    PyObject *list;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", kwlist, &list)) return NULL;
    PyObject *seq = PySequence_Fast(list, "copy_rows: jobs must be a list of tuples");
    if (!seq) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    copy_job *jobs = malloc((size_t)(n > 0 ? n : 1) * sizeof *jobs);
    if (!jobs) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long dst, src;
        copy_job *j = &jobs[i];
        j->repack = 0;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKnnn|n", &dst, &src, &j->rows,
                              &j->row_bytes, &j->heads, &j->repack)) {
            free(jobs);
            Py_DECREF(seq);
            return NULL;
        }
        j->dst = (char *)(uintptr_t)dst;
        j->src = (const char *)(uintptr_t)src;
        if (j->rows < 0 || j->row_bytes < 0 || j->heads < 0 ||
            (j->heads && j->rows % (2 * j->heads)) ||
            (j->repack && (j->repack < 4 || j->repack % 4 == 3 || j->repack > NS_MAX_BLOCK_BYTES ||
                           j->row_bytes % j->repack || j->rows % NS_R16))) {
            PyErr_Format(PyExc_ValueError,
                         "copy_rows: job %zd has %zd rows of %zd bytes in %zd heads (the rows "
                         "must split into 2 halves a head), repacked in blocks of %zd (rows a "
                         "multiple of 16, of blocks of 4 w, 4 w + 1 or 4 w + 2 bytes)",
                         i, j->rows, j->row_bytes, j->heads, j->repack);
            free(jobs);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) rc |= copy_one(&jobs[i]);
    Py_END_ALLOW_THREADS;
    free(jobs);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
