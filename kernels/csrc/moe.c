/* A sparse mixture-of-experts block (Qwen3-MoE, Mixtral, gpt-oss) in C: its routing and
 * activations, for both paths, and the whole block for the one-call C decode step
 * (decode_step.c).
 *
 * The layer-by-layer path (src/nanoserve/model/moe.py) routes with nanoserve_moe_route too, and
 * multiplies with the same kernels (quant_experts.c's matmul of the chosen experts, or the GEMV
 * for float experts; norm_rope.c's gated product, or gpt-oss's clamped SwiGLU below), so that a
 * row's result is the same bits whichever path its step takes (gpt-oss: src/nanoserve/model/
 * gpt_oss.py, its experts' biases added before the activation and after down). The rest is sparse_moe's arithmetic in float32: the token-expert
 * pairs sorted by expert (stable, as torch.argsort(stable=True)), each pair's output times its
 * weight, and a token's pairs added up in that order from zero (torch's index_add_).
 */
#include "nanoserve.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* No fused multiply-adds (setup.py turns contraction on): a pair's output times its weight is
 * rounded before it is added, as torch rounds it. */
#pragma GCC optimize("fp-contract=off")

/* ---------------------------------------------------------------- torch.topk's choice
 *
 * torch.topk on a CPU (ATen's TopKImpl.h) keeps (value, index) pairs in index order and runs
 * std::partial_sort (where k * 64 <= n) or std::nth_element then std::sort of the first k - 1,
 * with "a before b" meaning a is NaN and b not, or a > b. Neither is stable: at equal values the
 * experts it picks are whatever libstdc++'s algorithms leave in front. Below are those
 * algorithms step for step (GCC's bits/stl_algo.h and stl_heap.h), so that a tie routes to
 * transformers' experts; tests/test_moe.py checks the choice against torch.topk at many ties. */

typedef struct {
    float value;
    int64_t index;
} scored;

static int before(scored a, scored b) {
    return (isnan(a.value) && !isnan(b.value)) || a.value > b.value;
}

static void swap(scored *a, scored *b) {
    const scored t = *a;
    *a = *b;
    *b = t;
}

static Py_ssize_t floor_log2(Py_ssize_t n) {
    Py_ssize_t lg = 0;
    while (n >>= 1) lg++;
    return lg;
}

