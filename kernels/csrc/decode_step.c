/* A CPU decode step of up to NS_GEMV_ROWS (4) rows through every decoder layer in one call;
 * up to NS_STEP_ROWS (16) where every matrix is in GGUF blocks. A row is one sequence's next
 * token, or one position of a speculative verification (rows of one sequence, each attending to
 * the cache up to itself: every row's key and value are stored before any row attends).
 *
 * It does what Llama._layers (src/nanoserve/model/llama.py) does layer by layer, with the same C
 * kernels (RMSNorm, GEMV, RoPE, KV store, paged attention), but without returning to Python
 * between ops: at batch 1 a step is a few milliseconds of weight reading, and a return to the
 * interpreter per op would add a sizeable share of it. SwiGLU (or Gemma's GELU-tanh), the biases
 * and the residual adds are the only arithmetic of its own; each result is rounded to the model
 * dtype where torch would round it. A family's options (biases; Qwen3's RMSNorm of each q and k
 * head; Gemma 3's norms of the attention's and the MLP's outputs) are fields whose data is NULL
 * where the model has none; Gemma 3's sliding-window layers come as a window per layer, with
 * their own RoPE tables.
 *
 * Each layer comes as a struct layer_weights, its weights by name (the fields of
 * src/nanoserve/model/weights.py's LayerWeights) and its KV cache, filled once by layer_table from
 * a dict per layer. Positions, slots and block tables are checked here; the tensors' types and
 * shapes are checked by the caller (src/nanoserve/model/cpu_step.py, model/loader.py).
 *
 * With float32 activations each matrix may instead be in GGUF blocks (quant.c, whose matmuls
 * quantize their input to int16), as its format says: 0 for floats of the step's dtype, else the
 * GGML type id. Rows of blocks concatenate like rows of floats, so the fused qkv and gate_up
 * matrices are the row-concatenations of their parts' blocks; where the parts are in different
 * formats (a Q4_K_M file's q and k in Q4_K, v in Q6_K) the matrix comes as its parts, each in its
 * own format, multiplied one after the other into their columns of one output.
 *
 * A layer with a router has a mixture of experts in place of its MLP (Qwen3-MoE, Mixtral, gpt-oss;
 * float32 activations): its router's logits by the step's matmul, the rest by moe.c, which the
 * layer-by-layer path's routing shares. Its experts, floats or GGUF blocks, take the step's rows
 * as the matrices do (more than NS_GEMV_ROWS in blocks only).
 */
#include "nanoserve.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The most parts a fused matrix comes in (q, k, v). */
enum { STEP_PARTS = 3 };

/* A tensor the step reads: its data, and how it is stored: 0, floats of the step's dtype (a KV
 * cache: of the table's cache_dtype); else (a matrix only) the GGML type id of its GGUF blocks. A matrix of parts in different formats
 * has parts > 1: part[i] holds rows[i] rows of it, in blocks of format[i] at data[i] (data and
 * format are then part 0's). */
typedef struct {
    const void *data;
    int format;
    int parts; /* 0: the tensor is data alone */
    struct {
        const void *data;
        int format;
        Py_ssize_t rows;
    } part[STEP_PARTS];
} step_tensor;

/* One decoder layer: its weights, field for field model/weights.py's LayerWeights, and its KV
 * cache, k_cache and v_cache [num_blocks, kv_heads, block_size, head_dim] of the table's
 * cache_dtype. */
typedef struct {
    step_tensor input_norm, qkv, o, post_norm, gate_up, down;     /* gate_up, down NULL: experts */
    step_tensor router, experts_gate, experts_up, experts_down;   /* NULL: a dense MLP */
    /* gpt-oss (float32, NULL where absent): the router's bias [experts], each expert's biases
     * [experts, rows], the attention sinks [heads]. */
    step_tensor router_bias, experts_gate_bias, experts_up_bias, experts_down_bias, sinks;
    step_tensor qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm; /* NULL: absent */
    step_tensor attn_out_norm, mlp_out_norm;                               /* NULL: absent */
    step_tensor k_cache, v_cache;
} layer_weights;

