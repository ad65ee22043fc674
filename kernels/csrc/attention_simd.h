/* The decode attention's block step (attention.h) in SIMD, for the instruction set whose
 * vocabulary quant_isa.h gives the including file. The same arithmetic as paged_attention.c's
 * portable block_step, vectorised across a block's tokens where that one vectorises within a row:
 * a token's dot product with a query head is one vector of partial sums, and STRIP_W of them are
 * added across in one transpose (fv_sums), not one horizontal sum each. Every sum runs in a fixed
 * order, so a row's result depends neither on the batch nor on the threads.
 */
#include "attention.h"
#include "quant_isa.h"

/* exp(x) for x <= 0 (or -inf), lane by lane: ns_exp_nonpos's steps. */
NS_INLINE fvec fv_exp_nonpos(fvec x) {
    const fvec min_x = fv_set(-87.0f), shifter = fv_set(12582912.0f);
    const fvec xc = fv_max(x, min_x);
    const fvec n = fv_sub(fv_fma(xc, fv_set(1.44269504f), shifter), shifter);
    fvec r = fv_sub(xc, fv_mul(n, fv_set(0.693359375f)));
    r = fv_add(r, fv_mul(n, fv_set(2.12194440e-4f)));
    fvec p = fv_set(1.0f / 5040.0f);
    p = fv_fma(p, r, fv_set(1.0f / 720.0f));
    p = fv_fma(p, r, fv_set(1.0f / 120.0f));
    p = fv_fma(p, r, fv_set(1.0f / 24.0f));
    p = fv_fma(p, r, fv_set(1.0f / 6.0f));
    p = fv_fma(p, r, fv_set(0.5f));
    p = fv_fma(p, r, fv_set(1.0f));
    p = fv_fma(p, r, fv_set(1.0f));
    const fvec two_n = iv_as_fv(iv_shl32(iv_add32(fv_to_iv(n), iv_set32(127)), 23));
    return fv_zero_below(x, min_x, fv_mul(p, two_n));
}

/* Element j of a row of dtype (float32, bfloat16 or float16) on: STRIP_W values as float32. */
NS_INLINE fvec row_at(const char *row, Py_ssize_t j, const int dtype) {
    if (dtype == NS_F32) return fv_load((const float *)row + j);
    return widen(row + 2 * j, dtype == NS_BF16);
}

/* Vectors of a key row widened and held at once: a row of up to 128 values on AVX-512. */
enum { KEY_VECS = 8 };

/* sc[g][t] = q[g] . k[t] for every query head g and the rows t of [0, n) (whose other rows give
 * 0), STRIP_W rows at a time: each key row is widened once for all heads, each head's partial
 * sums over the row kept in part [group, STRIP_W, STRIP_W] and added across by fv_sums. */
