/* Prefill attention on the CPU over the paged KV cache, in flash attention's scheme: plain C11 +
 * OpenMP, CPython C API only.
 *
 * One sequence's chunk of T queries q [T, num_q_heads, head_dim], at positions context_len - T ...
 * context_len - 1, attends causally to the cache [num_blocks, num_kv_heads, block_size, head_dim]
 * (store_kv has already written the chunk's own keys and values); with a sliding window w > 0,
 * position p sees (p - w, p]. One OpenMP work item is a (KV head, tile of Q_TILE positions): the
 * tile's rows of every query head sharing that KV head (GQA) walk the keys together, KV_TILE
 * positions at a time, so a key or value row is read once per tile. An online softmax in float32
 * keeps a running max, sum and weighted sum of values per row: no score matrix larger than
 * ROWS x KV_TILE exists, and the scratch is per thread.
 *
 * Inside a work item the query rows are the vector lanes (queries, scores and sums are stored
 * transposed, ROWS rows side by side), so the dot products, the softmax and the weighted sums all
 * vectorise over rows with no horizontal sums. Every sum runs in a fixed order, KV tiles start at
 * multiples of KV_TILE positions, and a KV tile wholly masked for a row leaves that row's state
 * unchanged bit for bit: a row's result depends neither on the thread count nor on the other rows
 * of its tile or chunk. No -ffast-math.
 */
#include "nanoserve.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The two products (scores, weighted values) in GCC vector extensions, no intrinsics: a vrow holds
 * LANES query rows' values in one register, and a step takes STEP keys (or value elements), whose
 * 2 * STEP sums fill half the registers (32 on AVX-512, 16 on AVX2). */
#if defined(__AVX512F__)
enum { LANES = 16, STEP = 8 };
#else
enum { LANES = 8, STEP = 4 };
#endif
typedef float vrow __attribute__((vector_size(LANES * sizeof(float))));

/* ROWS: query rows per block (two vectors). KV_TILE: key positions per online-softmax step.
 * Q_TILE: positions per work item; with a GQA group of g, its g * Q_TILE rows share each key and
 * value row widened. Tiles chosen by measurement (bench/bench_prefill.py): larger Q tiles share
 * that widening more widely, and 64 positions still make enough work items for two threads from a
 * 512-token chunk. */
enum { ROWS = 2 * LANES, KV_TILE = 64, Q_TILE = 64 };

static ALWAYS_INLINE vrow load_lanes(const float *p) {
    vrow v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void store_lanes(float *p, vrow v) { memcpy(p, &v, sizeof v); }

static inline size_t kv_row_bytes(const prefill_args *a) {
    return ns_row_bytes(a->cache_dtype, a->head_dim);
}

/* The row of KV head kvh at position pos of the sequence, found through its block table. */
static inline const char *cache_row(const prefill_args *a, const void *cache, Py_ssize_t kvh,
                                    Py_ssize_t pos) {
    const size_t block = (size_t)a->block_table[pos / a->block_size];
    const size_t row = (block * (size_t)a->num_kv_heads + (size_t)kvh) * (size_t)a->block_size +
                       (size_t)(pos % a->block_size);
    return (const char *)cache + row * kv_row_bytes(a);
}

/* Per-thread float32 scratch, sized once per call. A work item's rows are split into `chunks`
 * blocks of ROWS; row r = t * group + g (position t of the tile, query head g of the group). */
typedef struct {
    Py_ssize_t chunks;
    float *q;          /* [chunks][head_dim][ROWS]: the queries, pre-scaled, transposed */
    float *acc;        /* [chunks][head_dim][ROWS]: weighted sums of values */
    float *m, *l;      /* [chunks][ROWS]: running max and sum of weights */
    float *w;          /* [KV_TILE][ROWS]: a block of rows' scores, then weights */
    float *k, *v;      /* [KV_TILE][head_dim]: the KV tile, as float32 */
    int32_t *pos, *lo; /* [chunks][ROWS]: a row sees the positions in (lo, pos] */
} scratch;

static void *scratch_alloc(const prefill_args *a, scratch *s) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    s->chunks = (Q_TILE * group + ROWS - 1) / ROWS;
    const size_t rows = (size_t)(s->chunks * ROWS);
    const size_t floats = 2 * rows * (size_t)d + 2 * rows + (size_t)KV_TILE * (ROWS + 2 * d);
    const size_t bytes = (floats + 2 * rows) * sizeof(float);
    char *base = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!base) return NULL;
    s->q = (float *)base;
    s->acc = s->q + rows * d;
    s->m = s->acc + rows * d;
    s->l = s->m + rows;
    s->w = s->l + rows;
    s->k = s->w + KV_TILE * ROWS;
    s->v = s->k + KV_TILE * d;
    s->pos = (int32_t *)(s->v + KV_TILE * d);
    s->lo = s->pos + rows;
    return base;
}

