/* A CPU decode step of up to NS_GEMV_ROWS (4) sequences through every decoder layer in one
 * call.
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
 *
 * With float32 activations each of qkv, o, gate_up and down may instead be a matrix of GGUF blocks
 * (quant.c, whose matmuls quantize their input to int16), as an optional table of codes says, one
 * row per layer: 0 for a float matrix of the step's dtype, else the GGML type id. Rows of blocks
 * concatenate like rows of floats, so the fused qkv and gate_up matrices are the
 * row-concatenations of their parts' blocks.
 */
#include "nanoserve.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { W_INPUT_NORM, W_QKV, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, K_CACHE, V_CACHE, PER_LAYER };
/* The columns of the qtypes table: the matrices that may be GGUF block matrices. */
enum { Q_QKV, Q_O, Q_GATE_UP, Q_DOWN, QUANT_PER_LAYER };

typedef struct {
    void *h; /* [rows, hidden], updated in place */
    const uint64_t *layers; /* [num_layers, PER_LAYER] pointers */
    const int32_t *qtypes;  /* [num_layers, QUANT_PER_LAYER] codes, or NULL: all float */
    const int64_t *positions, *slots;
    const void *cos, *sin;
    decode_args attn; /* out, q, caches set per layer */
    Py_ssize_t num_layers, rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    int dtype, threads;
} step_args;

/* run_layers' scratch, in elements of the model dtype: x [rows, hidden] (a normed h), o [rows,
 * hidden] (a projection back to hidden), qkv [rows, (heads + 2 kv_heads) head_dim], q and attn
 * [rows, heads head_dim], gate_up [rows, 2 intermediate], act [rows, intermediate]. */
typedef struct {
    char *x, *o, *qkv, *q, *attn, *gate_up, *act;
} step_scratch;

/* Pointer i of a layer's row of the weight table. */
static inline const void *weight(const uint64_t *w, int i) { return (const void *)(uintptr_t)w[i]; }

/* out [rows, N] = x [rows, K] times the transpose of matrix `which` (Q_*) of layer w: the float
 * GEMV, or the quantized matmul where the layer's qtypes say so. */
static int matmul(const step_args *s, const uint64_t *w, int which, void *out, const void *x,
                  Py_ssize_t N, Py_ssize_t K) {
    static const int column[QUANT_PER_LAYER] = {W_QKV, W_O, W_GATE_UP, W_DOWN};
    const Py_ssize_t layer = (w - s->layers) / PER_LAYER;
    const int qtype = s->qtypes ? s->qtypes[layer * QUANT_PER_LAYER + which] : 0;
    const void *m = weight(w, column[which]);
    if (qtype) return nanoserve_quant_matmul(out, x, m, s->rows, N, K, qtype, s->threads);
    return nanoserve_gemv(out, x, m, s->rows, N, K, s->dtype, s->threads);
}

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

/* One allocation for all of the scratch; returns it (to free), or NULL when out of memory. */
static char *scratch_alloc(const step_args *s, step_scratch *b) {
    const size_t es = ns_dtype_size(s->dtype);
    const Py_ssize_t M = s->rows, q_width = s->heads * s->head_dim;
    const Py_ssize_t n_x = M * s->hidden, n_qkv = M * (q_width + 2 * s->kv_heads * s->head_dim);
    const Py_ssize_t n_q = M * q_width, n_gu = M * 2 * s->intermediate, n_act = M * s->intermediate;
    char *base = malloc((size_t)(2 * n_x + n_qkv + 2 * n_q + n_gu + n_act) * es);
    if (!base) return NULL;
    b->x = base;
    b->o = b->x + n_x * es;
    b->qkv = b->o + n_x * es;
    b->q = b->qkv + n_qkv * es;
    b->attn = b->q + n_q * es;
    b->gate_up = b->attn + n_q * es;
    b->act = b->gate_up + n_gu * es;
    return base;
}

/* Row r of qkv is [q heads | k heads | v heads]: the q heads go to q, attention's input; the new
 * key and value into their cache slot (a negative slot, a padding row, is skipped as
 * kernels.store_kv skips it). */
