/* Q4_K (block_q4_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; 256
 * values in 8 sub-blocks of 32, value q (d sc) - (dmin m)): de-quantize a block as gguf does, and
 * the matmul's kernels, one per path (quant_kquants.h: a sub-block at a time). Not quantized here:
 * llama.cpp's quantizer searches the scales, and files come made by it.
 *
 * Nibbles: bytes 32c .. 32c + 31 of qs hold sub-block 2c in their low nibbles, 2c + 1 in their
 * high ones.
 */
#include "quant_kquants.h"

typedef struct {
    kquant_head h;
    uint8_t qs[QK_K / 2];
} block_q4_K;
_Static_assert(sizeof(block_q4_K) == 144 && sizeof(block_q4_K) <= NS_MAX_BLOCK_BYTES, "GGUF Q4_K");

/* Sub-block j's q: bytes 32 (j / 2) .. of qs, the nibble at `shift`. */
static inline const uint8_t *q4_k_sub(const block_q4_K *b, int j, int *shift) {
    *shift = 4 * (j & 1);
    return b->qs + 32 * (j / 2);
}

static void q4_k_dequantize(float *x, const void *block) {
    const block_q4_K *b = block;
    for (int j = 0; j < KQ_SUBS; j++) {
        float d, neg_m;
        int shift;
        kquant_sub_scales(&b->h, j, &d, &neg_m);
        const uint8_t *q = q4_k_sub(b, j, &shift);
        for (int l = 0; l < QK; l++)
            x[QK * j + l] = ns_unfused(d * (float)((q[l] >> shift) & 15)) + neg_m;
    }
}

/* ---------------------------------------------------------------- portable C */

/* The exact integer dot of sub-block j's q and 32 activations in order. */
static int32_t q4_k_dot(const block_q4_K *b, int j, const int16_t *x) {
    int shift;
    const uint8_t *q = q4_k_sub(b, j, &shift);
    int32_t s = 0;
    for (int l = 0; l < QK; l++) s += ((q[l] >> shift) & 15) * x[l];
    return s;
}

/* One output at a time, sub-blocks in order. */
static void q4_k_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t n = n0; n < n1; n++) {
        const block_q4_K *row = (const block_q4_K *)(a->w + (size_t)n * a->row_bytes);
        for (Py_ssize_t m = 0; m < a->M; m++) {
            const int16_t *x = xq->q + m * nb * QK;
            const float *dx = xq->dx + m * nb, *sx = xq->sx + m * nb;
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < nb; b++) {
                const block_q4_K *blk = row + b / KQ_SUBS;
                const int j = (int)(b % KQ_SUBS);
                float d, neg_m;
                kquant_sub_scales(&blk->h, j, &d, &neg_m);
                acc += (float)q4_k_dot(blk, j, x + b * QK) * (d * dx[b]);
                acc += neg_m * sx[b];
            }
            a->out[m * a->ldo + n] = acc;
        }
    }
}

#if NS_X86
/* ---------------------------------------------------------------- AVX2 */

/* The blocks at w of 8 rows, each sub-block j into s[j]: scales and the pairs (NS_BYTE_PAIRS),
 * from one transpose of each 16 bytes of qs (32 of them hold two sub-blocks). */
AVX2_INLINE void q4_k_unpack_avx2(strip8 *s, const char *w, size_t stride) {
    kquant_heads_avx2(s, w, stride);
    const __m256i nibbles = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const char *q = (const char *)((const block_q4_K *)w)->qs + 32 * c;
        __m256i g[4], g1[4], v[4], v1[4];
        transpose_rows_avx2(g, q, stride);
        transpose_rows_avx2(g1, q + 16, stride);
#pragma GCC unroll 2
        for (int shift = 0; shift <= 4; shift += 4) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_and_si256(_mm256_srli_epi32(g[i], shift), nibbles);
                v1[i] = _mm256_and_si256(_mm256_srli_epi32(g1[i], shift), nibbles);
            }
            kquant_byte_pairs_avx2(s[2 * c + shift / 4].p, v, v1, 0);
        }
    }
}

static const strip8_format Q4_K_AVX2 = {.block_bytes = sizeof(block_q4_K),
                                        .has_min = 1,
                                        .subs = KQ_SUBS,
                                        .unpack_super = q4_k_unpack_avx2};

AVX2_KERNEL void q4_k_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx2(a, n0, n1, Q4_K_AVX2);
}

/* ---------------------------------------------------------------- AVX-512 */

/* As q4_k_unpack_avx2, 16 rows. */
AVX512_INLINE void q4_k_unpack_avx512(strip16 *s, const char *w, size_t stride) {
    kquant_heads_avx512(s, w, stride);
    const __m512i nibbles = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const char *q = (const char *)((const block_q4_K *)w)->qs + 32 * c;
        __m512i g[4], g1[4], v[4], v1[4];
        transpose_rows_avx512(g, q, stride);
        transpose_rows_avx512(g1, q + 16, stride);
#pragma GCC unroll 2
        for (int shift = 0; shift <= 4; shift += 4) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                v[i] = _mm512_and_si512(_mm512_srli_epi32(g[i], shift), nibbles);
                v1[i] = _mm512_and_si512(_mm512_srli_epi32(g1[i], shift), nibbles);
            }
            kquant_byte_pairs_avx512(s[2 * c + shift / 4].p, v, v1, 0);
        }
    }
}

static const strip16_format Q4_K_AVX512 = {.block_bytes = sizeof(block_q4_K),
                                           .has_min = 1,
                                           .subs = KQ_SUBS,
                                           .unpack_super = q4_k_unpack_avx512};

AVX512_KERNEL void q4_k_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q4_K_AVX512, 0);
}

AVX512_KERNEL void q4_k_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    matmul_avx512(a, n0, n1, Q4_K_AVX512, 1);
}
#endif

/* This format's row of the table of formats (quant.c). */
const ns_block_format Q4_K_FORMAT = {
    .code = 12, /* GGML_TYPE_Q4_K */
    .name = "q4_k",
    .block_bytes = sizeof(block_q4_K),
    .block_values = QK_K,
    .dequantize = q4_k_dequantize,
    .pairs = NS_BYTE_PAIRS,
    .matmul = {[NS_PORTABLE] = q4_k_matmul_portable,
#if NS_X86
               [NS_AVX2] = q4_k_matmul_avx2,
               [NS_AVX512] = q4_k_matmul_avx512,
               [NS_AVX512_VNNI] = q4_k_matmul_avx512_vnni
#endif
    },
};