/* w[t][r] = sum_i q[i][r] * k[t][i] for n keys, STEP keys at a time: each load of q feeds 2 * STEP
 * sums. */
static inline void block_scores(float *restrict w, const float *restrict q, const float *restrict k,
                                Py_ssize_t n, Py_ssize_t d) {
    Py_ssize_t t = 0;
    for (; t + STEP <= n; t += STEP) {
        const float *restrict kt = k + t * d;
        vrow a[STEP][2];
#pragma GCC unroll 8
        for (int j = 0; j < STEP; j++) a[j][0] = a[j][1] = (vrow){0};
        for (Py_ssize_t i = 0; i < d; i++) {
            const vrow q0 = load_lanes(q + i * ROWS), q1 = load_lanes(q + i * ROWS + LANES);
#pragma GCC unroll 8
            for (int j = 0; j < STEP; j++) {
                a[j][0] += q0 * kt[j * d + i];
                a[j][1] += q1 * kt[j * d + i];
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < STEP; j++) {
            store_lanes(w + (t + j) * ROWS, a[j][0]);
            store_lanes(w + (t + j) * ROWS + LANES, a[j][1]);
        }
    }
    for (; t < n; t++) {
        vrow a0 = {0}, a1 = {0};
        for (Py_ssize_t i = 0; i < d; i++) {
            a0 += load_lanes(q + i * ROWS) * k[t * d + i];
            a1 += load_lanes(q + i * ROWS + LANES) * k[t * d + i];
        }
        store_lanes(w + t * ROWS, a0);
        store_lanes(w + t * ROWS + LANES, a1);
    }
}

/* The online-softmax step of n keys at positions kv0...: masks the scores in w outside each row's
 * (lo, pos], turns them into weights exp(score - new max), and rescales each row's sum by alpha =
 * exp(old max - new max), which block_accumulate applies to the values' sum. A row that has seen
 * no key yet keeps max -inf, sum 0 and weights 0 (its shift is 0, not -inf: -inf - -inf is NaN). */
static inline void block_weights(float *restrict w, float *restrict m, float *restrict l,
                                 float *restrict alpha, const int32_t *restrict pos,
                                 const int32_t *restrict lo, Py_ssize_t kv0, Py_ssize_t n) {
    float max[ROWS], shift[ROWS];
    memcpy(max, m, sizeof max);
    for (Py_ssize_t t = 0; t < n; t++) {
        const int32_t key = (int32_t)(kv0 + t);
        float *restrict wt = w + t * ROWS;
        for (int r = 0; r < ROWS; r++) {
            wt[r] = key <= pos[r] && key > lo[r] ? wt[r] : -INFINITY;
            max[r] = wt[r] > max[r] ? wt[r] : max[r];
        }
    }
    for (int r = 0; r < ROWS; r++) {
        shift[r] = max[r] == -INFINITY ? 0.0f : max[r];
        alpha[r] = ns_exp_nonpos(m[r] - shift[r]);
        m[r] = max[r];
        l[r] *= alpha[r];
    }
    for (Py_ssize_t t = 0; t < n; t++) {
        float *restrict wt = w + t * ROWS;
        for (int r = 0; r < ROWS; r++) {
            wt[r] = ns_exp_nonpos(wt[r] - shift[r]);
            l[r] += wt[r];
        }
    }
}

/* acc[i][r] = alpha[r] * acc[i][r] + sum_t w[t][r] * v[t][i], STEP values of i at a time, their
 * sums kept in registers across the n keys. */
static inline void block_accumulate(float *restrict acc, const float *restrict w,
                                    const float *restrict v, const float *restrict alpha,
                                    Py_ssize_t n, Py_ssize_t d) {
    const vrow alpha0 = load_lanes(alpha), alpha1 = load_lanes(alpha + LANES);
    Py_ssize_t i = 0;
    for (; i + STEP <= d; i += STEP) {
        vrow a[STEP][2];
#pragma GCC unroll 8
        for (int j = 0; j < STEP; j++) {
            a[j][0] = load_lanes(acc + (i + j) * ROWS) * alpha0;
            a[j][1] = load_lanes(acc + (i + j) * ROWS + LANES) * alpha1;
        }
        for (Py_ssize_t t = 0; t < n; t++) {
            const vrow w0 = load_lanes(w + t * ROWS), w1 = load_lanes(w + t * ROWS + LANES);
            const float *restrict vt = v + t * d + i;
#pragma GCC unroll 8
            for (int j = 0; j < STEP; j++) {
                a[j][0] += w0 * vt[j];
                a[j][1] += w1 * vt[j];
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < STEP; j++) {
            store_lanes(acc + (i + j) * ROWS, a[j][0]);
            store_lanes(acc + (i + j) * ROWS + LANES, a[j][1]);
        }
    }
    for (; i < d; i++) {
        vrow a0 = load_lanes(acc + i * ROWS) * alpha0;
        vrow a1 = load_lanes(acc + i * ROWS + LANES) * alpha1;
        for (Py_ssize_t t = 0; t < n; t++) {
            a0 += load_lanes(w + t * ROWS) * v[t * d + i];
            a1 += load_lanes(w + t * ROWS + LANES) * v[t * d + i];
        }
        store_lanes(acc + i * ROWS, a0);
        store_lanes(acc + i * ROWS + LANES, a1);
    }
}

/* The queries of positions [t0, t1) of the chunk (tile-local rows r = t * group + g), scaled and
 * transposed into the scratch, with their visible ranges; the state of every row reset. Rows past
 * the tile's pad the last block: zero queries at the last position, their results never stored. */
static void load_queries(const prefill_args *a, const scratch *s, Py_ssize_t kvh, Py_ssize_t t0,
                         Py_ssize_t t1) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    const Py_ssize_t start = a->context_len - a->num_tokens; /* position of q's first row */
    const Py_ssize_t rows = s->chunks * ROWS;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const Py_ssize_t t = t0 + r / group, c = r / ROWS, lane = r % ROWS;
        float *q = s->q + c * d * ROWS + lane;
        const Py_ssize_t head = kvh * group + r % group;
        for (Py_ssize_t i = 0; i < d; i++)
            q[i * ROWS] =
                t < t1 ? ns_load(a->q, (t * a->num_q_heads + head) * d + i, a->q_dtype) * a->scale
                       : 0.0f;
        const Py_ssize_t pos = start + (t < t1 ? t : t1 - 1);
        s->pos[r] = (int32_t)pos;
        s->lo[r] = (int32_t)(a->window > 0 ? pos - a->window : -1);
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
    }
    memset(s->acc, 0, (size_t)(rows * d) * sizeof(float));
}