static void split_qkv(const step_args *s, const step_scratch *b, const kv_cache *c) {
    const size_t es = ns_dtype_size(s->dtype);
    const Py_ssize_t q_width = s->heads * s->head_dim, kv_width = s->kv_heads * s->head_dim;
    const Py_ssize_t qkv_width = q_width + 2 * kv_width;
    for (Py_ssize_t r = 0; r < s->rows; r++) {
        const char *row = b->qkv + (size_t)(r * qkv_width) * es;
        memcpy(b->q + (size_t)(r * q_width) * es, row, (size_t)q_width * es);
        const char *key = row + (size_t)q_width * es;
        ns_store_kv_token(c, key, key + (size_t)kv_width * es, s->slots[r]);
    }
}

/* The attention half of layer w: h += o_proj(attention(rope(qkv_proj(input_norm(h))))). */
static int attention_half(const step_args *s, const step_scratch *b, const uint64_t *w) {
    const Py_ssize_t M = s->rows, H = s->hidden, D = s->head_dim, q_width = s->heads * D;
    const Py_ssize_t qkv_width = q_width + 2 * s->kv_heads * D;
    int rc = 0;
    nanoserve_rms_norm_rows(b->x, s->h, weight(w, W_INPUT_NORM), M, H, s->eps, s->dtype,
                            s->threads);
    rc |= matmul(s, w, Q_QKV, b->qkv, b->x, qkv_width, H);
    nanoserve_rope_rows(b->qkv, s->positions, s->cos, s->sin, M, s->heads + s->kv_heads, D,
                        qkv_width, s->dtype, s->threads);
    decode_args a = s->attn;
    const kv_cache c = {(char *)(uintptr_t)w[K_CACHE], (char *)(uintptr_t)w[V_CACHE], s->kv_heads,
                        a.block_size, (size_t)D * ns_dtype_size(s->dtype)};
    split_qkv(s, b, &c);
    a.out = b->attn;
    a.q = b->q;
    a.k = c.k_cache;
    a.v = c.v_cache;
    rc |= nanoserve_decode_attention(&a, s->threads);
    rc |= matmul(s, w, Q_O, b->o, b->attn, H, q_width);
    add_into(s->h, b->o, M * H, s->dtype);
    return rc;
}

/* The MLP half of layer w: h += down(silu(gate) * up) of gate_up(post_norm(h)). */
static int mlp_half(const step_args *s, const step_scratch *b, const uint64_t *w) {
    const Py_ssize_t M = s->rows, H = s->hidden, I = s->intermediate;
    int rc = 0;
    nanoserve_rms_norm_rows(b->x, s->h, weight(w, W_POST_NORM), M, H, s->eps, s->dtype,
                            s->threads);
    rc |= matmul(s, w, Q_GATE_UP, b->gate_up, b->x, 2 * I, H);
    silu_mul(b->act, b->gate_up, M, I, s->dtype);
    rc |= matmul(s, w, Q_DOWN, b->o, b->act, H, I);
    add_into(s->h, b->o, M * H, s->dtype);
    return rc;
}

/* Runs with the GIL released; 0, or -1 when out of memory. */
static int run_layers(const step_args *s) {
    step_scratch b;
    char *base = scratch_alloc(s, &b);
    if (!base) return -1;
    int rc = 0;
    for (Py_ssize_t l = 0; l < s->num_layers && rc == 0; l++) {
        const uint64_t *w = s->layers + l * PER_LAYER;
        rc |= attention_half(s, &b, w);
        rc |= mlp_half(s, &b, w);
    }
    free(base);
    return rc;
}