/* The fields by the names Python gives them; blocks: whether it may be in GGUF blocks. */
static const struct {
    const char *name;
    size_t offset;
    int blocks;
} FIELDS[] = {
    {"input_norm", offsetof(layer_weights, input_norm), 0},
    {"qkv", offsetof(layer_weights, qkv), 1},
    {"o", offsetof(layer_weights, o), 1},
    {"post_norm", offsetof(layer_weights, post_norm), 0},
    {"gate_up", offsetof(layer_weights, gate_up), 1},
    {"down", offsetof(layer_weights, down), 1},
    {"router", offsetof(layer_weights, router), 1},
    {"experts_gate", offsetof(layer_weights, experts_gate), 1},
    {"experts_up", offsetof(layer_weights, experts_up), 1},
    {"experts_down", offsetof(layer_weights, experts_down), 1},
    {"router_bias", offsetof(layer_weights, router_bias), 0},
    {"experts_gate_bias", offsetof(layer_weights, experts_gate_bias), 0},
    {"experts_up_bias", offsetof(layer_weights, experts_up_bias), 0},
    {"experts_down_bias", offsetof(layer_weights, experts_down_bias), 0},
    {"sinks", offsetof(layer_weights, sinks), 0},
    {"qkv_bias", offsetof(layer_weights, qkv_bias), 0},
    {"o_bias", offsetof(layer_weights, o_bias), 0},
    {"gate_up_bias", offsetof(layer_weights, gate_up_bias), 0},
    {"down_bias", offsetof(layer_weights, down_bias), 0},
    {"q_norm", offsetof(layer_weights, q_norm), 0},
    {"k_norm", offsetof(layer_weights, k_norm), 0},
    {"attn_out_norm", offsetof(layer_weights, attn_out_norm), 0},
    {"mlp_out_norm", offsetof(layer_weights, mlp_out_norm), 0},
    {"k_cache", offsetof(layer_weights, k_cache), 0},
    {"v_cache", offsetof(layer_weights, v_cache), 0},
};
enum { NUM_FIELDS = sizeof FIELDS / sizeof FIELDS[0] };
_Static_assert(sizeof(layer_weights) == NUM_FIELDS * sizeof(step_tensor), "a row per field");

/* Field f of layer w. */
static step_tensor *field_of(const layer_weights *w, int f) {
    return (step_tensor *)((char *)w + FIELDS[f].offset);
}

/* What layer_table returns, in a capsule of this name. */
static const char *const TABLE_NAME = "nanoserve.layer_table";
typedef struct {
    Py_ssize_t num_layers;
    int cache_dtype; /* of every layer's k_cache and v_cache */
    layer_weights layers[];
} layer_table;

typedef struct {
    void *h; /* [rows, hidden], updated in place */
    layer_table *table;
    const int64_t *positions, *slots;
    const void *cos, *sin;
    /* Gemma 3: windows[l] > 0 makes layer l attend to that many last positions, rotated by
     * local_cos and local_sin (tables of cos's shape); windows NULL: no layer is windowed. */
    const int64_t *windows;
    const void *local_cos, *local_sin;
    int gelu; /* the MLP's activation: GELU-tanh, else SiLU */
    decode_args attn; /* out, q, caches and window set per layer */
    Py_ssize_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    /* A mixture of experts (the layers with a router): experts, each token's top_k of them, each
     * expert's intermediate size, whether the top k's weights are renormalized. */
    Py_ssize_t experts, top_k, expert_size;
    int normalize;
    int gpt_oss; /* gpt-oss's routing (softmax among the chosen) and clamped SwiGLU */
    float swiglu_alpha, swiglu_limit;
    float eps;
    int dtype, threads;
} step_args;

/* run_layers' scratch, in elements of the model dtype: x [rows, hidden] (a normed h), o [rows,
 * hidden] (a projection back to hidden), qkv [rows, (heads + 2 kv_heads) head_dim], q and attn
 * [rows, heads head_dim], gate_up [rows, 2 intermediate], act [rows, intermediate], logits
 * [rows, experts] (float32: a router's). */
typedef struct {
    char *x, *o, *qkv, *q, *attn, *gate_up, *act;
    float *logits;
} step_scratch;

