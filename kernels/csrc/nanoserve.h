/* The one header of the C kernels (nanoserve.kernels._C): the dtype codes, the number conversions
 * and the constants they share, and each file's entry points for use from the others (decode_step.c
 * runs the kernels back to back without returning to Python) and from the module table (module.c).
 *
 * Tensors arrive as data pointers to contiguous rows. All C entry points but nanoserve_check_tables
 * can run with the GIL released and raise nothing; the Python entry points (nanoserve_py_*) take
 * keyword arguments, parse them, check what would make a kernel read out of bounds, and raise.
 */
#ifndef NANOSERVE_H
#define NANOSERVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <string.h>

/* The dtype codes Python passes (kernels/python/c_backend.py DTYPE_CODES). Float16 is a dtype
 * of paged attention and the KV store only; the other kernels take float32 and bfloat16. Q8_0 is
 * a KV cache format only: each row of head_dim values is head_dim / 32 blocks block_q8_0. */
enum ns_dtype { NS_F32 = 0, NS_BF16 = 1, NS_F16 = 2, NS_Q8_0 = 3 };

/* value j = qs[j] d: ggml's Q8_0 block, of GGUF matrices (quant_q8_0.c) and of the q8_0 KV
 * cache's rows. */
enum { NS_Q8_0_VALUES = 32 };
typedef struct {
    uint16_t d; /* fp16 */
    int8_t qs[NS_Q8_0_VALUES];
} block_q8_0;
_Static_assert(sizeof(block_q8_0) == 34, "GGUF Q8_0");

/* Rows the GEMV (and so the one-call decode step) takes at most; exported as _C.GEMV_ROWS, from
 * which kernels.api.SMALL_LINEAR_MAX_ROWS comes. */
enum { NS_GEMV_ROWS = 4 };
/* Rows the one-call decode step takes at most when every matrix is in GGUF blocks (whose matmul
 * takes any number of rows, each on its own): a speculative verification's rows (decodes and
 * their drafts); exported as _C.STEP_ROWS. */
enum { NS_STEP_ROWS = 16 };

#if defined(__GNUC__)
#define ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define ALWAYS_INLINE inline
#endif

/* Whether dtype is one of the codes above. */
static inline int ns_dtype_ok(int dtype) {
    return dtype == NS_F32 || dtype == NS_BF16 || dtype == NS_F16;
}

/* Bytes of one element of dtype (a float dtype). */
static inline size_t ns_dtype_size(int dtype) { return dtype == NS_F32 ? 4 : 2; }

/* Whether a KV cache of dtype (a float dtype, or q8_0) can hold rows of head_dim values: q8_0
 * takes whole blocks only. */
static inline int ns_cache_ok(int dtype, Py_ssize_t head_dim) {
    return ns_dtype_ok(dtype) || (dtype == NS_Q8_0 && head_dim % NS_Q8_0_VALUES == 0);
}

/* Bytes of a row of n values of dtype (a float dtype; or q8_0, n a multiple of 32). */
static inline size_t ns_row_bytes(int dtype, Py_ssize_t n) {
    if (dtype == NS_Q8_0) return (size_t)(n / NS_Q8_0_VALUES) * sizeof(block_q8_0);
    return (size_t)n * ns_dtype_size(dtype);
}

static inline float ns_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t ns_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

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

/* float16 -> float32, exact. Branch-free (masks, not ternaries) so that a loop over it vectorises.
 * Subnormals go through an int->float conversion, not a denormal multiply, so a flush-denormals
 * mode cannot zero them. */
static inline float ns_f16_to_f32(uint16_t h) {
    uint32_t em = h & 0x7fffu;
    uint32_t is_sub = 0u - (uint32_t)(em < 0x0400u);
    uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00u);
    uint32_t normal = (em << 13) + (112u << 23);
    uint32_t special = (em << 13) | 0x7f800000u;
    uint32_t sub = ns_f32_to_bits((float)em * 0x1p-24f);
    uint32_t mag = (sub & is_sub) | (special & is_special) | (normal & ~(is_sub | is_special));
    return ns_bits_to_f32(mag | ((uint32_t)(h & 0x8000u) << 16));
}

/* float32 -> float16, rounded to nearest even; overflow to inf, NaN kept quiet. */
static inline uint16_t ns_f32_to_f16(float f) {
    uint32_t u = ns_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to inf */
    if (a < 0x38800000u) /* below 2^-14: subnormal half, unit 2^-24, exact scaling then rint */
        return sign | (uint16_t)lrintf(ns_bits_to_f32(a) * 0x1p24f);
    a -= 112u << 23; /* rebias the exponent from 127 to 15 */
    a += 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)(a >> 13);
}