static void store_outputs(const prefill_args *a, const scratch *s, Py_ssize_t kvh, Py_ssize_t t0,
                          Py_ssize_t t1) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    for (Py_ssize_t r = 0; r < (t1 - t0) * group; r++) {
        const Py_ssize_t t = t0 + r / group, c = r / ROWS, lane = r % ROWS;
        const float *acc = s->acc + c * d * ROWS + lane;
        const Py_ssize_t head = kvh * group + r % group;
        const float inv = ns_sink_scale(s->m[r], s->l[r], a->sinks, head);
        const Py_ssize_t at = (t * a->num_q_heads + head) * d;
        for (Py_ssize_t i = 0; i < d; i++)
            ns_store(a->out, at + i, acc[i * ROWS] * inv, a->q_dtype);
    }
}

/* One KV tile (n keys from position kv0) for each block of ROWS rows, trimmed to the keys the
 * block's rows can see: positions grow with r, so a block's first row has the smallest. */
static void kv_tile_step(const prefill_args *a, const scratch *s, Py_ssize_t kv0, Py_ssize_t n) {
    const Py_ssize_t d = a->head_dim;
    float alpha[ROWS];
    for (Py_ssize_t c = 0; c < s->chunks; c++) {
        const int32_t *pos = s->pos + c * ROWS, *lo = s->lo + c * ROWS;
        const Py_ssize_t seen = pos[ROWS - 1] + 1 - kv0 < n ? pos[ROWS - 1] + 1 - kv0 : n;
        if (seen <= 0 || kv0 + seen - 1 <= lo[0]) continue; /* all after, or all before */
        float *m = s->m + c * ROWS, *l = s->l + c * ROWS, *acc = s->acc + c * d * ROWS;
        block_scores(s->w, s->q + c * d * ROWS, s->k, seen, d);
        block_weights(s->w, m, l, alpha, pos, lo, kv0, seen);
        block_accumulate(acc, s->w, s->v, alpha, seen, d);
    }
}

