/* Paged-attention decode and KV-cache store on the CPU: plain C11 + OpenMP, CPython C API only.
 *
 * Python passes data pointers, sizes and dtype codes (of q and out, and of the cache) as int
 * keyword arguments (kernels/python/c_backend.py); every tensor is contiguous. Cache layout:
 * [num_blocks, num_kv_heads, block_size, head_dim]. One OpenMP work item is one (sequence, KV
 * head, partition of the context): its query heads are processed together, so each key and value
 * row is read from memory once; the softmax is online, in float32, and bf16/fp16/q8_0 cache
 * values are widened as they are read. A block's step is the SIMD one of the path the quantized
 * kernels take (attention_simd.h: AVX2 or AVX-512, chosen at run time, set_isa included), where
 * the head size and group fit it; else block_step here, written for gcc's auto-vectoriser (check
 * with -fopt-info-vec), no intrinsics but F16C's float16 widening where the CPU has it. No
 * -ffast-math.
 */
#include "attention.h"
#include "quant.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void store_row(void *restrict dst, const float *restrict src, Py_ssize_t n, int dtype) {
    if (dtype == NS_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (Py_ssize_t i = 0; i < n; i++) d[i] = ns_f32_to_bf16(src[i]);
    } else if (dtype == NS_F16) {
        uint16_t *d = (uint16_t *)dst;
        for (Py_ssize_t i = 0; i < n; i++) d[i] = ns_f32_to_f16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Element i of a row of dtype, as float32. Called with a constant dtype, the branches fold away and
 * the widening vectorises with the arithmetic around it. */
static inline float elem(const char *restrict row, Py_ssize_t i, int dtype) {
    if (dtype == NS_BF16) return ns_bf16_to_f32(((const uint16_t *)row)[i]);
    if (dtype == NS_F16) return ns_f16_to_f32(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

typedef attn_scratch scratch;

static float *scratch_alloc(const decode_args *a, scratch *s) {
    Py_ssize_t g = a->num_q_heads / a->num_kv_heads, d = a->head_dim, b = a->block_size;
    const Py_ssize_t width = (b + NS_SCORE_ALIGN - 1) / NS_SCORE_ALIGN * NS_SCORE_ALIGN;
    size_t n = (size_t)(2 * g * d + g * width + 2 * g + 2 * b * d);
    float *base = malloc(n * sizeof(float));
    if (!base) return NULL;
    s->q = base;
    s->acc = s->q + g * d;
    s->scores = s->acc + g * d;
    s->m = s->scores + g * width;
    s->l = s->m + g;
    s->k = s->l + g;
    s->v = s->k + b * d;
    return base;
}

/* The loops below are written for gcc's vectoriser without -ffast-math: a float reduction such as
 * `for (...) sum += x[i]` is summed in order, one lane after the other. Instead each reduction
 * keeps 16 independent partial results (one vector register) and combines them pairwise. */
#define ATTN_LANES 16

static inline float dot(const float *restrict a, const char *restrict b, Py_ssize_t n, int dtype) {
    float part[ATTN_LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + ATTN_LANES <= n; i += ATTN_LANES)
        for (int l = 0; l < ATTN_LANES; l++) part[l] += a[i + l] * elem(b, i + l, dtype);
    for (int l = 0; l < ATTN_LANES && i + l < n; l++) part[l] += a[i + l] * elem(b, i + l, dtype);
    for (int l = 0; l < 8; l++) part[l] += part[l + 8];
    for (int l = 0; l < 4; l++) part[l] += part[l + 4];
    return (part[0] + part[2]) + (part[1] + part[3]);
}

static inline float max_of(const float *restrict x, Py_ssize_t n) {
    float part[ATTN_LANES];
    for (int l = 0; l < ATTN_LANES; l++) part[l] = x[0];
    Py_ssize_t i = 0;
    for (; i + ATTN_LANES <= n; i += ATTN_LANES)
        for (int l = 0; l < ATTN_LANES; l++) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
    for (; i < n; i++) part[0] = x[i] > part[0] ? x[i] : part[0];
    for (int l = 0; l < 8; l++) part[l] = part[l + 8] > part[l] ? part[l + 8] : part[l];
    for (int l = 0; l < 4; l++) part[l] = part[l + 4] > part[l] ? part[l + 4] : part[l];
    float m01 = part[1] > part[0] ? part[1] : part[0], m23 = part[3] > part[2] ? part[3] : part[2];
    return m23 > m01 ? m23 : m01;
}

/* x[t] = exp(x[t] - shift); returns the sum. */
static inline float exp_sum(float *restrict x, float shift, Py_ssize_t n) {
    float part[ATTN_LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + ATTN_LANES <= n; i += ATTN_LANES)
        for (int l = 0; l < ATTN_LANES; l++) {
            x[i + l] = ns_exp_nonpos(x[i + l] - shift);
            part[l] += x[i + l];
        }
    for (; i < n; i++) {
        x[i] = ns_exp_nonpos(x[i] - shift);
        part[0] += x[i];
    }
    for (int l = 0; l < 8; l++) part[l] += part[l + 8];
    for (int l = 0; l < 4; l++) part[l] += part[l + 4];
    return (part[0] + part[2]) + (part[1] + part[3]);
}

/* acc[0:d] += sum_t p[t] * v[t, 0:d], 64 lanes at a time in four 16-lane sums that stay in vector
 * registers across the tokens: updating acc in memory token after token waits on store-to-load
 * forwarding (and gcc keeps one 64-float array in memory). */
static inline void accumulate(float *restrict acc, const float *restrict p,
                              const char *restrict v, Py_ssize_t n, Py_ssize_t d, int dtype) {
    const size_t es = ns_dtype_size(dtype);
    Py_ssize_t i0 = 0;
    for (; i0 + 4 * ATTN_LANES <= d; i0 += 4 * ATTN_LANES) {
        float r0[ATTN_LANES], r1[ATTN_LANES], r2[ATTN_LANES], r3[ATTN_LANES];
        for (int l = 0; l < ATTN_LANES; l++) {
            r0[l] = acc[i0 + l];
            r1[l] = acc[i0 + ATTN_LANES + l];
            r2[l] = acc[i0 + 2 * ATTN_LANES + l];
            r3[l] = acc[i0 + 3 * ATTN_LANES + l];
        }
        for (Py_ssize_t t = 0; t < n; t++) {
            const char *restrict row = v + (size_t)(t * d + i0) * es;
            for (int l = 0; l < ATTN_LANES; l++) {
                r0[l] += p[t] * elem(row, l, dtype);
                r1[l] += p[t] * elem(row, ATTN_LANES + l, dtype);
                r2[l] += p[t] * elem(row, 2 * ATTN_LANES + l, dtype);
                r3[l] += p[t] * elem(row, 3 * ATTN_LANES + l, dtype);
            }
        }
        for (int l = 0; l < ATTN_LANES; l++) {
            acc[i0 + l] = r0[l];
            acc[i0 + ATTN_LANES + l] = r1[l];
            acc[i0 + 2 * ATTN_LANES + l] = r2[l];
            acc[i0 + 3 * ATTN_LANES + l] = r3[l];
        }
    }
    if (d % (4 * ATTN_LANES) == 0) return; /* lets gcc drop the tail where d is a constant */
    for (Py_ssize_t i = i0; i < d; i++) {
        float sum = acc[i];
        for (Py_ssize_t t = 0; t < n; t++) sum += p[t] * elem(v, t * d + i, dtype);
        acc[i] = sum;
    }
}

/* Asks for cache lines of the next block while this one is computed, a row per token: blocks are
 * scattered, so the hardware prefetcher loses the stream at every block boundary. */
static inline void prefetch_rows(const char *k, const char *v, size_t bytes) {
#if defined(__GNUC__)
    for (size_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 2);
        __builtin_prefetch(v + off, 0, 2);
    }
#else
    (void)k, (void)v, (void)bytes;
#endif
}

/* One block of bs key/value rows (a partial last block comes zero-padded, with n valid rows; rows
 * before lo are outside a sliding window): scores of every query head of the group, then the
 * online-softmax update of each. */
static inline void block_step(const scratch *s, const char *restrict k, const char *restrict v,
                              int dtype, Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, Py_ssize_t d,
                              Py_ssize_t bs, const char *next_k, const char *next_v,
                              size_t next_row_bytes) {
    const size_t row_bytes = (size_t)d * ns_dtype_size(dtype);
    for (Py_ssize_t t = 0; t < bs; t++) {
        if (next_k)
            prefetch_rows(next_k + t * next_row_bytes, next_v + t * next_row_bytes, next_row_bytes);
        for (Py_ssize_t g = 0; g < group; g++)
            s->scores[g * bs + t] = dot(s->q + g * d, k + t * row_bytes, d, dtype);
    }
    for (Py_ssize_t g = 0; g < group; g++) {
        float *restrict sc = s->scores + g * bs;
        for (Py_ssize_t t = 0; t < lo; t++) sc[t] = -INFINITY;
        for (Py_ssize_t t = n; t < bs; t++) sc[t] = -INFINITY;
        const float m_new = fmaxf(max_of(sc, bs), s->m[g]);
        const float alpha = ns_exp_nonpos(s->m[g] - m_new);
        s->l[g] = s->l[g] * alpha + exp_sum(sc, m_new, bs);
        s->m[g] = m_new;
        float *restrict acc = s->acc + g * d;
        for (Py_ssize_t i = 0; i < d; i++) acc[i] *= alpha;
        accumulate(acc, sc, v, bs, d, dtype);
    }
}

/* The SIMD block step for this call's path and head size, or NULL: the portable block_step. */
static ns_attn_block_fn simd_block(Py_ssize_t d, Py_ssize_t group) {
#if NS_X86
    const int path = ns_quant_path();
    if (group > NS_ATTN_MAX_GROUP) return NULL;
    if (path >= NS_AVX512 && d % 16 == 0) return ns_attn_block_avx512;
    if (path >= NS_AVX2 && d % 8 == 0) return ns_attn_block_avx2;
#endif
    (void)d, (void)group;
    return NULL;
}

/* Rows [0, n) of a block as float32 in dst, rows [n, bs) zero. */
static inline void load_block(float *restrict dst, const char *src, Py_ssize_t n, Py_ssize_t bs,
                              Py_ssize_t d, int dtype) {
    ns_load_row(dst, src, n * d, dtype);
    memset(dst + n * d, 0, (size_t)((bs - n) * d) * sizeof(float));
}

/* Split-K. A context longer than one partition of PARTITION_TOKENS tokens (rounded up to whole
 * blocks) is read partition by partition, each a work item of its own, so that one long sequence
 * spreads over the threads; each writes its softmax state (running max m, sum l and unnormalised
 * acc per query head) to its row of partials, and a sequence's partitions are then merged in
 * order. The boundaries depend on the context length alone and the merge order is fixed, so a
 * row's output is the same bits alone, in any batch and under any thread count. A context of one
 * partition (after the window) is one work item that writes out itself, with no merge.
 * 512 tokens: a partition is long enough that its setup (the query heads) and merge are little
 * beside its reading, and short enough that a few of them keep every thread busy (measured with
 * bench/experiments/decode_kv_dtype.py). */
enum { PARTITION_TOKENS = 512 };

/* The query heads of KV head kvh of sequence seq over tokens [begin, end) of its context. */
typedef struct {
    Py_ssize_t seq, kvh, begin, end;
    Py_ssize_t partial; /* its row of partials; -1: the whole context, written to out */
} work_item;

/* The partitions of KV head kvh of sequence seq: rows first .. first + count - 1 of partials. */
typedef struct {
    Py_ssize_t seq, kvh, first, count;
} merge_item;

typedef struct {
    work_item *items;
    merge_item *merges;
    float *partials; /* a row per partition work item: acc [group, head_dim], m [group], l [group] */
    Py_ssize_t num_items, num_merges;
} split_plan;

static Py_ssize_t partition_tokens(Py_ssize_t bs) {
    return (PARTITION_TOKENS + bs - 1) / bs * bs;
}

static size_t partial_floats(const decode_args *a) {
    return (size_t)(a->num_q_heads / a->num_kv_heads * (a->head_dim + 2));
}

/* The first position a sequence of ctx tokens attends to. */
static Py_ssize_t window_start(const decode_args *a, Py_ssize_t ctx) {
    return a->window > 0 && ctx > a->window ? ctx - a->window : 0;
}

/* Partitions [first, first + count) of a context: from the one that holds the window's start. */
static void partitions_of(const decode_args *a, Py_ssize_t seq, Py_ssize_t *first,
                          Py_ssize_t *count) {
    const Py_ssize_t ctx = a->context_lens[seq], part = partition_tokens(a->block_size);
    *first = window_start(a, ctx) / part;
    *count = (ctx - 1) / part - *first + 1;
}

/* Appends sequence seq's work items to p; where it has more than one partition, its merges too,
 * its partitions taking rows of partials from *row on. */
static void plan_sequence(const decode_args *a, split_plan *p, Py_ssize_t seq, Py_ssize_t *row) {
    const Py_ssize_t ctx = a->context_lens[seq], start = window_start(a, ctx);
    const Py_ssize_t part = partition_tokens(a->block_size);
    Py_ssize_t first, count;
    partitions_of(a, seq, &first, &count);
    for (Py_ssize_t kvh = 0; kvh < a->num_kv_heads; kvh++) {
        if (count == 1) {
            p->items[p->num_items++] = (work_item){seq, kvh, start, ctx, -1};
            continue;
        }
        p->merges[p->num_merges++] = (merge_item){seq, kvh, *row, count};
        for (Py_ssize_t i = first; i < first + count; i++) {
            const Py_ssize_t begin = i * part > start ? i * part : start;
            const Py_ssize_t end = (i + 1) * part < ctx ? (i + 1) * part : ctx;
            p->items[p->num_items++] = (work_item){seq, kvh, begin, end, (*row)++};
        }
    }
}

static void free_plan(split_plan *p) {
    free(p->items);
    free(p->merges);
    free(p->partials);
}

/* The work items and merges of a call; 0, or -1 when out of memory. */
static int plan_work(const decode_args *a, split_plan *p) {
    *p = (split_plan){0};
    Py_ssize_t items = 0, split_seqs = 0, rows = 0;
    for (Py_ssize_t seq = 0; seq < a->num_seqs; seq++) {
        Py_ssize_t first, count;
        partitions_of(a, seq, &first, &count);
        items += count * a->num_kv_heads;
        split_seqs += count > 1;
        rows += count > 1 ? count * a->num_kv_heads : 0;
    }
    /* (+ 1: no zero-byte malloc, whose NULL would read as out of memory) */
    p->items = malloc((size_t)(items + 1) * sizeof(work_item));
    p->merges = malloc((size_t)(split_seqs * a->num_kv_heads + 1) * sizeof(merge_item));
    p->partials = malloc(((size_t)rows * partial_floats(a) + 1) * sizeof(float));
    if (!p->items || !p->merges || !p->partials) {
        free_plan(p);
        return -1;
    }
    Py_ssize_t row = 0;
    for (Py_ssize_t seq = 0; seq < a->num_seqs; seq++) plan_sequence(a, p, seq, &row);
    return 0;
}

/* Query heads [kvh * group, (kvh + 1) * group) of sequence seq into s->q, scaled, and a fresh
 * softmax state. */
static void start_item(const decode_args *a, const scratch *s, Py_ssize_t seq, Py_ssize_t kvh) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    const size_t es = ns_dtype_size(a->dtype);
    const Py_ssize_t q_off = (seq * a->num_q_heads + kvh * group) * d;
    for (Py_ssize_t g = 0; g < group; g++) {
        float *qrow = s->q + g * d;
        ns_load_row(qrow, (const char *)a->q + (size_t)(q_off + g * d) * es, d, a->dtype);
        for (Py_ssize_t i = 0; i < d; i++) qrow[i] *= a->scale;
        memset(s->acc + g * d, 0, (size_t)d * sizeof(float));
        s->m[g] = -INFINITY;
        s->l[g] = 0.0f;
    }
}

/* The softmax state in s, normalised, as the output rows of its query heads. */
static void finish_item(const decode_args *a, const scratch *s, Py_ssize_t seq, Py_ssize_t kvh) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    const Py_ssize_t out_off = (seq * a->num_q_heads + kvh * group) * d;
    for (Py_ssize_t g = 0; g < group; g++) {
        float *acc = s->acc + g * d;
        const float inv = ns_sink_scale(s->m[g], s->l[g], a->sinks, kvh * group + g);
        for (Py_ssize_t i = 0; i < d; i++) acc[i] *= inv;
        store_row((char *)a->out + (size_t)(out_off + g * d) * ns_dtype_size(a->dtype), acc, d,
                  a->dtype);
    }
}