/* Parses decode_layers' arguments into s; 0, or -1 with a Python error set. */
static int parse_step_args(PyObject *args, PyObject *kwargs, step_args *s,
                           Py_ssize_t *table_rows) {
    static char *kwlist[] = {"h", "layers", "num_layers", "positions", "slots", "cos", "sin",
                             "table_rows", "block_tables", "context_lens", "max_blocks_per_seq",
                             "block_size", "num_blocks", "rows", "hidden", "heads", "kv_heads",
                             "head_dim", "intermediate", "eps", "scale", "dtype_code",
                             "num_threads", "qtypes", NULL};
    unsigned long long h, layers, positions, slots, cos, sin, tables, lens, qtypes = 0;
    decode_args *a = &s->attn;
    double scale;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "KKnKKKKnKKnnnnnnnnnfdii|K", kwlist, &h, &layers, &s->num_layers,
            &positions, &slots, &cos, &sin, table_rows, &tables, &lens, &a->max_blocks_per_seq,
            &a->block_size, &a->num_blocks, &s->rows, &s->hidden, &s->heads, &s->kv_heads,
            &s->head_dim, &s->intermediate, &s->eps, &scale, &s->dtype, &s->threads, &qtypes))
        return -1;
    s->qtypes = (const int32_t *)(uintptr_t)qtypes;
    s->h = (void *)(uintptr_t)h;
    s->layers = (const uint64_t *)(uintptr_t)layers;
    s->positions = (const int64_t *)(uintptr_t)positions;
    s->slots = (const int64_t *)(uintptr_t)slots;
    s->cos = (const void *)(uintptr_t)cos;
    s->sin = (const void *)(uintptr_t)sin;
    a->block_tables = (const int32_t *)(uintptr_t)tables;
    a->context_lens = (const int32_t *)(uintptr_t)lens;
    a->num_seqs = s->rows;
    a->num_q_heads = s->heads;
    a->num_kv_heads = s->kv_heads;
    a->head_dim = s->head_dim;
    a->scale = (float)scale;
    a->dtype = s->dtype;
    return 0;
}

/* 0, or -1 with a ValueError set when a size or the dtype code is out of range. */
static int check_sizes(const step_args *s) {
    const decode_args *a = &s->attn;
    if (s->rows < 1 || s->rows > NS_GEMV_ROWS || (s->dtype != NS_F32 && s->dtype != NS_BF16) ||
        s->hidden < 1 || s->heads < 1 || s->kv_heads < 1 || s->heads % s->kv_heads ||
        s->head_dim < 2 || s->head_dim % 2 || s->intermediate < 1 || a->block_size < 1 ||
        a->num_blocks < 1 || a->max_blocks_per_seq < 1 || s->threads < 1 || s->num_layers < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: inconsistent sizes or dtype code");
        return -1;
    }
    return 0;
}

/* 0, or -1 with a ValueError set when a qtypes code is no format, or a quantized matrix comes
 * with bfloat16 activations or a K that is no multiple of 32. */
static int check_qtypes(const step_args *s) {
    static const char *const names[QUANT_PER_LAYER] = {"qkv", "o", "gate_up", "down"};
    const Py_ssize_t K[QUANT_PER_LAYER] = {s->hidden, s->heads * s->head_dim, s->hidden,
                                           s->intermediate};
    for (Py_ssize_t i = 0; s->qtypes && i < s->num_layers * QUANT_PER_LAYER; i++) {
        const int q = s->qtypes[i], which = (int)(i % QUANT_PER_LAYER);
        if (q == 0) continue;
        const char *why = !nanoserve_block_bytes(q) ? "is no GGUF block format (_C.BLOCK_FORMATS)"
                          : s->dtype != NS_F32        ? "needs float32 activations"
                          : K[which] % 32             ? "needs K, its columns, a multiple of 32"
                                                      : NULL;
        if (why) {
            PyErr_Format(PyExc_ValueError, "qtypes[%zd, %d] = %d (%s) %s", i / QUANT_PER_LAYER,
                         which, q, names[which], why);
            return -1;
        }
    }
    return 0;
}

/* 0, or -1 with a ValueError set when a row's position is outside the cos/sin tables or its slot
 * past the cache. */
static int check_rows(const step_args *s, Py_ssize_t table_rows) {
    const int64_t num_slots = (int64_t)s->attn.num_blocks * s->attn.block_size;
    for (Py_ssize_t r = 0; r < s->rows; r++) {
        if (s->positions[r] < 0 || s->positions[r] >= table_rows) {
            PyErr_Format(PyExc_ValueError, "positions[%zd] = %lld is outside [0, %zd)", r,
                         (long long)s->positions[r], table_rows);
            return -1;
        }
        if (s->slots[r] >= num_slots) {
            PyErr_Format(PyExc_ValueError, "slot_mapping[%zd] = %lld is outside [0, %lld)", r,
                         (long long)s->slots[r], (long long)num_slots);
            return -1;
        }
    }
    return 0;
}

PyObject *nanoserve_py_decode_layers(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    step_args s;
    Py_ssize_t table_rows;
    if (parse_step_args(args, kwargs, &s, &table_rows) < 0 || check_sizes(&s) < 0 ||
        check_qtypes(&s) < 0 || check_rows(&s, table_rows) < 0 ||
        nanoserve_check_tables(&s.attn) < 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = run_layers(&s);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