/* Work item: KV head kvh and the chunk's positions [t0, t1). */
static void prefill_item(const prefill_args *a, const scratch *s, Py_ssize_t kvh, Py_ssize_t t0,
                         Py_ssize_t t1) {
    const Py_ssize_t d = a->head_dim, start = a->context_len - a->num_tokens;
    const Py_ssize_t first = start + t0, last = start + t1 - 1;
    load_queries(a, s, kvh, t0, t1);
    /* A KV tile wholly before the first row's window is skipped; tiles start at multiples of
     * KV_TILE whatever the tiling of queries, so that a row's sums do not depend on it. */
    const Py_ssize_t lowest = a->window > 0 && first >= a->window ? first - a->window + 1 : 0;
    for (Py_ssize_t kv0 = lowest / KV_TILE * KV_TILE; kv0 <= last; kv0 += KV_TILE) {
        const Py_ssize_t n = last + 1 - kv0 < KV_TILE ? last + 1 - kv0 : KV_TILE;
        for (Py_ssize_t t = 0; t < n; t++) {
            ns_load_row(s->k + t * d, cache_row(a, a->k, kvh, kv0 + t), d, a->cache_dtype);
            ns_load_row(s->v + t * d, cache_row(a, a->v, kvh, kv0 + t), d, a->cache_dtype);
        }
        kv_tile_step(a, s, kv0, n);
    }
    store_outputs(a, s, kvh, t0, t1);
}