/* Matrix m (N x K; part i of it where m has parts) as the one a matmul multiplies by next: its
 * rows are asked for ahead where they are in blocks. */
static ns_next first_rows(const step_tensor *m, int i, Py_ssize_t N, Py_ssize_t K) {
    if (m->parts) return (ns_next){m->part[i].data, m->part[i].rows, K, m->part[i].format};
    return (ns_next){m->format ? m->data : NULL, N, K, m->format};
}

/* out [rows, N] = x [rows, K] times the transpose of matrix m: the float GEMV (NS_GEMV_ROWS rows
 * at a time: a mixture of experts' float router beside blocks takes up to NS_STEP_ROWS rows so,
 * as model/linear.py's Linear does with its gemv_rows), or the quantized matmul where m is in GGUF
 * blocks. */
static int matmul(const step_args *s, const step_tensor *m, void *out, const void *x, Py_ssize_t N,
                  Py_ssize_t K, ns_next then) {
    int rc = 0;
    Py_ssize_t n0 = 0; /* a part's first column of out */
    for (int i = 0; i < m->parts; i++) {
        const ns_next after = i + 1 < m->parts ? first_rows(m, i + 1, 0, K) : then;
        rc |= nanoserve_quant_matmul_then((float *)out + n0, N, x, m->part[i].data, s->rows,
                                          m->part[i].rows, K, m->part[i].format, s->threads,
                                          &after);
        n0 += m->part[i].rows;
    }
    if (m->parts) return rc;
    if (m->format)
        return nanoserve_quant_matmul_then(out, N, x, m->data, s->rows, N, K, m->format,
                                           s->threads, &then);
    const size_t es = ns_dtype_size(s->dtype);
    for (Py_ssize_t r = 0; r < s->rows; r += NS_GEMV_ROWS) {
        const Py_ssize_t n = s->rows - r < NS_GEMV_ROWS ? s->rows - r : NS_GEMV_ROWS;
        rc |= nanoserve_gemv((char *)out + (size_t)(r * N) * es,
                             (const char *)x + (size_t)(r * K) * es, m->data, n, N, K, s->dtype,
                             s->threads);
    }
    return rc;
}

/* h[i] = h[i] + add[i], rounded like torch's add. */
static void add_into(void *h, const void *add, Py_ssize_t n, int dtype) {
    for (Py_ssize_t i = 0; i < n; i++)
        ns_store(h, i, ns_load(h, i, dtype) + ns_load(add, i, dtype), dtype);
}

/* x[r, i] += bias[i] for rows r of n values, rounded like torch's add_; nothing where the model
 * has no such bias. */
static void add_bias(void *x, const step_tensor *bias, Py_ssize_t rows, Py_ssize_t n, int dtype) {
    if (!bias->data) return;
    for (Py_ssize_t r = 0; r < rows; r++)
        for (Py_ssize_t i = 0; i < n; i++)
            ns_store(x, r * n + i, ns_load(x, r * n + i, dtype) + ns_load(bias->data, i, dtype),
                     dtype);
}

/* Qwen3: RMSNorm, in place, of each q head and each k head of every qkv row (one weight
 * [head_dim] for all heads); nothing where the model has no q_norm. */
static void norm_heads(const step_args *s, void *qkv, const layer_weights *w) {
    if (!w->q_norm.data) return;
    const size_t es = ns_dtype_size(s->dtype);
    const Py_ssize_t D = s->head_dim, q_width = s->heads * D;
    const Py_ssize_t qkv_width = q_width + 2 * s->kv_heads * D;
    for (Py_ssize_t r = 0; r < s->rows; r++) {
        char *q = (char *)qkv + (size_t)(r * qkv_width) * es, *k = q + (size_t)q_width * es;
        nanoserve_rms_norm_rows(q, q, w->q_norm.data, s->heads, D, s->eps, s->dtype, 1);
        nanoserve_rms_norm_rows(k, k, w->k_norm.data, s->kv_heads, D, s->eps, s->dtype, 1);
    }
}

/* RMSNorm, in place, of rows of x by norm; nothing where the model has no such norm. */
static void norm_out(const step_args *s, void *x, const step_tensor *norm) {
    if (!norm->data) return;
    nanoserve_rms_norm_rows(x, x, norm->data, s->rows, s->hidden, s->eps, s->dtype, s->threads);
}

