/* A CPU decode step of up to 4 sequences through every decoder layer in one call.
 *
 * It does what Llama._layers (src/nanoserve/model/llama.py) does layer by layer, with the same C
 * kernels (RMSNorm, GEMV, RoPE, KV store, paged attention), but without returning to Python
 * between ops: at batch 1 on the 25M benchmark model those returns cost more than half a
 * millisecond a step, next to ~3 ms of weight reading. SwiGLU and the residual adds are the only
 * arithmetic of its own; each result is rounded to the model dtype where torch would round it.
 *
 * Layer weights come as a table of pointers, one row per layer: input norm, qkv, o, post norm,
 * gate_up, down, k cache, v cache. Positions, slots and block tables are checked here; the
 * tensors' types and shapes are checked by the caller (src/nanoserve/model/cpu_step.py).
 */
#include "cpu_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_ROWS = 4 };
enum { W_INPUT_NORM, W_QKV, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, K_CACHE, V_CACHE, PER_LAYER };

typedef struct {
    void *h; /* [rows, hidden], updated in place */
    const uint64_t *layers; /* [num_layers, PER_LAYER] pointers */
    const int64_t *positions, *slots;
    const void *cos, *sin;
    decode_args attn; /* out, q, caches set per layer */
    Py_ssize_t num_layers, rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    int dtype, threads;
} step_args;

/* h[i] = h[i] + add[i], rounded like torch's add. */
static void add_into(void *h, const void *add, Py_ssize_t n, int dtype) {
    for (Py_ssize_t i = 0; i < n; i++)
        ns_store(h, i, ns_load(h, i, dtype) + ns_load(add, i, dtype), dtype);
}

/* act[r, i] = silu(gate[r, i]) * up[r, i] of gate_up rows [gate | up], rounded like torch's
 * F.silu(gate) * up. */
static void silu_mul(void *act, const void *gate_up, Py_ssize_t rows, Py_ssize_t inter,
                     int dtype) {
    for (Py_ssize_t r = 0; r < rows; r++)
        for (Py_ssize_t i = 0; i < inter; i++) {
            const float g = ns_load(gate_up, r * 2 * inter + i, dtype);
            const float up = ns_load(gate_up, r * 2 * inter + inter + i, dtype);
            const float silu = ns_round(g / (1.0f + expf(-g)), dtype);
            ns_store(act, r * inter + i, silu * up, dtype);
        }
}

/* Runs with the GIL released; 0, or -1 when out of memory. */
static int run_layers(const step_args *s) {
    const size_t es = s->dtype == NS_BF16 ? 2 : 4;
    const Py_ssize_t M = s->rows, H = s->hidden, D = s->head_dim;
    const Py_ssize_t q_width = s->heads * D, kv_width = s->kv_heads * D;
    const Py_ssize_t qkv_width = q_width + 2 * kv_width, I = s->intermediate;
    /* scratch, in elements of the model dtype */
    const Py_ssize_t n_x = M * H, n_qkv = M * qkv_width, n_q = M * q_width;
    const Py_ssize_t n_gu = M * 2 * I, n_act = M * I;
    char *base = malloc((size_t)(2 * n_x + n_qkv + 2 * n_q + n_gu + n_act) * es);
    if (!base) return -1;
    char *x = base, *o = x + n_x * es, *qkv = o + n_x * es, *q = qkv + n_qkv * es;
    char *attn = q + n_q * es, *gu = attn + n_q * es, *act = gu + n_gu * es;
    decode_args a = s->attn;
    a.out = attn;
    a.q = q;
    const size_t block_elems = (size_t)(s->kv_heads * a.block_size * D);
    int rc = 0;
    for (Py_ssize_t l = 0; l < s->num_layers && rc == 0; l++) {
        const uint64_t *w = s->layers + l * PER_LAYER;
        nanoserve_rms_norm_rows(x, s->h, (const void *)(uintptr_t)w[W_INPUT_NORM], M, H, s->eps,
                                s->dtype, s->threads);
        rc |= nanoserve_gemv(qkv, x, (const void *)(uintptr_t)w[W_QKV], M, qkv_width, H, s->dtype,
                             s->threads);
        nanoserve_rope_rows(qkv, s->positions, s->cos, s->sin, M, s->heads + s->kv_heads, D,
                            qkv_width, s->dtype, s->threads);
        char *k_cache = (char *)(uintptr_t)w[K_CACHE], *v_cache = (char *)(uintptr_t)w[V_CACHE];
        for (Py_ssize_t r = 0; r < M; r++) {
            /* row r of qkv: [q heads | k heads | v heads] */
            const char *row = qkv + (size_t)(r * qkv_width) * es;
            memcpy(q + (size_t)(r * q_width) * es, row, (size_t)q_width * es);
            /* the new key and value rows into their cache slot, head by head (a negative slot,
             * a padding row, is skipped as kernels.store_kv skips it) */
            const int64_t slot = s->slots[r];
            if (slot < 0) continue;
            const size_t blk = (size_t)(slot / a.block_size), off = (size_t)(slot % a.block_size);
            for (Py_ssize_t h = 0; h < s->kv_heads; h++) {
                const size_t dst = (blk * block_elems + ((size_t)h * a.block_size + off) * D) * es;
                const char *key = row + (size_t)(q_width + h * D) * es;
                memcpy(k_cache + dst, key, (size_t)D * es);
                memcpy(v_cache + dst, key + (size_t)kv_width * es, (size_t)D * es);
            }
        }
        a.k = k_cache;
        a.v = v_cache;
        rc |= nanoserve_decode_attention(&a, s->threads);
        rc |= nanoserve_gemv(o, attn, (const void *)(uintptr_t)w[W_O], M, H, q_width, s->dtype,
                             s->threads);
        add_into(s->h, o, n_x, s->dtype);
        nanoserve_rms_norm_rows(x, s->h, (const void *)(uintptr_t)w[W_POST_NORM], M, H, s->eps,
                                s->dtype, s->threads);
        rc |= nanoserve_gemv(gu, x, (const void *)(uintptr_t)w[W_GATE_UP], M, 2 * I, H, s->dtype,
                             s->threads);
        silu_mul(act, gu, M, I, s->dtype);
        rc |= nanoserve_gemv(o, act, (const void *)(uintptr_t)w[W_DOWN], M, H, I, s->dtype,
                             s->threads);
        add_into(s->h, o, n_x, s->dtype);
    }
    free(base);
    return rc;
}