/* Runs with the GIL released; returns 0, or -1 when a thread could not allocate its scratch. */
int nanoserve_prefill_attention(const prefill_args *a, int num_threads) {
    const Py_ssize_t tiles = (a->num_tokens + Q_TILE - 1) / Q_TILE;
    const Py_ssize_t items = tiles * a->num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        scratch s = {0};
        void *base = scratch_alloc(a, &s);
        if (!base) failed = 1;
        /* Later tiles read more keys: hand them out first, one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t item = 0; item < items; item++) {
            const Py_ssize_t tile = tiles - 1 - item / a->num_kv_heads;
            const Py_ssize_t t1 = (tile + 1) * Q_TILE;
            if (base)
                prefill_item(a, &s, item % a->num_kv_heads, tile * Q_TILE,
                             t1 < a->num_tokens ? t1 : a->num_tokens);
        }
        free(base);
    }
    return failed ? -1 : 0;
}

/* Only the table entries the context uses are read, so only they are checked. */
int nanoserve_check_prefill_table(const prefill_args *a) {
    const Py_ssize_t cap = a->table_len * a->block_size;
    if (a->context_len < 1 || a->context_len < a->num_tokens) {
        PyErr_Format(PyExc_ValueError,
                     "context_len = %zd must be at least 1 and at least q's %zd tokens (the "
                     "chunk's own tokens are part of its context)",
                     a->context_len, a->num_tokens);
        return -1;
    }
    if (a->context_len > cap) {
        PyErr_Format(PyExc_ValueError,
                     "context_len = %zd needs %zd block_table entries of %zd tokens, block_table "
                     "has %zd",
                     a->context_len, (a->context_len + a->block_size - 1) / a->block_size,
                     a->block_size, a->table_len);
        return -1;
    }
    for (Py_ssize_t j = 0; j * a->block_size < a->context_len; j++) {
        if (a->block_table[j] < 0 || a->block_table[j] >= a->num_blocks) {
            PyErr_Format(PyExc_ValueError, "block_table[%zd] = %d is outside [0, %zd) (num_blocks)",
                         j, (int)a->block_table[j], a->num_blocks);
            return -1;
        }
    }
    return 0;
}

PyObject *nanoserve_py_check_prefill_table(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"block_table", "table_len",  "context_len",
                             "num_tokens",  "block_size", "num_blocks", NULL};
    unsigned long long table;
    prefill_args a = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Knnnnn", kwlist, &table, &a.table_len,
                                     &a.context_len, &a.num_tokens, &a.block_size, &a.num_blocks))
        return NULL;
    if (a.block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "check_prefill_table: block_size must be at least 1");
        return NULL;
    }
    a.block_table = (const int32_t *)(uintptr_t)table;
    if (nanoserve_check_prefill_table(&a) < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_paged_attention_prefill(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out",         "q",           "k_cache",    "v_cache",
                             "block_table", "num_tokens",  "num_q_heads", "num_kv_heads",
                             "head_dim",    "block_size",  "num_blocks", "table_len",
                             "context_len", "scale",       "q_dtype",    "cache_dtype",
                             "num_threads", "window",      "sinks",    NULL};
    unsigned long long out, q, k, v, table, sinks = 0;
    prefill_args a = {0};
    double scale;
    int num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKKnnnnnnnndiii|nK", kwlist, &out, &q, &k,
                                     &v, &table, &a.num_tokens, &a.num_q_heads, &a.num_kv_heads,
                                     &a.head_dim, &a.block_size, &a.num_blocks, &a.table_len,
                                     &a.context_len, &scale, &a.q_dtype, &a.cache_dtype,
                                     &num_threads, &a.window, &sinks))
        return NULL;
    if ((a.q_dtype != NS_F32 && a.q_dtype != NS_BF16) || !ns_cache_ok(a.cache_dtype, a.head_dim) ||
        a.num_tokens < 0 || a.num_kv_heads < 1 || a.head_dim < 1 ||
        a.block_size < 1 || a.num_q_heads < 1 || a.num_q_heads % a.num_kv_heads != 0 ||
        a.window < 0 || a.context_len > INT32_MAX || num_threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "paged_attention_prefill: inconsistent sizes or dtype codes");
        return NULL;
    }
    a.out = (void *)(uintptr_t)out;
    a.q = (const void *)(uintptr_t)q;
    a.k = (const void *)(uintptr_t)k;
    a.v = (const void *)(uintptr_t)v;
    a.block_table = (const int32_t *)(uintptr_t)table;
    a.sinks = (const float *)(uintptr_t)sinks;
    a.scale = (float)scale;
    if (nanoserve_check_prefill_table(&a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = nanoserve_prefill_attention(&a, num_threads);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