static void push_heap(scored *first, Py_ssize_t hole, Py_ssize_t top, scored value) {
    Py_ssize_t parent = (hole - 1) / 2;
    while (hole > top && before(first[parent], value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

static void adjust_heap(scored *first, Py_ssize_t hole, Py_ssize_t len, scored value) {
    const Py_ssize_t top = hole;
    Py_ssize_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(first[child], first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

static void make_heap(scored *first, Py_ssize_t len) {
    if (len < 2) return;
    for (Py_ssize_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

static void pop_heap(scored *first, Py_ssize_t len, scored *result) {
    const scored value = *result;
    *result = first[0];
    adjust_heap(first, 0, len, value);
}

static void heap_select(scored *first, Py_ssize_t middle, Py_ssize_t last) {
    make_heap(first, middle);
    for (Py_ssize_t i = middle; i < last; i++)
        if (before(first[i], first[0])) pop_heap(first, middle, first + i);
}

static void insertion_sort(scored *first, Py_ssize_t len) {
    for (Py_ssize_t i = 1; i < len; i++) {
        const scored value = first[i];
        if (before(value, first[0])) {
            memmove(first + 1, first, (size_t)i * sizeof *first);
            first[0] = value;
        } else {
            Py_ssize_t j = i;
            for (; before(value, first[j - 1]); j--) first[j] = first[j - 1];
            first[j] = value;
        }
    }
}

/* The median of a, b, c moved to *result (std::__move_median_to_first). */
static void median_to_first(scored *result, scored *a, scored *b, scored *c) {
    if (before(*a, *b)) {
        if (before(*b, *c)) swap(result, b);
        else if (before(*a, *c)) swap(result, c);
        else swap(result, a);
    } else if (before(*a, *c)) swap(result, a);
    else if (before(*b, *c)) swap(result, c);
    else swap(result, b);
}

static Py_ssize_t partition_pivot(scored *q, Py_ssize_t first, Py_ssize_t last) {
    median_to_first(q + first, q + first + 1, q + first + (last - first) / 2, q + last - 1);
    const scored *pivot = q + first;
    Py_ssize_t lo = first + 1, hi = last;
    for (;;) {
        while (before(q[lo], *pivot)) lo++;
        hi--;
        while (before(*pivot, q[hi])) hi--;
        if (!(lo < hi)) return lo;
        swap(q + lo, q + hi);
        lo++;
    }
}

/* std::nth_element(q, q + nth, q + n). */
static void nth_element(scored *q, Py_ssize_t nth, Py_ssize_t n) {
    Py_ssize_t first = 0, last = n, depth = 2 * floor_log2(n);
    if (nth == n) return;
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(q + first, nth + 1 - first, last - first);
            swap(q + first, q + nth);
            return;
        }
        depth--;
        const Py_ssize_t cut = partition_pivot(q, first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(q + first, last - first);
}

/* std::sort of len pairs: introsort, whose partitioning starts above 16 pairs; up to 16 it is
 * the insertion sort. More than 17 experts a token are sorted by the insertion sort too: the
 * order among the chosen may then differ from torch's, the choice not. */
static void sort_scored(scored *q, Py_ssize_t len) { insertion_sort(q, len); }

/* The top k of q [n] in torch.topk's order, in place at q[0..k). */
static void topk(scored *q, Py_ssize_t n, Py_ssize_t k) {
    if (k * 64 <= n) {
        heap_select(q, k, n);
        for (Py_ssize_t len = k; len > 1; len--) pop_heap(q, len - 1, q + len - 1);
        return;
    }
    nth_element(q, k - 1, n);
    sort_scored(q, k - 1);
}

/* The values of q[0..n) replaced by their softmax, in float32. */
static void softmax(scored *q, Py_ssize_t n) {
    float max = q[0].value, sum = 0.0f;
    for (Py_ssize_t i = 1; i < n; i++) max = q[i].value > max ? q[i].value : max;
    for (Py_ssize_t i = 0; i < n; i++) sum += q[i].value = expf(q[i].value - max);
    for (Py_ssize_t i = 0; i < n; i++) q[i].value /= sum;
}

int nanoserve_moe_route(const float *logits, Py_ssize_t T, Py_ssize_t E, Py_ssize_t k,
                        int normalize, int among_chosen, float *weights, int64_t *experts) {
    scored *q = malloc((size_t)E * sizeof *q);
    if (!q) return -1;
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float *w = weights + t * k;
        int64_t *ids = experts + t * k;
        for (Py_ssize_t e = 0; e < E; e++) q[e].value = l[e], q[e].index = e;
        if (!among_chosen) softmax(q, E);
        topk(q, E, k);
        if (among_chosen) softmax(q, k);
        float chosen = 0.0f;
        for (Py_ssize_t j = 0; j < k; j++) {
            ids[j] = q[j].index;
            chosen += w[j] = q[j].value;
        }
        /* (gpt-oss's softmax among the chosen sums to 1 already: not divided again) */
        for (Py_ssize_t j = 0; normalize && !among_chosen && j < k; j++) w[j] /= chosen;
    }
    free(q);
    return 0;
}

/* The pairs (token t's j-th expert: pair t k + j) sorted by expert, stably: token[s] and weight[s]
 * of the s-th, and groups [G, 3] (expert, first, count) of each chosen expert; returns G. */
static Py_ssize_t sort_pairs(const int64_t *ids, const float *weights, Py_ssize_t P,
                             Py_ssize_t k, Py_ssize_t E, int64_t *token, float *weight,
                             int64_t *groups, int64_t *next) {
    memset(next, 0, (size_t)E * sizeof *next);
    for (Py_ssize_t p = 0; p < P; p++) next[ids[p]]++;
    Py_ssize_t G = 0, start = 0;
    for (Py_ssize_t e = 0; e < E; e++) {
        const int64_t n = next[e];
        if (n) groups[3 * G] = e, groups[3 * G + 1] = start, groups[3 * G + 2] = n, G++;
        next[e] = start;
        start += n;
    }
    for (Py_ssize_t p = 0; p < P; p++) {
        const int64_t s = next[ids[p]]++;
        token[s] = p / k;
        weight[s] = weights[p];
    }
    return G;
}

void nanoserve_clamped_swiglu_rows(float *act, const float *gate_up, Py_ssize_t rows,
                                   Py_ssize_t inter, float alpha, float limit) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *a = act + r * inter;
        for (Py_ssize_t i = 0; i < inter; i++) {
            const float gi = g[i] > limit ? limit : g[i]; /* a NaN stays one, as torch.clamp's */
            const float ui = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
            const float glu = gi * (1.0f / (1.0f + expf(-(gi * alpha))));
            a[i] = (ui + 1.0f) * glu;
        }
    }
}

/* gpt-oss: each pair's expert's bias added to its n values at rows[s] (stride apart). */
static void add_expert_bias(float *rows, Py_ssize_t stride, const float *bias, Py_ssize_t n,
                            const int64_t *groups, Py_ssize_t G) {
    if (!bias) return;
    for (Py_ssize_t g = 0; g < G; g++) {
        const float *b = bias + groups[3 * g] * n;
        for (int64_t s = groups[3 * g + 1]; s < groups[3 * g + 1] + groups[3 * g + 2]; s++)
            for (Py_ssize_t i = 0; i < n; i++) rows[s * stride + i] += b[i];
    }
}

/* Float experts: out[s] (row stride ldo) = in[rows[s]] (rows NULL: in[s]) times the transpose of
 * the group's expert's matrix [N, K] of w, for each group; by the GEMV, a group at a time. */
static int float_experts(float *out, Py_ssize_t ldo, const float *w, const float *in,
                         const int64_t *rows, const int64_t *groups, Py_ssize_t G, Py_ssize_t N,
                         Py_ssize_t K, float *xs, float *ys, int num_threads) {
    for (Py_ssize_t g = 0; g < G; g++) {
        const int64_t e = groups[3 * g], start = groups[3 * g + 1], n = groups[3 * g + 2];
        for (int64_t r = 0; r < n; r++)
            memcpy(xs + r * K, in + (rows ? rows[start + r] : start + r) * K,
                   (size_t)K * sizeof(float));
        if (nanoserve_gemv(ys, xs, w + e * N * K, n, N, K, NS_F32, num_threads) < 0) return -1;
        for (int64_t r = 0; r < n; r++)
            memcpy(out + (start + r) * ldo, ys + r * N, (size_t)N * sizeof(float));
    }
    return 0;
}

/* out (row stride ldo) = the pairs' products with one projection's experts, (format, data). */
static int project(float *out, Py_ssize_t ldo, const void *w, int format, const float *in,
                   Py_ssize_t T, const int64_t *rows, Py_ssize_t P, const int64_t *groups,
                   Py_ssize_t G, Py_ssize_t N, Py_ssize_t K, float *xs, float *ys, int threads) {
    if (!format) return float_experts(out, ldo, w, in, rows, groups, G, N, K, xs, ys, threads);
    float *const outs[1] = {out};
    const char *const ws[1] = {w};
    return nanoserve_quant_experts(outs, ldo, ws, 1, in, T, rows, P, groups, G, N, K, format,
                                   threads);
}

int nanoserve_moe(float *out, const float *x, const float *logits, Py_ssize_t M, Py_ssize_t H,
                  const moe_weights *w, int num_threads) {
    const Py_ssize_t E = w->experts, k = w->top_k, I = w->inter, P = M * k;
    const Py_ssize_t widest = (H > 2 * I ? H : 2 * I) * NS_GEMV_ROWS;
    const size_t n_int = (size_t)(2 * P + 4 * E), n_float = (size_t)(2 * P + 3 * P * I + P * H);
    int64_t *ints = malloc(n_int * sizeof(int64_t));
    float *floats = malloc((n_float + 2 * (size_t)widest) * sizeof(float));
    int rc = -1;
    if (!ints || !floats) goto done;
    int64_t *ids = ints, *token = ids + P, *groups = token + P, *next = groups + 3 * E;
    float *weights = floats, *weight = weights + P, *gate_up = weight + P;
    float *act = gate_up + 2 * P * I, *y = act + P * I, *xs = y + P * H, *ys = xs + widest;
    if (nanoserve_moe_route(logits, M, E, k, w->normalize, w->gpt_oss, weights, ids) < 0)
        goto done;
    const Py_ssize_t G = sort_pairs(ids, weights, P, k, E, token, weight, groups, next);
    if (w->gate_format && w->gate_format == w->up_format) {
        float *const outs[2] = {gate_up, gate_up + I};
        const char *const ws[2] = {w->gate, w->up};
        rc = nanoserve_quant_experts(outs, 2 * I, ws, 2, x, M, token, P, groups, G, I, H,
                                     w->gate_format, num_threads);
    } else {
        rc = project(gate_up, 2 * I, w->gate, w->gate_format, x, M, token, P, groups, G, I, H, xs,
                     ys, num_threads);
        rc |= project(gate_up + I, 2 * I, w->up, w->up_format, x, M, token, P, groups, G, I, H,
                      xs, ys, num_threads);
    }
    if (rc < 0) goto done;
    add_expert_bias(gate_up, 2 * I, w->gate_bias, I, groups, G);
    add_expert_bias(gate_up + I, 2 * I, w->up_bias, I, groups, G);
    if (w->gpt_oss)
        nanoserve_clamped_swiglu_rows(act, gate_up, P, I, w->alpha, w->limit);
    else
        nanoserve_gated_rows(act, gate_up, P, I, NS_F32, 0, num_threads);
    rc = project(y, H, w->down, w->down_format, act, P, NULL, P, groups, G, H, I, xs, ys,
                 num_threads);
    if (rc < 0) goto done;
    add_expert_bias(y, H, w->down_bias, H, groups, G);
    memset(out, 0, (size_t)(M * H) * sizeof(float));
    for (Py_ssize_t s = 0; s < P; s++) {
        float *o = out + token[s] * H;
        const float *ys_row = y + s * H;
        for (Py_ssize_t i = 0; i < H; i++) o[i] += ys_row[i] * weight[s];
    }
done:
    free(ints);
    free(floats);
    return rc;
}

PyObject *nanoserve_py_moe_route(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"logits", "T", "E", "k", "normalize", "weights", "experts",
                             "among_chosen", NULL};
    unsigned long long logits, weights, experts;
    Py_ssize_t T, E, k;
    int normalize, among_chosen = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KnnnpKK|p", kwlist, &logits, &T, &E, &k,
                                     &normalize, &weights, &experts, &among_chosen))
        return NULL;
    if (T < 0 || E < 1 || k < 1 || k > E) {
        PyErr_Format(PyExc_ValueError, "moe_route: [T, E, k] = [%zd, %zd, %zd] out of range", T,
                     E, k);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = nanoserve_moe_route((const float *)(uintptr_t)logits, T, E, k, normalize, among_chosen,
                             (float *)(uintptr_t)weights, (int64_t *)(uintptr_t)experts);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_clamped_swiglu(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"act", "gate_up", "rows", "inter", "alpha", "limit", NULL};
    unsigned long long act, gate_up;
    Py_ssize_t rows, inter;
    float alpha, limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKnnff", kwlist, &act, &gate_up, &rows,
                                     &inter, &alpha, &limit))
        return NULL;
    if (rows < 0 || inter < 0) {
        PyErr_Format(PyExc_ValueError, "clamped_swiglu: rows %zd, inter %zd", rows, inter);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    nanoserve_clamped_swiglu_rows((float *)(uintptr_t)act, (const float *)(uintptr_t)gate_up,
                                  rows, inter, alpha, limit);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}