/* One allocation for all of the scratch; returns it (to free), or NULL when out of memory. */
static char *scratch_alloc(const step_args *s, step_scratch *b) {
    const size_t es = ns_dtype_size(s->dtype);
    const Py_ssize_t M = s->rows, q_width = s->heads * s->head_dim;
    const Py_ssize_t n_x = M * s->hidden, n_qkv = M * (q_width + 2 * s->kv_heads * s->head_dim);
    const Py_ssize_t n_q = M * q_width, n_gu = M * 2 * s->intermediate, n_act = M * s->intermediate;
    const size_t n_logits = (size_t)(M * s->experts) * sizeof(float);
    char *base = malloc((size_t)(2 * n_x + n_qkv + 2 * n_q + n_gu + n_act) * es + n_logits);
    if (!base) return NULL;
    b->x = base;
    b->o = b->x + n_x * es;
    b->qkv = b->o + n_x * es;
    b->q = b->qkv + n_qkv * es;
    b->attn = b->q + n_q * es;
    b->gate_up = b->attn + n_q * es;
    b->act = b->gate_up + n_gu * es;
    b->logits = (float *)(b->act + n_act * es);
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
        ns_store_kv_token(c, key, key + (size_t)kv_width * es, s->dtype, s->slots[r]);
    }
}

/* The attention half of layer l (weights w): h += o_proj(attention(rope(qkv_proj(input_norm(h))))),
 * with the biases, q/k norms, output norm and window the model has. */
static int attention_half(const step_args *s, const step_scratch *b, const layer_weights *w,
                          Py_ssize_t l) {
    const Py_ssize_t M = s->rows, H = s->hidden, D = s->head_dim, q_width = s->heads * D;
    const Py_ssize_t qkv_width = q_width + 2 * s->kv_heads * D;
    int rc = 0;
    nanoserve_rms_norm_rows(b->x, s->h, w->input_norm.data, M, H, s->eps, s->dtype, s->threads);
    rc |= matmul(s, &w->qkv, b->qkv, b->x, qkv_width, H, first_rows(&w->o, 0, H, q_width));
    add_bias(b->qkv, &w->qkv_bias, M, qkv_width, s->dtype);
    norm_heads(s, b->qkv, w);
    decode_args a = s->attn;
    a.window = s->windows ? s->windows[l] : 0;
    a.sinks = w->sinks.data;
    nanoserve_rope_rows(b->qkv, s->positions, a.window ? s->local_cos : s->cos,
                        a.window ? s->local_sin : s->sin, M, s->heads + s->kv_heads, D, qkv_width,
                        s->dtype, s->threads);
    const kv_cache c = {(char *)w->k_cache.data, (char *)w->v_cache.data, s->kv_heads,
                        a.block_size, D, a.cache_dtype};
    split_qkv(s, b, &c);
    a.out = b->attn;
    a.q = b->q;
    a.k = c.k_cache;
    a.v = c.v_cache;
    rc |= nanoserve_decode_attention(&a, s->threads);
    const ns_next mlp = w->router.data ? first_rows(&w->router, 0, s->experts, H)
                                       : first_rows(&w->gate_up, 0, 2 * s->intermediate, H);
    rc |= matmul(s, &w->o, b->o, b->attn, H, q_width, mlp);
    add_bias(b->o, &w->o_bias, M, H, s->dtype);
    norm_out(s, b->o, &w->attn_out_norm);
    add_into(s->h, b->o, M * H, s->dtype);
    return rc;
}

/* The MLP half of layer w: h += down(f(gate) * up) of gate_up(post_norm(h)), f silu or GELU-tanh;
 * the next layer's weights (NULL after the last) are the ones read next. */
