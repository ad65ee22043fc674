/* Q5_K (block_q5_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 32 bytes of high bits qh,
 * 128 bytes of nibbles qs; 256 values in 8 sub-blocks of 32, value q (d sc) - (dmin m)):
 * de-quantize a block as gguf does, and the matmul's kernels, one per path (quant_kquants.h: a
 * sub-block at a time). Not quantized here: llama.cpp's quantizer searches the scales.
 *
 * Sub-block j's value l: the nibble (low for even j, high for odd) of qs[32 (j / 2) + l], plus
 * 16 times bit j of qh[l].
 */
#include "quant_kquants.h"

typedef struct {
    kquant_head h;
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;
_Static_assert(sizeof(block_q5_K) == 176 && sizeof(block_q5_K) <= NS_MAX_BLOCK_BYTES, "GGUF Q5_K");

/* Value l of sub-block j. */
static inline int q5_k_value(const block_q5_K *b, int j, int l) {
    return ((b->qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15) | (((b->qh[l] >> j) & 1) << 4);
}

static void q5_k_dequantize(float *x, const void *block) {
    const block_q5_K *b = block;
    for (int j = 0; j < KQ_SUBS; j++) {
        float d, neg_m;
        kquant_sub_scales(&b->h, j, &d, &neg_m);
        for (int l = 0; l < QK; l++)
            x[QK * j + l] = ns_unfused(d * (float)q5_k_value(b, j, l)) + neg_m;
    }
}

/* ---------------------------------------------------------------- portable C */

/* One output at a time, sub-blocks in order; each sub-block's dot exact in integers. */
static void q5_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q5_K *row = (const block_q5_K *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb, *sx = xq->sx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++) {
                const block_q5_K *blk = row + b / KQ_SUBS;
                const int j = (int)(b % KQ_SUBS);
                float d, neg_m;
                kquant_sub_scales(&blk->h, j, &d, &neg_m);
                int32_t dot = 0;
                for (int l = 0; l < QK; l++) dot += q5_k_value(blk, j, l) * x[b * QK + l];
                acc += (float)dot * (d * dx[b]);
                acc += neg_m * sx[b];
            }
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
/* ---------------------------------------------------------------- AVX2 */

/* The blocks at w of 8 rows, each sub-block j into s[j]: scales and the pairs (NS_BYTE_PAIRS),
 * from one transpose of each 16 bytes of qh and qs. */
AVX2_INLINE void q5_k_unpack_avx2(strip8 *s, const char *w, size_t stride) {
    const block_q5_K *b = (const block_q5_K *)w;
    kquant_heads_avx2(s, w, stride);
    __m256i h[4], h1[4];
    transpose_rows_avx2(h, (const char *)b->qh, stride);
    transpose_rows_avx2(h1, (const char *)b->qh + 16, stride);
    const __m256i nibbles = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(16);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const char *q = (const char *)b->qs + 32 * c;
        __m256i g[4], g1[4], v[4], v1[4];
        transpose_rows_avx2(g, q, stride);
        transpose_rows_avx2(g1, q + 16, stride);
#pragma GCC unroll 2
        for (int j = 2 * c; j < 2 * c + 2; j++) {
            const int shift = 4 * (j & 1);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                /* bit j of each byte of qh to bit 4, the nibble below it */
                const __m256i hi =
                    j < 4 ? _mm256_slli_epi32(h[i], 4 - j) : _mm256_srli_epi32(h[i], j - 4);
                const __m256i hi1 =
                    j < 4 ? _mm256_slli_epi32(h1[i], 4 - j) : _mm256_srli_epi32(h1[i], j - 4);
                const __m256i lo = _mm256_srli_epi32(g[i], shift);
                const __m256i lo1 = _mm256_srli_epi32(g1[i], shift);
                v[i] = _mm256_or_si256(_mm256_and_si256(lo, nibbles), _mm256_and_si256(hi, bit));
                v1[i] = _mm256_or_si256(_mm256_and_si256(lo1, nibbles), _mm256_and_si256(hi1, bit));
            }
            kquant_byte_pairs_avx2(s[j].p, v, v1, 0);
        }
    }
}

static const strip8_format Q5_K_AVX2 = {.block_bytes = sizeof(block_q5_K),
                                        .has_min = 1,
                                        .subs = KQ_SUBS,
                                        .unpack_super = q5_k_unpack_avx2};

AVX2_KERNEL void q5_k_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx2(a, n0, n1, Q5_K_AVX2);
}

/* ---------------------------------------------------------------- AVX-512 */

/* As q5_k_unpack_avx2, 16 rows. */
AVX512_INLINE void q5_k_unpack_avx512(strip16 *s, const char *w, size_t stride) {
    const block_q5_K *b = (const block_q5_K *)w;
    kquant_heads_avx512(s, w, stride);
    __m512i h[4], h1[4];
    transpose_rows_avx512(h, (const char *)b->qh, stride);
    transpose_rows_avx512(h1, (const char *)b->qh + 16, stride);
    const __m512i nibbles = _mm512_set1_epi8(15), bit = _mm512_set1_epi8(16);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const char *q = (const char *)b->qs + 32 * c;
        __m512i g[4], g1[4], v[4], v1[4];
        transpose_rows_avx512(g, q, stride);
        transpose_rows_avx512(g1, q + 16, stride);
#pragma GCC unroll 2
        for (int j = 2 * c; j < 2 * c + 2; j++) {
            const int shift = 4 * (j & 1);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                /* bit j of each byte of qh to bit 4, the nibble below it */
                const __m512i hi =
                    j < 4 ? _mm512_slli_epi32(h[i], 4 - j) : _mm512_srli_epi32(h[i], j - 4);
                const __m512i hi1 =
                    j < 4 ? _mm512_slli_epi32(h1[i], 4 - j) : _mm512_srli_epi32(h1[i], j - 4);
                const __m512i lo = _mm512_srli_epi32(g[i], shift);
                const __m512i lo1 = _mm512_srli_epi32(g1[i], shift);
                v[i] = _mm512_or_si512(_mm512_and_si512(lo, nibbles), _mm512_and_si512(hi, bit));
                v1[i] = _mm512_or_si512(_mm512_and_si512(lo1, nibbles), _mm512_and_si512(hi1, bit));
            }
            kquant_byte_pairs_avx512(s[j].p, v, v1, 0);
        }
    }
}

static const strip16_format Q5_K_AVX512 = {.block_bytes = sizeof(block_q5_K),
                                           .has_min = 1,
                                           .subs = KQ_SUBS,
                                           .unpack_super = q5_k_unpack_avx512};

AVX512_KERNEL void q5_k_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q5_K_AVX512, 0);
}

AVX512_KERNEL void q5_k_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q5_K_AVX512, 1);
}
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q5_K_FORMAT = {
    .code = 13, /* GGML_TYPE_Q5_K */
    .name = "q5_k",
    .block_bytes = sizeof(block_q5_K),
    .block_values = QK_K,
    .dequantize = q5_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .matmul = {[NS_PORTABLE] = q5_k_matmul_portable,
#if NS_X86
               [NS_AVX2] = q5_k_matmul_avx2,
               [NS_AVX512] = q5_k_matmul_avx512,
               [NS_AVX512_VNNI] = q5_k_matmul_avx512_vnni
#endif
    },
};
