/* Q6_K (block_q6_K: 128 bytes of low nibbles ql, 64 bytes of 2-bit highs qh, 16 int8 scales, fp16
 * d; 256 values in 16 sub-blocks of 16, value (q - 32) (d sc)): de-quantize a block as gguf does,
 * and the matmul's kernels, one per path (quant_kquants.h: a 32-value sub-block at a time, its two
 * halves' dots scaled on their own). Not quantized here: llama.cpp's quantizer searches the
 * scales.
 *
 * Value l of 32-value sub-block t (half h = t / 4 of the block, u = t % 4): the nibble (low for
 * u < 2, high else) of ql[64 h + 32 (u & 1) + l], bits 2u, 2u + 1 of qh[32 h + l] above it; its
 * scale scales[2t + l / 16]. The int32 dots cannot overflow: |q - 32| <= 32.
 */
#include "quant_kquants.h"

typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d; /* fp16 */
} block_q6_K;
_Static_assert(sizeof(block_q6_K) == 210 && sizeof(block_q6_K) <= NS_MAX_BLOCK_BYTES, "GGUF Q6_K");

/* Sub-block t's ql bytes (their nibble at *shift) and qh bytes (their 2 bits at *hshift). */
static inline const uint8_t *q6_k_sub(const block_q6_K *b, int t, int *shift, const uint8_t **qh,
                                      int *hshift) {
    const int h = t / 4, u = t % 4;
    *shift = 4 * (u >> 1);
    *qh = b->qh + 32 * h;
    *hshift = 2 * u;
    return b->ql + 64 * h + 32 * (u & 1);
}

/* Sub-block t's 32 values q - 32. */
static void q6_k_values(int v[QK], const block_q6_K *b, int t) {
    int shift, hshift;
    const uint8_t *qh;
    const uint8_t *ql = q6_k_sub(b, t, &shift, &qh, &hshift);
    for (int l = 0; l < QK; l++)
        v[l] = (((ql[l] >> shift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
}

static void q6_k_dequantize(float *x, const void *block) {
    const block_q6_K *b = block;
    const float d = ns_f16_to_f32(b->d);
    for (int t = 0; t < KQ_SUBS; t++) {
        int v[QK];
        q6_k_values(v, b, t);
        for (int l = 0; l < QK; l++)
            x[QK * t + l] = (d * (float)b->scales[2 * t + l / 16]) * (float)v[l];
    }
}

/* ---------------------------------------------------------------- portable C */

/* One output at a time, sub-blocks in order; each half's dot exact in integers. */
static void q6_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q6_K *row = (const block_q6_K *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++) {
                const block_q6_K *blk = row + b / KQ_SUBS;
                const int t = (int)(b % KQ_SUBS);
                const float d = ns_f16_to_f32(blk->d);
                int v[QK];
                q6_k_values(v, blk, t);
                for (int half = 0; half < 2; half++) {
                    int32_t dot = 0;
                    for (int l = 16 * half; l < 16 * half + 16; l++) dot += v[l] * x[b * QK + l];
                    acc += (float)dot * ((d * (float)blk->scales[2 * t + half]) * dx[b]);
                }
            }
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
/* ---------------------------------------------------------------- AVX2 */

/* Scale 2t + which (which: 0 or 1) of each row, from g (lane r: a row's scales 4i .. 4i + 3,
 * i = t / 2), sign-extended, as int32 lanes: its byte shifted to the top, then back down. */
AVX2_INLINE __m256i q6_k_scale_avx2(__m256i g, int t, int which) {
    const int byte = 2 * (t & 1) + which;
    return _mm256_srai_epi32(_mm256_slli_epi32(g, 24 - 8 * byte), 24);
}

/* The blocks at w of 8 rows, each sub-block t into s[t]: d sc of its halves and the pairs
 * (NS_BYTE_PAIRS), from one transpose of each 16 bytes of ql, qh and the scales. */
AVX2_INLINE void q6_k_unpack_avx2(strip8 *s, const char *w, size_t stride) {
    const block_q6_K *b = (const block_q6_K *)w;
    __m256 d, unused;
    strip_heads_avx2(&unused, &d, w + offsetof(block_q6_K, d) - 2, stride, 1);
    __m256i sc[4];
    transpose_rows_avx2(sc, (const char *)b->scales, stride);
#pragma GCC unroll 8
    for (int t = 0; t < KQ_SUBS; t++) {
        s[t].d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q6_k_scale_avx2(sc[t / 2], t, 0)));
        s[t].d2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q6_k_scale_avx2(sc[t / 2], t, 1)));
        s[t].m = _mm256_setzero_ps();
    }
    const __m256i nibbles = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3 << 4);
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
        __m256i h[4], h1[4];
        transpose_rows_avx2(h, (const char *)b->qh + 32 * half, stride);
        transpose_rows_avx2(h1, (const char *)b->qh + 32 * half + 16, stride);
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) { /* ql bytes 32k .. 32k + 31: sub-blocks k, k + 2 */
            __m256i g[4], g1[4];
            transpose_rows_avx2(g, (const char *)b->ql + 64 * half + 32 * k, stride);
            transpose_rows_avx2(g1, (const char *)b->ql + 64 * half + 32 * k + 16, stride);
#pragma GCC unroll 2
            for (int u = k; u < 4; u += 2) {
                const int shift = 4 * (u >> 1);
                __m256i v[4], v1[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    /* qh's 2 bits at 2u to bits 4, 5 of each byte */
                    const __m256i hi = u < 2 ? _mm256_slli_epi32(h[i], 4 - 2 * u)
                                            : _mm256_srli_epi32(h[i], 2 * u - 4);
                    const __m256i hi1 = u < 2 ? _mm256_slli_epi32(h1[i], 4 - 2 * u)
                                             : _mm256_srli_epi32(h1[i], 2 * u - 4);
                    const __m256i lo = _mm256_srli_epi32(g[i], shift);
                    const __m256i lo1 = _mm256_srli_epi32(g1[i], shift);
                    v[i] = _mm256_or_si256(_mm256_and_si256(lo, nibbles),
                                           _mm256_and_si256(hi, two));
                    v1[i] = _mm256_or_si256(_mm256_and_si256(lo1, nibbles),
                                            _mm256_and_si256(hi1, two));
                }
                kquant_byte_pairs_avx2(s[4 * half + u].p, v, v1, 32);
            }
        }
    }
}