static int mlp_half(const step_args *s, const step_scratch *b, const layer_weights *w,
                    const layer_weights *next) {
    const Py_ssize_t M = s->rows, H = s->hidden, I = s->intermediate;
    const Py_ssize_t qkv_width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    int rc = 0;
    nanoserve_rms_norm_rows(b->x, s->h, w->post_norm.data, M, H, s->eps, s->dtype, s->threads);
    rc |= matmul(s, &w->gate_up, b->gate_up, b->x, 2 * I, H, first_rows(&w->down, 0, H, I));
    add_bias(b->gate_up, &w->gate_up_bias, M, 2 * I, s->dtype);
    nanoserve_gated_rows(b->act, b->gate_up, M, I, s->dtype, s->gelu, s->threads);
    rc |= matmul(s, &w->down, b->o, b->act, H, I,
                 next ? first_rows(&next->qkv, 0, qkv_width, H) : (ns_next){0});
    add_bias(b->o, &w->down_bias, M, H, s->dtype);
    norm_out(s, b->o, &w->mlp_out_norm);
    add_into(s->h, b->o, M * H, s->dtype);
    return rc;
}

/* The mixture of experts in place of layer w's MLP (float32 activations; model/moe.py):
 * h += moe(post_norm(h)), its router's logits by the step's matmul. */
static int moe_half(const step_args *s, const step_scratch *b, const layer_weights *w) {
    const Py_ssize_t M = s->rows, H = s->hidden;
    nanoserve_rms_norm_rows(b->x, s->h, w->post_norm.data, M, H, s->eps, s->dtype, s->threads);
    int rc = matmul(s, &w->router, b->logits, b->x, s->experts, H, (ns_next){0});
    add_bias(b->logits, &w->router_bias, M, s->experts, NS_F32);
    const moe_weights m = {w->experts_gate.data, w->experts_up.data, w->experts_down.data,
                           w->experts_gate.format, w->experts_up.format, w->experts_down.format,
                           s->experts, s->top_k, s->expert_size, s->normalize, s->gpt_oss,
                           w->experts_gate_bias.data, w->experts_up_bias.data,
                           w->experts_down_bias.data, s->swiglu_alpha, s->swiglu_limit};
    rc |= nanoserve_moe((float *)b->o, (const float *)b->x, b->logits, M, H, &m, s->threads);
    norm_out(s, b->o, &w->mlp_out_norm);
    add_into(s->h, b->o, M * H, s->dtype);
    return rc;
}

/* Runs with the GIL released; 0, or -1 when out of memory. */
static int run_layers(const step_args *s) {
    step_scratch b;
    char *base = scratch_alloc(s, &b);
    if (!base) return -1;
    int rc = 0;
    for (Py_ssize_t l = 0; l < s->table->num_layers && rc == 0; l++) {
        const layer_weights *w = &s->table->layers[l];
        const layer_weights *next = l + 1 < s->table->num_layers ? w + 1 : NULL;
        rc |= attention_half(s, &b, w, l);
        rc |= w->router.data ? moe_half(s, &b, w) : mlp_half(s, &b, w, next);
    }
    free(base);
    return rc;
}

/* Parses decode_layers' arguments into s; 0, or -1 with a Python error set. */
static int parse_step_args(PyObject *args, PyObject *kwargs, step_args *s,
                           Py_ssize_t *table_rows) {
    static char *kwlist[] = {"h", "layers", "positions", "slots", "cos", "sin", "table_rows",
                             "block_tables", "context_lens", "max_blocks_per_seq", "block_size",
                             "num_blocks", "rows", "hidden", "heads", "kv_heads", "head_dim",
                             "intermediate", "eps", "scale", "dtype_code", "num_threads", "windows",
                             "local_cos", "local_sin", "gelu", "experts", "top_k", "expert_size",
                             "normalize", "gpt_oss", "swiglu_alpha", "swiglu_limit", NULL};
    unsigned long long h, positions, slots, cos, sin, tables, lens;
    unsigned long long windows = 0, local_cos = 0, local_sin = 0;
    PyObject *layers;
    decode_args *a = &s->attn;
    double scale;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "KOKKKKnKKnnnnnnnnnfdii|KKKpnnnppff", kwlist, &h, &layers, &positions, &slots,
            &cos, &sin, table_rows, &tables, &lens, &a->max_blocks_per_seq, &a->block_size,
            &a->num_blocks, &s->rows, &s->hidden, &s->heads, &s->kv_heads, &s->head_dim,
            &s->intermediate, &s->eps, &scale, &s->dtype, &s->threads, &windows, &local_cos,
            &local_sin, &s->gelu, &s->experts, &s->top_k, &s->expert_size, &s->normalize,
            &s->gpt_oss, &s->swiglu_alpha, &s->swiglu_limit))
        return -1;
    if (windows && (!local_cos || !local_sin)) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: windows come with local_cos, local_sin");
        return -1;
    }
    s->windows = (const int64_t *)(uintptr_t)windows;
    s->local_cos = (const void *)(uintptr_t)local_cos;
    s->local_sin = (const void *)(uintptr_t)local_sin;
    if (!PyCapsule_IsValid(layers, TABLE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "decode_layers: layers must be what layer_table returns");
        return -1;
    }
    s->table = PyCapsule_GetPointer(layers, TABLE_NAME);
    s->h = (void *)(uintptr_t)h;
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
    a->cache_dtype = s->table->cache_dtype;
    return 0;
}