PyObject *nanoserve_decode_layers(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long h, layers, positions, slots, cos, sin, tables, lens;
    step_args s;
    decode_args *a = &s.attn;
    Py_ssize_t table_rows;
    double scale;
    if (!PyArg_ParseTuple(args, "KKnKKKKnKKnnnnnnnnnfdii", &h, &layers, &s.num_layers,
                          &positions, &slots, &cos, &sin, &table_rows, &tables, &lens,
                          &a->max_blocks_per_seq, &a->block_size, &a->num_blocks, &s.rows,
                          &s.hidden, &s.heads, &s.kv_heads, &s.head_dim, &s.intermediate, &s.eps,
                          &scale, &s.dtype, &s.threads))
        return NULL;
    if (s.rows < 1 || s.rows > MAX_ROWS || (s.dtype != NS_F32 && s.dtype != NS_BF16) ||
        s.hidden < 1 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads ||
        s.head_dim < 2 || s.head_dim % 2 || s.intermediate < 1 || a->block_size < 1 ||
        a->num_blocks < 1 || a->max_blocks_per_seq < 1 || s.threads < 1 || s.num_layers < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: inconsistent sizes or dtype code");
        return NULL;
    }
    s.h = (void *)(uintptr_t)h;
    s.layers = (const uint64_t *)(uintptr_t)layers;
    s.positions = (const int64_t *)(uintptr_t)positions;
    s.slots = (const int64_t *)(uintptr_t)slots;
    s.cos = (const void *)(uintptr_t)cos;
    s.sin = (const void *)(uintptr_t)sin;
    a->block_tables = (const int32_t *)(uintptr_t)tables;
    a->context_lens = (const int32_t *)(uintptr_t)lens;
    a->num_seqs = s.rows;
    a->num_q_heads = s.heads;
    a->num_kv_heads = s.kv_heads;
    a->head_dim = s.head_dim;
    a->scale = (float)scale;
    a->dtype = s.dtype;
    const int64_t num_slots = (int64_t)a->num_blocks * a->block_size;
    for (Py_ssize_t r = 0; r < s.rows; r++) {
        if (s.positions[r] < 0 || s.positions[r] >= table_rows) {
            PyErr_Format(PyExc_ValueError, "positions[%zd] = %lld is outside [0, %zd)", r,
                         (long long)s.positions[r], table_rows);
            return NULL;
        }
        if (s.slots[r] >= num_slots) {
            PyErr_Format(PyExc_ValueError, "slot_mapping[%zd] = %lld is outside [0, %lld)", r,
                         (long long)s.slots[r], (long long)num_slots);
            return NULL;
        }
    }
    if (nanoserve_check_tables(a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = run_layers(&s);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
