/* What paged_attention.c's decode shares with its SIMD block steps (attention_simd.h, compiled
 * once per instruction set): a thread's float32 scratch and softmax state, and the step of one
 * block of the cache.
 */
#ifndef NANOSERVE_ATTENTION_H
#define NANOSERVE_ATTENTION_H

#include "nanoserve.h"

/* A block's scores are computed 16 at a time (a vector's lanes), so a row of scores holds the
 * block size rounded up to this. */
enum { NS_SCORE_ALIGN = 16 };

typedef struct attn_scratch attn_scratch;

/* One block's online-softmax step for every query head of the group: k and v hold the block's
 * rows ([block_size, d], rows [0, n) valid) of dtype float32, bfloat16 or float16; rows before lo
 * are outside a sliding window. next_k and next_v: the next block's rows (of dtype too), asked
 * for as the step goes, or NULL. */
typedef void (*ns_attn_block_fn)(const attn_scratch *s, const char *k, const char *v, int dtype,
                                 Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, Py_ssize_t d,
                                 Py_ssize_t bs, const char *next_k, const char *next_v);

/* Per-thread float32 scratch, sized once per call. */
struct attn_scratch {
    float *q;      /* [group, head_dim], pre-scaled */
    float *acc;    /* [group, head_dim] */
    float *scores; /* [group, block_size rounded up to NS_SCORE_ALIGN] */
    float *m, *l;  /* [group] running max and sum */
    float *k, *v;  /* [block_size, head_dim] a block widened to float32 */
    ns_attn_block_fn simd; /* the SIMD step for the call's path, or NULL: the portable one */
};

/* The SIMD steps take groups of up to this many query heads per KV head (gpt-oss and Qwen3-MoE
 * have 8, Llama 3 4). */
enum { NS_ATTN_MAX_GROUP = 16 };

/* attention_avx2.c, attention_avx512.c: for head_dim a multiple of 8 (AVX2) or 16 (AVX-512). */
void ns_attn_block_avx2(const attn_scratch *s, const char *k, const char *v, int dtype,
                        Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, Py_ssize_t d, Py_ssize_t bs,
                        const char *next_k, const char *next_v);
void ns_attn_block_avx512(const attn_scratch *s, const char *k, const char *v, int dtype,
                          Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, Py_ssize_t d,
                          Py_ssize_t bs, const char *next_k, const char *next_v);

#endif