/* Tokens [begin, end) of sequence seq's cache of KV head kvh into the softmax state of s; begin
 * is at or after the window's start, end a block boundary or the context's end. d, bs and
 * cache_dtype are arguments so that decode_item can pass constants for the common cases. */
static ALWAYS_INLINE void attend(const decode_args *a, const scratch *s, Py_ssize_t seq,
                                 Py_ssize_t kvh, Py_ssize_t begin, Py_ssize_t end,
                                 const Py_ssize_t d, const Py_ssize_t bs, const int cache_dtype) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, ctx = a->context_lens[seq];
    const size_t row_bytes = ns_row_bytes(cache_dtype, d);
    const int32_t *table = a->block_tables + seq * a->max_blocks_per_seq;
    const size_t block_bytes = (size_t)bs * row_bytes;
    const size_t head_bytes = (size_t)kvh * block_bytes;
    const size_t stride = (size_t)a->num_kv_heads * block_bytes; /* between blocks */
    const ns_attn_block_fn simd = s->simd;
    /* The block that holds begin is read whole and its rows before begin masked (a sliding
     * window's start: that block holds a position at or after it, so every block read has a
     * score above -inf). */
    for (Py_ssize_t j = begin / bs; j * bs < end; j++) {
        const Py_ssize_t n = end - j * bs < bs ? end - j * bs : bs;
        const Py_ssize_t lo = j == begin / bs ? begin % bs : 0;
        const char *kb = (const char *)a->k + (size_t)table[j] * stride + head_bytes;
        const char *vb = (const char *)a->v + (size_t)table[j] * stride + head_bytes;
        const char *next_k = NULL, *next_v = NULL;
        if ((j + 1) * bs < ctx) { /* past end too: the next partition's first block */
            next_k = (const char *)a->k + (size_t)table[j + 1] * stride + head_bytes;
            next_v = (const char *)a->v + (size_t)table[j + 1] * stride + head_bytes;
        }
        if (simd) {
            /* The step asks for the next block's rows as it goes, a row of keys and one of
             * values a key it reads: with float16 KV, 8 sequences of 4096 tokens in blocks
             * scattered at random, 30.0-31.1 GB/s on the AMD EPYC, against 20.4-20.9 asking
             * for the block after next whole, into L1, as each block starts. q8_0 rows are
             * widened first, the next block asked for whole. */
            if (cache_dtype == NS_Q8_0) {
                if (next_k) prefetch_rows(next_k, next_v, block_bytes);
                ns_load_row(s->k, kb, n * d, cache_dtype);
                ns_load_row(s->v + lo * d, vb + (size_t)lo * row_bytes, (n - lo) * d, cache_dtype);
                simd(s, (const char *)s->k, (const char *)s->v, NS_F32, lo, n, group, d, bs,
                     NULL, NULL);
            } else {
                simd(s, kb, vb, cache_dtype, lo, n, group, d, bs, next_k, next_v);
            }
        } else if (n == bs && cache_dtype != NS_F16 && cache_dtype != NS_Q8_0) {
            block_step(s, kb, vb, cache_dtype, lo, n, group, d, bs, next_k, next_v, row_bytes);
        } else {
            /* The last, partial block, zero-padded to a whole one; and float16 and q8_0 blocks,
             * whose widening vectorises as a loop of its own but not inside the dot products. */
            load_block(s->k, kb, n, bs, d, cache_dtype);
            load_block(s->v, vb, n, bs, d, cache_dtype);
            block_step(s, (const char *)s->k, (const char *)s->v, NS_F32, lo, n, group, d, bs,
                       next_k, next_v, row_bytes);
        }
    }
}