NS_INLINE void block_scores(const attn_scratch *s, float *part, const char *k, const int dtype,
                            Py_ssize_t n, Py_ssize_t group, const Py_ssize_t d, Py_ssize_t width,
                            const char *next_k, const char *next_v) {
    const size_t row_bytes = (size_t)d * ns_dtype_size(dtype);
    for (Py_ssize_t t0 = 0; t0 < n; t0 += STRIP_W) {
        for (Py_ssize_t i = 0; i < STRIP_W; i++) {
            float *p_i = part + i * STRIP_W;
            if (next_k) /* a row of the next block's keys and values a row of this one's, to L2 */
                for (size_t off = 0; off < row_bytes; off += 64) {
                    __builtin_prefetch(next_k + (t0 + i) * row_bytes + off, 0, 2);
                    __builtin_prefetch(next_v + (t0 + i) * row_bytes + off, 0, 2);
                }
            if (t0 + i >= n) {
                for (Py_ssize_t g = 0; g < group; g++)
                    fv_store(p_i + g * STRIP_W * STRIP_W, fv_zero());
                continue;
            }
            const char *row = k + (size_t)(t0 + i) * row_bytes;
            for (Py_ssize_t j0 = 0; j0 < d; j0 += KEY_VECS * STRIP_W) {
                fvec kr[KEY_VECS];
#pragma GCC unroll 8
                for (int c = 0; c < KEY_VECS; c++)
                    kr[c] = j0 + c * STRIP_W < d ? row_at(row, j0 + c * STRIP_W, dtype) : fv_zero();
                for (Py_ssize_t g = 0; g < group; g++) {
                    const float *q = s->q + g * d + j0;
                    float *p_g = p_i + g * STRIP_W * STRIP_W;
                    fvec p = j0 ? fv_load(p_g) : fv_zero();
#pragma GCC unroll 8
                    for (int c = 0; c < KEY_VECS; c++)
                        if (j0 + c * STRIP_W < d) p = fv_fma(fv_load(q + c * STRIP_W), kr[c], p);
                    fv_store(p_g, p);
                }
            }
        }
        for (Py_ssize_t g = 0; g < group; g++) {
            fvec v[STRIP_W];
#pragma GCC unroll 16
            for (int i = 0; i < STRIP_W; i++) v[i] = fv_load(part + (g * STRIP_W + i) * STRIP_W);
            fv_store(s->scores + g * width + t0, fv_sums(v));
        }
    }
}

/* The scores of row g into its softmax state: masked outside [lo, n), the running max and sum
 * updated; returns alpha, the factor that rescales the old acc. sc: width (bs rounded up to
 * STRIP_W) scores. */
NS_INLINE float block_softmax(const attn_scratch *s, Py_ssize_t g, float *sc, Py_ssize_t lo,
                              Py_ssize_t n, Py_ssize_t width) {
    for (Py_ssize_t t = 0; t < lo; t++) sc[t] = -INFINITY;
    for (Py_ssize_t t = n; t < width; t++) sc[t] = -INFINITY;
    fvec mx = fv_load(sc);
    for (Py_ssize_t t = STRIP_W; t < width; t += STRIP_W) mx = fv_max(mx, fv_load(sc + t));
    const float m_new = fmaxf(fv_hmax(mx), s->m[g]);
    const float alpha = ns_exp_nonpos(s->m[g] - m_new);
    fvec sum = fv_zero();
    const fvec shift = fv_set(m_new);
    for (Py_ssize_t t = 0; t < width; t += STRIP_W) {
        const fvec e = fv_exp_nonpos(fv_sub(fv_load(sc + t), shift));
        fv_store(sc + t, e);
        sum = fv_add(sum, e);
    }
    s->l[g] = s->l[g] * alpha + fv_sum(sum);
    s->m[g] = m_new;
    return alpha;
}

/* For heads [g0, g0 + GT): acc[g] = acc[g] * alpha[g] + sum over t in [lo, n) of p[g][t] v[t]
 * (p: the weights in s->scores), VECS vectors of each head's acc held in registers across the
 * tokens, each value row widened once for the GT heads. */
enum { VALUE_HEADS = 4, VECS = ISA(4, 2) };