/* 0, or -1 with a ValueError set when a size or the dtype code is out of range. */
static int check_sizes(const step_args *s) {
    const decode_args *a = &s->attn;
    if (s->rows < 1 || s->rows > NS_STEP_ROWS || (s->dtype != NS_F32 && s->dtype != NS_BF16) ||
        s->hidden < 1 || s->heads < 1 || s->kv_heads < 1 || s->heads % s->kv_heads ||
        s->head_dim < 2 || s->head_dim % 2 || !ns_cache_ok(a->cache_dtype, s->head_dim) ||
        s->intermediate < 1 || a->block_size < 1 || s->experts < 0 ||
        (s->experts && (s->top_k < 1 || s->top_k > s->experts || s->expert_size < 1)) ||
        a->num_blocks < 1 || a->max_blocks_per_seq < 1 || s->threads < 1) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: inconsistent sizes or dtype code");
        return -1;
    }
    return 0;
}

/* 0, or -1 with a ValueError set when the caches' dtype is neither the step's nor q8_0 nor (under
 * float32 activations) bfloat16 or float16. */
static int check_caches(const step_args *s) {
    const int cache = s->attn.cache_dtype;
    if (cache != s->dtype && cache != NS_Q8_0 && s->dtype != NS_F32) {
        PyErr_Format(PyExc_ValueError,
                     "decode_layers: KV caches of dtype code %d need float32 activations or "
                     "caches of the activations' dtype (code %d)",
                     s->attn.cache_dtype, s->dtype);
        return -1;
    }
    return 0;
}

/* The rows (output features) of matrix field f, or 0 for a field that is no matrix. */
static Py_ssize_t matrix_rows(const step_args *s, int f) {
    const size_t at = FIELDS[f].offset;
    if (at == offsetof(layer_weights, qkv)) return (s->heads + 2 * s->kv_heads) * s->head_dim;
    if (at == offsetof(layer_weights, gate_up)) return 2 * s->intermediate;
    if (at == offsetof(layer_weights, o) || at == offsetof(layer_weights, down)) return s->hidden;
    if (at == offsetof(layer_weights, router)) return s->experts;
    return 0;
}

/* 0, or -1 with a ValueError set where a matrix's parts do not add up to its rows. */
static int check_parts(const step_args *s) {
    for (Py_ssize_t l = 0; l < s->table->num_layers; l++)
        for (int f = 0; f < NUM_FIELDS; f++) {
            const step_tensor *t = field_of(&s->table->layers[l], f);
            Py_ssize_t rows = 0;
            for (int i = 0; i < t->parts; i++) rows += t->part[i].rows;
            if (t->parts && rows != matrix_rows(s, f)) {
                PyErr_Format(PyExc_ValueError,
                             "layers[%zd].%s: its parts have %zd rows, the matrix %zd", l,
                             FIELDS[f].name, rows, matrix_rows(s, f));
                return -1;
            }
        }
    return 0;
}

/* 0, or -1 with a ValueError set when a tensor in GGUF blocks comes with bfloat16 activations
 * (the quantized matmuls take float32), or a float matrix (but a router) with more rows than the
 * GEMV takes. */