/* The softmax state of s as a row of partials. */
static void save_partial(const decode_args *a, const scratch *s, float *row) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    memcpy(row, s->acc, (size_t)(group * d) * sizeof(float));
    memcpy(row + group * d, s->m, (size_t)group * sizeof(float));
    memcpy(row + group * d + group, s->l, (size_t)group * sizeof(float));
}

/* One work item: a whole context written to out, or a partition's softmax state to its row of
 * partials. */
static ALWAYS_INLINE void decode_one(const decode_args *a, const scratch *s, const work_item *it,
                                     float *partials, const Py_ssize_t d, const Py_ssize_t bs,
                                     const int cache_dtype) {
    start_item(a, s, it->seq, it->kvh);
    attend(a, s, it->seq, it->kvh, it->begin, it->end, d, bs, cache_dtype);
    if (it->partial < 0)
        finish_item(a, s, it->seq, it->kvh);
    else
        save_partial(a, s, partials + (size_t)it->partial * partial_floats(a));
}

static ALWAYS_INLINE void decode_shape(const decode_args *a, const scratch *s, const work_item *it,
                                       float *partials, const int cache_dtype) {
    const Py_ssize_t d = a->head_dim, bs = a->block_size;
    if (d == 64 && bs == 16)
        decode_one(a, s, it, partials, 64, 16, cache_dtype);
    else if (d == 128 && bs == 16)
        decode_one(a, s, it, partials, 128, 16, cache_dtype);
    else
        decode_one(a, s, it, partials, d, bs, cache_dtype);
}