NS_INLINE void block_values(const attn_scratch *s, Py_ssize_t g0, const int GT,
                            const float *alpha, const char *v, const int dtype, Py_ssize_t lo,
                            Py_ssize_t n, const Py_ssize_t d, Py_ssize_t width) {
    const size_t row_bytes = (size_t)d * ns_dtype_size(dtype);
    const float *p = s->scores + g0 * width;
    float *acc = s->acc + g0 * d;
    for (Py_ssize_t j0 = 0; j0 < d; j0 += VECS * STRIP_W) {
        fvec r[VALUE_HEADS][VECS];
#pragma GCC unroll 4
        for (int g = 0; g < GT; g++)
#pragma GCC unroll 4
            for (int c = 0; c < VECS; c++)
                r[g][c] = j0 + c * STRIP_W < d
                              ? fv_mul(fv_load(acc + g * d + j0 + c * STRIP_W), fv_set(alpha[g]))
                              : fv_zero();
        for (Py_ssize_t t = lo; t < n; t++) {
            const char *row = v + (size_t)t * row_bytes;
            fvec x[VECS];
#pragma GCC unroll 4
            for (int c = 0; c < VECS; c++)
                x[c] = j0 + c * STRIP_W < d ? row_at(row, j0 + c * STRIP_W, dtype) : fv_zero();
#pragma GCC unroll 4
            for (int g = 0; g < GT; g++) {
                const fvec w = fv_set(p[g * width + t]);
#pragma GCC unroll 4
                for (int c = 0; c < VECS; c++)
                    if (j0 + c * STRIP_W < d) r[g][c] = fv_fma(w, x[c], r[g][c]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < GT; g++)
#pragma GCC unroll 4
            for (int c = 0; c < VECS; c++)
                if (j0 + c * STRIP_W < d) fv_store(acc + g * d + j0 + c * STRIP_W, r[g][c]);
    }
}

NS_INLINE void attn_block(const attn_scratch *s, const char *k, const char *v, const int dtype,
                          Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, const Py_ssize_t d,
                          Py_ssize_t bs, const char *next_k, const char *next_v) {
    const Py_ssize_t width = (bs + STRIP_W - 1) / STRIP_W * STRIP_W;
    float part[NS_ATTN_MAX_GROUP * STRIP_W * STRIP_W] __attribute__((aligned(64)));
    block_scores(s, part, k, dtype, n, group, d, width, n == bs ? next_k : NULL, next_v);
    for (Py_ssize_t g0 = 0; g0 < group; g0 += VALUE_HEADS) {
        const Py_ssize_t gt = group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS;
        float alpha[VALUE_HEADS];
        for (Py_ssize_t g = 0; g < gt; g++)
            alpha[g] = block_softmax(s, g0 + g, s->scores + (g0 + g) * width, lo, n, width);
        if (gt == 4)
            block_values(s, g0, 4, alpha, v, dtype, lo, n, d, width);
        else if (gt == 3)
            block_values(s, g0, 3, alpha, v, dtype, lo, n, d, width);
        else if (gt == 2)
            block_values(s, g0, 2, alpha, v, dtype, lo, n, d, width);
        else
            block_values(s, g0, 1, alpha, v, dtype, lo, n, d, width);
    }
}

NS_INLINE void attn_block_of(const attn_scratch *s, const char *k, const char *v, const int dtype,
                             Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, Py_ssize_t d,
                             Py_ssize_t bs, const char *next_k, const char *next_v) {
    if (d == 64)
        attn_block(s, k, v, dtype, lo, n, group, 64, bs, next_k, next_v);
    else if (d == 128)
        attn_block(s, k, v, dtype, lo, n, group, 128, bs, next_k, next_v);
    else
        attn_block(s, k, v, dtype, lo, n, group, d, bs, next_k, next_v);
}

/* The step for the including file's instruction set, with the common dtypes and head sizes as
 * constants. */
#define ATTN_BLOCK_KERNEL(name)                                                                    \
    NS_KERNEL void name(const attn_scratch *s, const char *k, const char *v, int dtype,           \
                        Py_ssize_t lo, Py_ssize_t n, Py_ssize_t group, Py_ssize_t d,              \
                        Py_ssize_t bs, const char *next_k, const char *next_v) {                  \
        if (dtype == NS_F16)                                                                       \
            attn_block_of(s, k, v, NS_F16, lo, n, group, d, bs, next_k, next_v);                   \
        else if (dtype == NS_BF16)                                                                 \
            attn_block_of(s, k, v, NS_BF16, lo, n, group, d, bs, next_k, next_v);                  \
        else                                                                                       \
            attn_block_of(s, k, v, NS_F32, lo, n, group, d, bs, next_k, next_v);                   \
    }
