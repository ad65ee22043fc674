/* What the F16 and BF16 kernels share on every path (quant_f16.c's portable one, quant_simd.h's
 * SIMD ones): the walk over chunks of W's rows and tiles of x's rows, around a path's dots.
 */
#ifndef NANOSERVE_QUANT_F16_H
#define NANOSERVE_QUANT_F16_H

#include "quant.h"

/* out[r0 .. r0 + mr, n .. n + nc] from W's rows n .. n + nc (nc 1 or 2; row is W's row n),
 * bf16 or f16: a path's dot products. */
typedef void (*f16_dots_fn)(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n, int nc,
                            const char *row, int bf16);

/* dots with mr (1..NS_GEMV_ROWS) a constant. */
static ALWAYS_INLINE void f16_dots_nc(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n,
                                      const int nc, const char *row, const int bf16,
                                      const f16_dots_fn dots) {
    switch (mr) {
    case 1: dots(a, r0, 1, n, nc, row, bf16); break;
    case 2: dots(a, r0, 2, n, nc, row, bf16); break;
    case 3: dots(a, r0, 3, n, nc, row, bf16); break;
    default: dots(a, r0, 4, n, nc, row, bf16); break;
    }
}

/* out[:, n0:n1]: chunks of W's rows that fit in L2, under every tile of up to NS_GEMV_ROWS rows of
 * x, two of W's rows at a time. mr, nc and bf16 are constants in dots after inlining. */
static ALWAYS_INLINE void f16_matmul(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                     const int bf16, const f16_dots_fn dots) {
    Py_ssize_t chunk = (Py_ssize_t)(NS_PANEL_BYTES / a->row_bytes);
    chunk = chunk < 1 ? 1 : chunk;
    for (Py_ssize_t c0 = n0; c0 < n1; c0 += chunk) {
        const Py_ssize_t c1 = n1 - c0 < chunk ? n1 : c0 + chunk;
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += NS_GEMV_ROWS) {
            const int mr = a->M - r0 < NS_GEMV_ROWS ? (int)(a->M - r0) : NS_GEMV_ROWS;
            for (Py_ssize_t n = c0; n < c1; n += 2) {
                const char *row = a->w + (size_t)n * a->row_bytes;
                if (c1 - n < 2) {
                    f16_dots_nc(a, r0, mr, n, 1, row, bf16, dots);
                    continue;
                }
                f16_dots_nc(a, r0, mr, n, 2, row, bf16, dots);
            }
        }
    }
}

#endif