static void decode_item(const decode_args *a, const scratch *s, const work_item *it,
                        float *partials) {
    if (a->cache_dtype == NS_BF16)
        decode_shape(a, s, it, partials, NS_BF16);
    else if (a->cache_dtype == NS_Q8_0)
        decode_shape(a, s, it, partials, NS_Q8_0);
    else if (a->cache_dtype == NS_F16)
        decode_shape(a, s, it, partials, NS_F16);
    else
        decode_shape(a, s, it, partials, NS_F32);
}

/* The partitions of mi, merged in order into the output rows of its query heads: each partition's
 * l and acc scaled by exp(its m - the largest m). */
static void merge_partitions(const decode_args *a, const scratch *s, const merge_item *mi,
                             const float *partials) {
    const Py_ssize_t group = a->num_q_heads / a->num_kv_heads, d = a->head_dim;
    const size_t width = partial_floats(a);
    const float *rows = partials + (size_t)mi->first * width;
    for (Py_ssize_t g = 0; g < group; g++) {
        float m = -INFINITY, l = 0.0f;
        for (Py_ssize_t i = 0; i < mi->count; i++) m = fmaxf(m, rows[i * width + group * d + g]);
        float *restrict acc = s->acc + g * d;
        memset(acc, 0, (size_t)d * sizeof(float));
        for (Py_ssize_t i = 0; i < mi->count; i++) {
            const float *restrict row = rows + i * width;
            const float w = ns_exp_nonpos(row[group * d + g] - m);
            l += row[group * d + group + g] * w;
            for (Py_ssize_t x = 0; x < d; x++) acc[x] += w * row[g * d + x];
        }
        s->m[g] = m;
        s->l[g] = l;
    }
    finish_item(a, s, mi->seq, mi->kvh);
}