static int check_formats(const step_args *s) {
    for (Py_ssize_t l = 0; s->rows > NS_GEMV_ROWS && l < s->table->num_layers; l++)
        for (int f = 0; f < NUM_FIELDS; f++) {
            const step_tensor *t = field_of(&s->table->layers[l], f);
            const int router = FIELDS[f].offset == offsetof(layer_weights, router);
            if (FIELDS[f].blocks && t->data && !t->format && !router) {
                PyErr_Format(PyExc_ValueError,
                             "decode_layers: %zd rows, more than %d, need every matrix in GGUF "
                             "blocks; layers[%zd].%s is in floats",
                             s->rows, NS_GEMV_ROWS, l, FIELDS[f].name);
                return -1;
            }
        }
    for (Py_ssize_t l = 0; s->dtype != NS_F32 && l < s->table->num_layers; l++)
        for (int f = 0; f < NUM_FIELDS; f++) {
            const int format = field_of(&s->table->layers[l], f)->format;
            if (format) {
                PyErr_Format(PyExc_ValueError,
                             "layers[%zd].%s is in GGUF blocks (format %d), which need float32 "
                             "activations",
                             l, FIELDS[f].name, format);
                return -1;
            }
        }
    return 0;
}

/* 0, or -1 with a ValueError set when a layer has neither a whole dense MLP nor a whole mixture
 * of experts, or has experts where the step has no expert sizes or bfloat16 activations. */
static int check_mlps(const step_args *s) {
    for (Py_ssize_t l = 0; l < s->table->num_layers; l++) {
        const layer_weights *w = &s->table->layers[l];
        const int dense = w->gate_up.data && w->down.data, moe = w->router.data &&
                          w->experts_gate.data && w->experts_up.data && w->experts_down.data;
        const char *why = dense == moe  ? "needs gate_up and down, or a router and its experts"
                          : !moe         ? NULL
                          : !s->experts  ? "has experts, but the step has no expert sizes"
                          : s->dtype != NS_F32 ? "has experts, which need float32 activations"
                                               : NULL;
        if (why) {
            PyErr_Format(PyExc_ValueError, "decode_layers: layers[%zd] %s", l, why);
            return -1;
        }
    }
    return 0;
}

PyObject *nanoserve_py_decode_layers(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    step_args s = {0}; /* attn.window 0: the C step runs no sliding window */
    Py_ssize_t table_rows;
    if (parse_step_args(args, kwargs, &s, &table_rows) < 0 || check_sizes(&s) < 0 ||
        check_formats(&s) < 0 || check_parts(&s) < 0 || check_mlps(&s) < 0 ||
        check_caches(&s) < 0 ||
        nanoserve_check_positions(s.positions, s.rows, table_rows) < 0 ||
        nanoserve_check_slots(s.slots, s.rows, 1,
                              (int64_t)s.attn.num_blocks * s.attn.block_size) < 0 ||
        nanoserve_check_tables(&s.attn) < 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = run_layers(&s);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- the table of layers */

/* A tensor's (pointer, format) as field f of layer i (`what`: its name in errors); 0, or -1 with
 * an error set. */
static int parse_stored(PyObject *value, int f, Py_ssize_t i, const char *what,
                        unsigned long long *data, int *format) {
    if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2 ||
        !PyArg_ParseTuple(value, "Ki", data, format)) {
        PyErr_Format(PyExc_TypeError, "layers[%zd][\"%s\"]%s must be a tuple (pointer, format)",
                     i, FIELDS[f].name, what);
        return -1;
    }
    const char *why = *format == 0                       ? NULL
                      : !FIELDS[f].blocks                ? "it is never in GGUF blocks"
                      : !nanoserve_block_bytes(*format) ? "no GGUF block format (_C.BLOCK_FORMATS)"
                                                         : NULL;
    if (why) {
        PyErr_Format(PyExc_ValueError, "layers[%zd].%s%s: format %d, but %s", i, FIELDS[f].name,
                     what, *format, why);
        return -1;
    }
    return 0;
}

/* Field f of layer i from its (pointer, format) tuple, or for a matrix of parts in different
 * formats a list of 2 to STEP_PARTS tuples ((pointer, format), rows), each in blocks; 0, or -1
 * with an error set. */
static int fill_field(layer_weights *w, int f, PyObject *value, Py_ssize_t i) {
    step_tensor *t = field_of(w, f);
    unsigned long long data;
    int format;
    if (!PyList_Check(value)) {
        if (parse_stored(value, f, i, "", &data, &format) < 0) return -1;
        *t = (step_tensor){(const void *)(uintptr_t)data, format, 0, {{0}}};
        return 0;
    }
    const Py_ssize_t n = PyList_GET_SIZE(value);
    if (!FIELDS[f].blocks || n < 2 || n > STEP_PARTS) {
        PyErr_Format(PyExc_ValueError, "layers[%zd].%s: a list of parts, but %s", i,
                     FIELDS[f].name,
                     FIELDS[f].blocks ? "a matrix has 2 to 3 parts" : "it is no matrix");
        return -1;
    }
    *t = (step_tensor){NULL, 0, (int)n, {{0}}};
    for (Py_ssize_t p = 0; p < n; p++) {
        PyObject *item = PyList_GET_ITEM(value, p), *stored;
        Py_ssize_t rows;
        char what[32];
        snprintf(what, sizeof what, "[%zd]", p);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "On", &stored, &rows)) {
            PyErr_Format(PyExc_TypeError,
                         "layers[%zd][\"%s\"]%s must be a tuple ((pointer, format), rows)", i,
                         FIELDS[f].name, what);
            return -1;
        }
        if (parse_stored(stored, f, i, what, &data, &format) < 0) return -1;
        if (!format || rows < 1) {
            PyErr_Format(PyExc_ValueError, "layers[%zd].%s%s: a part must be in GGUF blocks and "
                         "have rows, got format %d, %zd rows", i, FIELDS[f].name, what, format,
                         rows);
            return -1;
        }
        t->part[p].data = (const void *)(uintptr_t)data;
        t->part[p].format = format;
        t->part[p].rows = rows;
    }
    t->data = t->part[0].data;
    t->format = t->part[0].format;
    return 0;
}

