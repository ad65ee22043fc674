/* The C kernels' entry points for use from C (decode_step.c runs them back to back without
 * returning to Python). Pointers to contiguous rows; dtype codes 0 float32, 1 bfloat16, 2 float16
 * (paged attention only). All but nanoserve_check_tables can run with the GIL released and raise
 * nothing. */
#ifndef NANOSERVE_CPU_KERNELS_H
#define NANOSERVE_CPU_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { NS_F32 = 0, NS_BF16 = 1 };

/* bfloat16 <-> float32: widening is exact; narrowing rounds to nearest even, NaN kept quiet. */
static inline float ns_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t ns_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Element i of a float32 or bfloat16 array, as float32. */
static inline float ns_load(const void *p, Py_ssize_t i, int dtype) {
    if (dtype == NS_BF16) return ns_bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Stores f as element i of a float32 or bfloat16 array. */
static inline void ns_store(void *p, Py_ssize_t i, float f, int dtype) {
    if (dtype == NS_BF16)
        ((uint16_t *)p)[i] = ns_f32_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* f rounded to the dtype and back: where torch would round an intermediate result. */
static inline float ns_round(float f, int dtype) {
    if (dtype != NS_BF16) return f;
    uint16_t h;
    ns_store(&h, 0, f, dtype);
    return ns_load(&h, 0, dtype);
}

typedef struct {
    void *out;
    const void *q, *k, *v;
    const int32_t *block_tables, *context_lens;
    Py_ssize_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks;
    Py_ssize_t max_blocks_per_seq;
    float scale;
    int dtype;
} decode_args;

/* paged_attention.c: 0, or -1 when a thread could not allocate its scratch. */
int nanoserve_decode_attention(const decode_args *a, int num_threads);
/* paged_attention.c: 0, or -1 with a Python ValueError set (call with the GIL held). */
int nanoserve_check_tables(const decode_args *a);

/* linear.c: out[m, n] = sum_k x[m, k] * w[n, k], M <= 4; 0, or -1 when out of memory. */
int nanoserve_gemv(void *out, const void *x, const void *w, Py_ssize_t M, Py_ssize_t N,
                   Py_ssize_t K, int dtype, int num_threads);

/* norm_rope.c */
void nanoserve_rms_norm_rows(void *out, const void *x, const void *w, Py_ssize_t rows,
                             Py_ssize_t hidden, float eps, int dtype, int num_threads);
void nanoserve_rope_rows(void *qk, const int64_t *positions, const void *cos, const void *sin,
                         Py_ssize_t rows, Py_ssize_t heads, Py_ssize_t head_dim,
                         Py_ssize_t row_stride, int dtype, int num_threads);

#endif