/* Runs with the GIL released; returns 0, or -1 when out of memory. */
int nanoserve_decode_attention(const decode_args *a, int num_threads) {
    split_plan p;
    if (plan_work(a, &p) < 0) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        scratch s = {0};
        float *base = scratch_alloc(a, &s);
        if (!base) failed = 1;
        s.simd = simd_block(a->head_dim, a->num_q_heads / a->num_kv_heads);
        /* Items differ in length (contexts, a last partition): hand them out one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t i = 0; i < p.num_items; i++) {
            if (base) decode_item(a, &s, &p.items[i], p.partials);
        }
        /* (the loop's barrier: every partition is written before a merge reads it) */
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t i = 0; i < p.num_merges; i++) {
            if (base) merge_partitions(a, &s, &p.merges[i], p.partials);
        }
        free(base);
    }
    free_plan(&p);
    return failed ? -1 : 0;
}

/* Only the used table entries are read, so only they are checked. */
int nanoserve_check_tables(const decode_args *a) {
    const Py_ssize_t cap = a->max_blocks_per_seq * a->block_size;
    for (Py_ssize_t seq = 0; seq < a->num_seqs; seq++) {
        const Py_ssize_t ctx = a->context_lens[seq];
        if (ctx < 1 || ctx > cap) {
            PyErr_Format(PyExc_ValueError,
                         "context_lens[%zd] = %zd is outside [1, %zd] "
                         "(max_blocks_per_seq * block_size)",
                         seq, ctx, cap);
            return -1;
        }
        const int32_t *table = a->block_tables + seq * a->max_blocks_per_seq;
        for (Py_ssize_t j = 0; j * a->block_size < ctx; j++) {
            if (table[j] < 0 || table[j] >= a->num_blocks) {
                PyErr_Format(PyExc_ValueError,
                             "block_tables[%zd, %zd] = %d is outside [0, %zd) (num_blocks)", seq, j,
                             (int)table[j], a->num_blocks);
                return -1;
            }
        }
    }
    return 0;
}