/* Layer i from its dict {field: (pointer, format)}, every field named once; 0, or -1. */
static int fill_layer(layer_weights *w, PyObject *layer, Py_ssize_t i) {
    if (!PyDict_Check(layer)) {
        PyErr_Format(PyExc_TypeError, "layers[%zd] must be a dict {field: (pointer, format)}", i);
        return -1;
    }
    for (int f = 0; f < NUM_FIELDS; f++) {
        PyObject *value = PyDict_GetItemString(layer, FIELDS[f].name);
        if (!value) {
            PyErr_Format(PyExc_ValueError, "layers[%zd] has no %s", i, FIELDS[f].name);
            return -1;
        }
        if (fill_field(w, f, value, i) < 0) return -1;
    }
    if (PyDict_Size(layer) != NUM_FIELDS) {
        PyErr_Format(PyExc_ValueError,
                     "layers[%zd] has %zd fields; the C step's layer_weights has %d: %R", i,
                     PyDict_Size(layer), (int)NUM_FIELDS, layer);
        return -1;
    }
    return 0;
}

static void free_table(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, TABLE_NAME)); }

PyObject *nanoserve_py_layer_table(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"layers", "cache_dtype_code", NULL};
    PyObject *list;
    int cache_dtype = NS_F32;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|i", kwlist, &PyList_Type, &list,
                                     &cache_dtype))
        return NULL;
    if (!ns_dtype_ok(cache_dtype) && cache_dtype != NS_Q8_0) {
        PyErr_Format(PyExc_ValueError, "layer_table: cache_dtype_code %d is no cache dtype code",
                     cache_dtype);
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(list);
    layer_table *t = malloc(sizeof *t + (size_t)n * sizeof(layer_weights));
    if (!t) return PyErr_NoMemory();
    t->num_layers = n;
    t->cache_dtype = cache_dtype;
    for (Py_ssize_t i = 0; i < n; i++)
        if (fill_layer(&t->layers[i], PyList_GET_ITEM(list, i), i) < 0) {
            free(t);
            return NULL;
        }
    PyObject *capsule = PyCapsule_New(t, TABLE_NAME, free_table);
    if (!capsule) free(t);
    return capsule;
}