static const strip8_format Q6_K_AVX2 = {.block_bytes = sizeof(block_q6_K),
                                        .subs = KQ_SUBS,
                                        .unpack_super = q6_k_unpack_avx2,
                                        .halves = 1};

AVX2_KERNEL void q6_k_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx2(a, n0, n1, Q6_K_AVX2);
}

/* ---------------------------------------------------------------- AVX-512 */

/* As q6_k_scale_avx2, 16 rows. */
AVX512_INLINE __m512i q6_k_scale_avx512(__m512i g, int t, int which) {
    const int byte = 2 * (t & 1) + which;
    return _mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 8 * byte), 24);
}

/* As q6_k_unpack_avx2, 16 rows. */
AVX512_INLINE void q6_k_unpack_avx512(strip16 *s, const char *w, size_t stride) {
    const block_q6_K *b = (const block_q6_K *)w;
    __m512 d, unused;
    strip_heads_avx512(&unused, &d, w + offsetof(block_q6_K, d) - 2, stride, 1);
    __m512i sc[4];
    transpose_rows_avx512(sc, (const char *)b->scales, stride);
#pragma GCC unroll 8
    for (int t = 0; t < KQ_SUBS; t++) {
        s[t].d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q6_k_scale_avx512(sc[t / 2], t, 0)));
        s[t].d2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q6_k_scale_avx512(sc[t / 2], t, 1)));
        s[t].m = _mm512_setzero_ps();
    }
    const __m512i nibbles = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3 << 4);
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
        __m512i h[4], h1[4];
        transpose_rows_avx512(h, (const char *)b->qh + 32 * half, stride);
        transpose_rows_avx512(h1, (const char *)b->qh + 32 * half + 16, stride);
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) { /* ql bytes 32k .. 32k + 31: sub-blocks k, k + 2 */
            __m512i g[4], g1[4];
            transpose_rows_avx512(g, (const char *)b->ql + 64 * half + 32 * k, stride);
            transpose_rows_avx512(g1, (const char *)b->ql + 64 * half + 32 * k + 16, stride);
#pragma GCC unroll 2
            for (int u = k; u < 4; u += 2) {
                const int shift = 4 * (u >> 1);
                __m512i v[4], v1[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    /* qh's 2 bits at 2u to bits 4, 5 of each byte */
                    const __m512i hi = u < 2 ? _mm512_slli_epi32(h[i], 4 - 2 * u)
                                            : _mm512_srli_epi32(h[i], 2 * u - 4);
                    const __m512i hi1 = u < 2 ? _mm512_slli_epi32(h1[i], 4 - 2 * u)
                                             : _mm512_srli_epi32(h1[i], 2 * u - 4);
                    const __m512i lo = _mm512_srli_epi32(g[i], shift);
                    const __m512i lo1 = _mm512_srli_epi32(g1[i], shift);
                    v[i] = _mm512_or_si512(_mm512_and_si512(lo, nibbles),
                                           _mm512_and_si512(hi, two));
                    v1[i] = _mm512_or_si512(_mm512_and_si512(lo1, nibbles),
                                            _mm512_and_si512(hi1, two));
                }
                kquant_byte_pairs_avx512(s[4 * half + u].p, v, v1, 32);
            }
        }
    }
}

static const strip16_format Q6_K_AVX512 = {.block_bytes = sizeof(block_q6_K),
                                           .subs = KQ_SUBS,
                                           .unpack_super = q6_k_unpack_avx512,
                                           .halves = 1};

AVX512_KERNEL void q6_k_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q6_K_AVX512, 0);
}

AVX512_KERNEL void q6_k_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q6_K_AVX512, 1);
}
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q6_K_FORMAT = {
    .code = 14, /* GGML_TYPE_Q6_K */
    .name = "q6_k",
    .block_bytes = sizeof(block_q6_K),
    .block_values = QK_K,
    .dequantize = q6_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .matmul = {[NS_PORTABLE] = q6_k_matmul_portable,
#if NS_X86
               [NS_AVX2] = q6_k_matmul_avx2,
               [NS_AVX512] = q6_k_matmul_avx512,
               [NS_AVX512_VNNI] = q6_k_matmul_avx512_vnni
#endif
    },
};