/* exp(x) for x <= 0 (or -inf), about 1 ulp, written so that loops over it vectorise (libm's expf
 * only vectorises under -ffast-math). Shared by the attention kernels, so decode and prefill weigh
 * their scores alike. Cody-Waite reduction x = n ln2 + r, Taylor series in r. */
static inline float ns_exp_nonpos(float x) {
    const float min_x = -87.0f; /* exp(-87) ~ 1.6e-38: the smallest result with a normal 2^n */
    float xc = x < min_x ? min_x : x;
    float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest integer */
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    float two_n = ns_bits_to_f32((uint32_t)((int32_t)n + 127) << 23);
    return x < min_x ? 0.0f : p * two_n;
}

/* Element i of a float32 or bfloat16 array, as float32. */
static inline float ns_load(const void *p, Py_ssize_t i, int dtype) {
    if (dtype == NS_BF16) return ns_bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* n values (a multiple of 32) as q8_0 blocks, as ggml's quantize_row_q8_0_ref: d = max|x| / 127
 * (stored as fp16), q = x * (1 / d) (d before its fp16 rounding) rounded halves away from zero
 * (roundf); d = 0 gives q = 0. */
static inline void ns_q8_0_quantize(block_q8_0 *restrict dst, const float *restrict x,
                                    Py_ssize_t n) {
    for (Py_ssize_t b = 0; b < n / NS_Q8_0_VALUES; b++, x += NS_Q8_0_VALUES) {
        float amax = 0.0f;
        for (int j = 0; j < NS_Q8_0_VALUES; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        dst[b].d = ns_f32_to_f16(d);
        for (int j = 0; j < NS_Q8_0_VALUES; j++) dst[b].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

/* n values (a multiple of 32) of q8_0 blocks as float32, q d: one exact int-to-float conversion
 * and one multiply each, so the AVX-512, AVX2 and scalar loops give the same bits. */
static inline void ns_q8_0_load(float *restrict dst, const block_q8_0 *restrict b, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n / NS_Q8_0_VALUES; i++, dst += NS_Q8_0_VALUES) {
        const float d = ns_f16_to_f32(b[i].d);
#if defined(__AVX512F__)
        const __m512 vd = _mm512_set1_ps(d);
        for (int j = 0; j < NS_Q8_0_VALUES; j += 16) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b[i].qs + j));
            const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
            _mm512_storeu_ps(dst + j, _mm512_mul_ps(x, vd));
        }
#elif defined(__AVX2__)
        const __m256 vd = _mm256_set1_ps(d);
        for (int j = 0; j < NS_Q8_0_VALUES; j += 8) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b[i].qs + j));
            const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(x, vd));
        }
#else
        for (int j = 0; j < NS_Q8_0_VALUES; j++) dst[j] = (float)b[i].qs[j] * d;
#endif
    }
}

/* Widens n values of dtype to float32: a query row, and the KV cache rows the attention kernels
 * widen before they compute (prefill's every row, decode's float16 and q8_0 blocks). float16 by
 * F16C's conversion where the CPU has it: gcc does not vectorise ns_f16_to_f32 as well. */