PyObject *nanoserve_py_check_tables(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"block_tables", "context_lens", "num_seqs", "max_blocks_per_seq",
                             "block_size", "num_blocks", NULL};
    unsigned long long tables, lens;
    decode_args a = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKnnnn", kwlist, &tables, &lens, &a.num_seqs,
                                     &a.max_blocks_per_seq, &a.block_size, &a.num_blocks))
        return NULL;
    a.block_tables = (const int32_t *)(uintptr_t)tables;
    a.context_lens = (const int32_t *)(uintptr_t)lens;
    if (nanoserve_check_tables(&a) < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_paged_attention_decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "q", "k_cache", "v_cache", "block_tables", "context_lens",
                             "num_seqs", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
                             "num_blocks", "max_blocks_per_seq", "scale", "dtype_code",
                             "cache_dtype_code", "num_threads", "window", "sinks", NULL};
    unsigned long long out, q, k, v, tables, lens, sinks = 0;
    decode_args a = {0};
    double scale;
    int num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKKKnnnnnnndiii|nK", kwlist, &out, &q, &k,
                                     &v, &tables, &lens, &a.num_seqs, &a.num_q_heads,
                                     &a.num_kv_heads, &a.head_dim, &a.block_size, &a.num_blocks,
                                     &a.max_blocks_per_seq, &scale, &a.dtype, &a.cache_dtype,
                                     &num_threads, &a.window, &sinks))
        return NULL;
    if (!ns_dtype_ok(a.dtype) || !ns_cache_ok(a.cache_dtype, a.head_dim) || a.num_kv_heads < 1 ||
        a.head_dim < 1 || a.window < 0 || a.block_size < 1 ||
        a.num_q_heads % a.num_kv_heads != 0 || num_threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "paged_attention_decode: inconsistent sizes or dtype code");
        return NULL;
    }
    a.out = (void *)(uintptr_t)out;
    a.q = (const void *)(uintptr_t)q;
    a.k = (const void *)(uintptr_t)k;
    a.v = (const void *)(uintptr_t)v;
    a.block_tables = (const int32_t *)(uintptr_t)tables;
    a.context_lens = (const int32_t *)(uintptr_t)lens;
    a.sinks = (const float *)(uintptr_t)sinks;
    a.scale = (float)scale;
    if (nanoserve_check_tables(&a) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = nanoserve_decode_attention(&a, num_threads);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Slot i of an int64 or int32 slot mapping. */
static inline int64_t slot_at(const void *slots, Py_ssize_t i, int slots_are_int64) {
    return slots_are_int64 ? ((const int64_t *)slots)[i] : ((const int32_t *)slots)[i];
}

int nanoserve_check_slots(const void *slots, Py_ssize_t n, int slots_are_int64, int64_t num_slots) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t slot = slot_at(slots, i, slots_are_int64);
        if (slot >= num_slots) {
            PyErr_Format(PyExc_ValueError,
                         "slot_mapping[%zd] = %lld is outside [0, %lld) (num_blocks * block_size)",
                         i, (long long)slot, (long long)num_slots);
            return -1;
        }
    }
    return 0;
}