static inline void ns_load_row(float *restrict dst, const void *restrict src, Py_ssize_t n,
                               int dtype) {
    if (dtype == NS_Q8_0) {
        ns_q8_0_load(dst, (const block_q8_0 *)src, n);
    } else if (dtype == NS_BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (Py_ssize_t i = 0; i < n; i++) dst[i] = ns_bf16_to_f32(s[i]);
    } else if (dtype == NS_F16) {
        const uint16_t *s = (const uint16_t *)src;
        Py_ssize_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = ns_f16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
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

/* The factor that turns an online softmax's weighted sum acc (scores' max m, sum of exp(score -
 * m) l) into the attention output: 1 / l, or with an attention sink (gpt-oss: a learned logit
 * that joins the denominator and weights no value) 1 / (l + exp(sink - m)), rescaled to the
 * larger of m and sink so that no exp overflows. */
static inline float ns_sink_scale(float m, float l, const float *sinks, Py_ssize_t head) {
    if (!sinks) return 1.0f / l;
    const float sink = sinks[head];
    if (sink <= m) return 1.0f / (l + ns_exp_nonpos(sink - m));
    const float e = ns_exp_nonpos(m - sink);
    return e / (l * e + 1.0f);
}

/* paged_attention.c: decode attention of one query token per sequence over the paged KV cache,
 * [num_blocks, num_kv_heads, block_size, head_dim]. Each of dtype (q and out) and cache_dtype (k
 * and v) is float32, bfloat16 or float16; any pair works (kernels/python/api.py allows q of
 * float32 or of the cache's dtype). */
typedef struct {
    void *out;
    const void *q, *k, *v;
    const int32_t *block_tables, *context_lens;
    Py_ssize_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks;
    Py_ssize_t max_blocks_per_seq;
    Py_ssize_t window; /* > 0: attend to the last `window` positions only; 0: to all */
    const float *sinks; /* [num_q_heads] attention sinks (ns_sink_scale), or NULL: none */
    float scale;
    int dtype;       /* of q and out */
    int cache_dtype; /* of k and v */
} decode_args;

/* 0, or -1 when a thread could not allocate its scratch. */
int nanoserve_decode_attention(const decode_args *a, int num_threads);

/* prefill_attention.c: one sequence's chunk of num_tokens queries, at positions context_len -
 * num_tokens ... context_len - 1, attending causally to the paged KV cache (which already holds the
 * chunk's own keys and values); q and out float32 or bfloat16, the cache float32, bfloat16 or
 * float16. */
typedef struct {
    void *out;
    const void *q, *k, *v;
    const int32_t *block_table;
    Py_ssize_t num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks;
    Py_ssize_t table_len, context_len;
    Py_ssize_t window; /* > 0: position p attends to (p - window, p] only; 0: to [0, p] */
    const float *sinks; /* [num_q_heads] attention sinks (ns_sink_scale), or NULL: none */
    float scale;
    int q_dtype, cache_dtype;
} prefill_args;

/* 0, or -1 when a thread could not allocate its scratch. */
int nanoserve_prefill_attention(const prefill_args *a, int num_threads);

/* The value checks of the kernels' index tables, each in one place (here in C: the C paths run
 * them at C speed, and kernels/python/api.py runs the same ones for the torch and Triton paths on
 * CPU tensors). Each returns 0, or -1 with a ValueError set naming the first entry at fault (call
 * with the GIL held). */
/* paged_attention.c: context_lens in [1, max_blocks_per_seq * block_size], and the block_tables
 * entries they use in [0, num_blocks). */
int nanoserve_check_tables(const decode_args *a);
/* prefill_attention.c: context_len in [max(num_tokens, 1), table_len * block_size], and the
 * block_table entries it uses in [0, num_blocks). */
int nanoserve_check_prefill_table(const prefill_args *a);
/* paged_attention.c: slots below num_slots (negative ones, padding rows, are skipped). */
int nanoserve_check_slots(const void *slots, Py_ssize_t n, int slots_are_int64, int64_t num_slots);
/* norm_rope.c: positions in [0, table_rows), the rows of the cos/sin tables. */
int nanoserve_check_positions(const int64_t *positions, Py_ssize_t n, Py_ssize_t table_rows);

/* A layer's KV cache: k_cache and v_cache [num_blocks, num_kv_heads, block_size, head_dim] of
 * dtype (float32, bfloat16 or float16), or of q8_0 rows (ns_row_bytes). */
typedef struct {
    char *k_cache, *v_cache;
    Py_ssize_t num_kv_heads, block_size, head_dim;
    int dtype;
} kv_cache;

/* n values of src_dtype as dst_dtype (each float32, bfloat16 or float16): widened exactly, then
 * narrowed to nearest even, the rounding of torch's .to() (a NaN stays a NaN, its bits may
 * differ). */
static inline void ns_convert(void *dst, int dst_dtype, const void *src, int src_dtype, size_t n) {
    if (dst_dtype == src_dtype) {
        memcpy(dst, src, n * ns_dtype_size(src_dtype));
        return;
    }
    const uint16_t *s16 = (const uint16_t *)src;
    uint16_t *d16 = (uint16_t *)dst;
    for (size_t i = 0; i < n; i++) {
        const float f = src_dtype == NS_BF16  ? ns_bf16_to_f32(s16[i])
                        : src_dtype == NS_F16 ? ns_f16_to_f32(s16[i])
                                              : ((const float *)src)[i];
        if (dst_dtype == NS_BF16)
            d16[i] = ns_f32_to_bf16(f);
        else if (dst_dtype == NS_F16)
            d16[i] = ns_f32_to_f16(f);
        else
            ((float *)dst)[i] = f;
    }
}

/* A cache row of n values of dtype (a float dtype, or q8_0: quantized a block at a time from its
 * float32 widening) from n values of src_dtype (a float dtype). */
static inline void ns_store_row(char *dst, int dtype, const char *src, int src_dtype, size_t n) {
    if (dtype != NS_Q8_0) {
        ns_convert(dst, dtype, src, src_dtype, n);
        return;
    }
    float x[NS_Q8_0_VALUES];
    for (size_t i = 0; i < n; i += NS_Q8_0_VALUES) {
        ns_load_row(x, src + i * ns_dtype_size(src_dtype), NS_Q8_0_VALUES, src_dtype);
        ns_q8_0_quantize((block_q8_0 *)dst + i / NS_Q8_0_VALUES, x, NS_Q8_0_VALUES);
    }
}

/* The KV store, of kernels.store_kv (paged_attention.c) and of the decode step (decode_step.c):
 * one token's key and value, num_kv_heads rows each of src_dtype, into cache slot `slot` = block *
 * block_size + offset, converted to the cache's dtype. A negative slot (a padding row) is skipped;
 * the caller has checked that the others are inside the cache. */
static inline void ns_store_kv_token(const kv_cache *c, const char *key, const char *value,
                                     int src_dtype, int64_t slot) {
    if (slot < 0) return;
    const size_t heads = (size_t)c->num_kv_heads, bs = (size_t)c->block_size;
    const size_t d = (size_t)c->head_dim, dst_row = ns_row_bytes(c->dtype, c->head_dim);
    const size_t src_row = d * ns_dtype_size(src_dtype);
    const size_t blk = (size_t)(slot / c->block_size), off = (size_t)(slot % c->block_size);
    for (size_t h = 0; h < heads; h++) {
        const size_t dst = ((blk * heads + h) * bs + off) * dst_row;
        ns_store_row(c->k_cache + dst, c->dtype, key + h * src_row, src_dtype, d);
        ns_store_row(c->v_cache + dst, c->dtype, value + h * src_row, src_dtype, d);
    }
}

/* linear.c: out[m, n] = sum_k x[m, k] * w[n, k], M <= NS_GEMV_ROWS; 0, or -1 when out of memory. */
int nanoserve_gemv(void *out, const void *x, const void *w, Py_ssize_t M, Py_ssize_t N,
                   Py_ssize_t K, int dtype, int num_threads);

/* quant.c: out [M, N] float32 (row m at out + m ldo, ldo >= N) = x [M, K] float32 times the
 * transpose of w [N, K], a matrix of GGUF blocks of GGML type qtype (a code of quant.c's table of
 * formats); K a multiple of the format's block; x quantized per block of 32 to int16. Each
 * out[m, n] depends on row m of x and row n of w only (bitwise, whatever M, N, the other rows or
 * the thread count). 0, or -1 when out of memory. */
int nanoserve_quant_matmul(float *out, Py_ssize_t ldo, const float *x, const void *w, Py_ssize_t M,
                           Py_ssize_t N, Py_ssize_t K, int qtype, int num_threads);
/* The matrix of GGUF blocks a caller multiplies by next (N x K of GGML type qtype at w; w NULL:
 * none, or not in blocks): each thread's streaming GEMV asks for its share's first rows ahead. */
typedef struct {
    const void *w;
    Py_ssize_t N, K;
    int qtype;
} ns_next;
/* nanoserve_quant_matmul, then the matrix that comes next (NULL: none). */
int nanoserve_quant_matmul_then(float *out, Py_ssize_t ldo, const float *x, const void *w,
                                Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, int qtype,
                                int num_threads, const ns_next *then);
/* quant_experts.c: outs[i] [P, N] float32 (row p at outs[i] + p ldo) = x[rows[p]] (x[p] where rows
 * is NULL) times the transpose of expert e's matrix of ws[i] (experts [E * N, K] of GGUF blocks
 * of GGML type qtype, expert after expert), for each group (e, start, count) of groups [G, 3]
 * and p in [start, start + count); x [T, K] float32; nw 1 or 2 weights of one format. Each
 * output bitwise nanoserve_quant_matmul's. 0, or -1 when out of memory. */
int nanoserve_quant_experts(float *const outs[], Py_ssize_t ldo, const char *const ws[], int nw,
                            const float *x, Py_ssize_t T, const int64_t *rows, Py_ssize_t P,
                            const int64_t *groups, Py_ssize_t G, Py_ssize_t N, Py_ssize_t K,
                            int qtype, int num_threads);

/* moe.c: the routing of a mixture of experts, for each of T rows of router logits [T, E]: the
 * softmax in float32, the top k (at equal scores the experts torch.topk chooses), their
 * weights renormalized to sum to 1 where normalize; or (among_chosen, gpt-oss) the top k logits
 * softmaxed among themselves (normalize then ignored). weights [T, k] float32, experts [T, k]. 0, or -1 when out of
 * memory. */
int nanoserve_moe_route(const float *logits, Py_ssize_t T, Py_ssize_t E, Py_ssize_t k,
                        int normalize, int among_chosen, float *weights, int64_t *experts);

/* moe.c: gpt-oss's activation of rows [gate | up] float32: act = (u + 1) g sigmoid(alpha g),
 * g = gate clamped to at most limit, u = up clamped to [-limit, limit]. */
void nanoserve_clamped_swiglu_rows(float *act, const float *gate_up, Py_ssize_t rows,
                                   Py_ssize_t inter, float alpha, float limit);

/* A sparse mixture-of-experts block's weights (Qwen3-MoE, Mixtral, gpt-oss): each projection's
 * experts one after another, floats (format 0: float32 [E, N, K]) or GGUF blocks of that GGML
 * type. gpt-oss: each expert's biases ([E, N] float32; NULL: none), its routing (softmax among the
 * chosen) and its clamped SwiGLU (alpha and limit). */
typedef struct {
    const void *gate, *up, *down;
    int gate_format, up_format, down_format;
    Py_ssize_t experts, top_k, inter;
    int normalize, gpt_oss;
    const float *gate_bias, *up_bias, *down_bias;
    float alpha, limit;
} moe_weights;

/* moe.c: out [M, H] float32 = the block's output for x [M, H] float32 (normed) whose router
 * logits [M, E] are given: model/moe.py's sparse_moe in float32, bitwise. Float experts take
 * the GEMV: at most NS_GEMV_ROWS rows of an expert. 0, or -1 when out of memory. */
int nanoserve_moe(float *out, const float *x, const float *logits, Py_ssize_t M, Py_ssize_t H,
                  const moe_weights *w, int num_threads);

/* Bytes of one block of the format with GGML type id qtype, or 0 for no format. */
size_t nanoserve_block_bytes(int qtype);

/* norm_rope.c */
void nanoserve_rms_norm_rows(void *out, const void *x, const void *w, Py_ssize_t rows,
                             Py_ssize_t hidden, float eps, int dtype, int num_threads);
void nanoserve_rope_rows(void *qk, const int64_t *positions, const void *cos, const void *sin,
                         Py_ssize_t rows, Py_ssize_t heads, Py_ssize_t head_dim,
                         Py_ssize_t row_stride, int dtype, int num_threads);
void nanoserve_gated_rows(void *act, const void *gate_up, Py_ssize_t rows, Py_ssize_t inter,
                          int dtype, int gelu, int num_threads);

/* The Python entry points, (self, args, kwargs), listed in module.c's method table. */
PyObject *nanoserve_py_paged_attention_decode(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_paged_attention_prefill(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_check_prefill_table(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_store_kv(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_small_linear(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_rms_norm(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_rope(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_gated(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_decode_layers(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_layer_table(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_check_tables(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_check_slots(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_check_positions(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_quant_linear(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_quant_experts(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_moe_route(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_clamped_swiglu(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_copy_rows(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_argmax_rows(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_quantize(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_dequantize(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_set_quant_isa(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *nanoserve_py_quant_isa(PyObject *self, PyObject *unused);
PyObject *nanoserve_py_cpu_quant_isa(PyObject *self, PyObject *unused);
PyObject *nanoserve_py_quant_amx(PyObject *self, PyObject *unused);
/* _C.BLOCK_FORMATS, {name: (GGML type id, block bytes)} of quant.h's table, or NULL with an error
 * set. */
PyObject *nanoserve_block_formats(void);
/* Picks the quantized kernels' path at module load (the CPU's best, capped by NANOSERVE_ISA); 0,
 * or -1 with a ValueError set for an unknown NANOSERVE_ISA. */
int nanoserve_quant_init(void);

#endif