PyObject *nanoserve_py_check_slots(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"slot_mapping", "num_tokens", "slots_are_int64", "num_slots", NULL};
    unsigned long long slots;
    Py_ssize_t n;
    int is64;
    long long num_slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KniL", kwlist, &slots, &n, &is64,
                                     &num_slots) ||
        nanoserve_check_slots((const void *)(uintptr_t)slots, n, is64, num_slots) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *nanoserve_py_store_kv(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"key", "value", "k_cache", "v_cache", "slot_mapping", "num_tokens",
                             "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype_code",
                             "cache_dtype_code", "slots_are_int64", NULL};
    unsigned long long key, value, k_cache, v_cache, slots;
    Py_ssize_t num_tokens, num_blocks;
    kv_cache c;
    int dtype, slots_are_int64;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKKnnnnniii", kwlist, &key, &value,
                                     &k_cache, &v_cache, &slots, &num_tokens, &c.num_kv_heads,
                                     &c.head_dim, &c.block_size, &num_blocks, &dtype, &c.dtype,
                                     &slots_are_int64))
        return NULL;
    if (!ns_dtype_ok(dtype) || !ns_cache_ok(c.dtype, c.head_dim)) {
        PyErr_SetString(PyExc_ValueError, "store_kv: unknown dtype code, or a q8_0 cache's "
                                          "head_dim not a multiple of 32");
        return NULL;
    }
    const void *slot_mapping = (const void *)(uintptr_t)slots;
    if (nanoserve_check_slots(slot_mapping, num_tokens, slots_are_int64,
                              (int64_t)num_blocks * c.block_size) < 0)
        return NULL;
    c.k_cache = (char *)(uintptr_t)k_cache;
    c.v_cache = (char *)(uintptr_t)v_cache;
    const size_t token_bytes = (size_t)(c.num_kv_heads * c.head_dim) * ns_dtype_size(dtype);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < num_tokens; i++)
        ns_store_kv_token(&c, (const char *)(uintptr_t)key + (size_t)i * token_bytes,
                          (const char *)(uintptr_t)value + (size_t)i * token_bytes, dtype,
                          slot_at(slot_mapping, i, slots_are_int64));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}
