/* The AVX2 (with FMA and F16C) kernels of the quantized matmul: the scheme of
 * quant_strips_avx512.h (see there) with strips of 8 output columns a register and vpmaddwd +
 * vpaddd for the dot steps; the driver each format's file instantiates with its block unpacking
 * (q8_0_matmul_avx2 and the others). Built with target attributes, not build flags, so that it is
 * there whatever -march the module is built for and runs only where quant.c found the CPU able.
 * Without VNNI the two instructions (vpmaddwd + vpaddd) per 16 products bound the dot steps.
 */
#ifndef NANOSERVE_QUANT_STRIPS_AVX2_H
#define NANOSERVE_QUANT_STRIPS_AVX2_H

#include "quant.h"

#if NS_X86
#include <immintrin.h>
#include <stdlib.h>

#define AVX2_TARGET "avx2,fma,f16c"
#define AVX2_INLINE static inline __attribute__((target(AVX2_TARGET), always_inline))
/* A format's kernel on this path (its row of the table of formats points to it). */
#define AVX2_KERNEL static __attribute__((target(AVX2_TARGET)))

/* 16 registers: 3 x 2 tiles take 6 int32 and 6 float accumulators, 2 weights and a broadcast. */
enum { MR_AVX2 = 3, NR_AVX2 = 2 };

/* One block of a strip, unpacked: pairs p[j], lane c two values of column c's block as int16;
 * each column's d and m (Q4_1). */
typedef struct {
    __m256i p[16];
    __m256 d, m, d2; /* d2: Q6_K's scale of values 16..31 (halves) */
} strip8;

/* What the driver needs of a format (as strip16_format): unpack(s, w, stride) unpacks the blocks
 * at w of 8 rows of W (row c's at w + c stride); has_min: Q4_1's m dx sum(q) is added. */
typedef struct {
    void (*unpack)(strip8 *s, const char *w, size_t stride);
    size_t block_bytes;
    int has_min;
    /* K-quants: blocks of subs > 1 sub-blocks of 32 values (at most QK_K / QK), unpacked
     * instead by unpack_super, all at once into s[0 .. subs - 1] (each byte of W transposed
     * once); halves (Q6_K): values 0..15 and 16..31 of a sub-block have their own scales, d and
     * d2, each half's dot scaled on its own. */
    int subs;
    void (*unpack_super)(strip8 *s, const char *w, size_t stride);
    int halves;
} strip8_format;

/* 8 rows' 16 bytes (row r at src + r * stride) as g[q], lane r row r's bytes 4q..4q+3: rows r
 * and r + 4 in the halves of one register, then a 4 x 4 transpose of dwords within each half. */
AVX2_INLINE void transpose_rows_avx2(__m256i g[4], const char *src, size_t stride) {
    __m256i y[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        y[i] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(src + (size_t)i * stride))),
            _mm_loadu_si128((const __m128i *)(src + (size_t)(i + 4) * stride)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
    g[0] = _mm256_unpacklo_epi64(t0, t2);
    g[1] = _mm256_unpackhi_epi64(t0, t2);
    g[2] = _mm256_unpacklo_epi64(t1, t3);
    g[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* Each of 8 rows' block d (and m if has_min): the 32 bits at each block's start, assembled in
 * registers, their 16-bit halves packed and widened. */
AVX2_INLINE void strip_heads_avx2(__m256 *d, __m256 *m, const char *w, size_t stride,
                                  const int has_min) {
    uint32_t h[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) memcpy(&h[c], w + (size_t)c * stride, 4);
    const __m256i v = _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4],
                                        (int)h[5], (int)h[6], (int)h[7]);
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    /* packus of values under 2^16 keeps them; per 128-bit half, so the halves are put together. */
    const __m256i ds = _mm256_packus_epi32(_mm256_and_si256(v, low), _mm256_setzero_si256());
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(ds, 0x08)));
    if (!has_min) {
        *m = _mm256_setzero_ps();
        return;
    }
    const __m256i ms = _mm256_packus_epi32(_mm256_srli_epi32(v, 16), _mm256_setzero_si256());
    *m = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(ms, 0x08)));
}

/* The pairs of a 4-bit block from g (transpose_rows_avx2 of its 16 bytes of nibbles), less
 * zero_point (Q4_0's 8), in the order of nibble_pairs_avx512 (NS_NIBBLE_PAIRS). */
AVX2_INLINE void nibble_pairs_avx2(__m256i p[16], const __m256i g[4], const int zero_point) {
    const __m256i nibbles = _mm256_set1_epi32(0x000F000F), zp = _mm256_set1_epi16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_and_si256(_mm256_srli_epi32(g[q], 4 * i), nibbles);
            p[4 * q + i] = zero_point ? _mm256_sub_epi16(v, zp) : v;
        }
}

/* v's first n lanes to out. */
AVX2_INLINE void store_cols_avx2(float *out, int n, __m256 v) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
}

/* The unpacking for the first n < 8 rows, the others zeros (copied, so nothing past W is read). */
AVX2_INLINE void unpack_strip_edge_avx2(strip8 *s, const char *w, size_t stride, int n,
                                        const strip8_format f) {
    _Alignas(64) char rows[8][NS_MAX_BLOCK_BYTES] = {{0}};
    for (int c = 0; c < n; c++) memcpy(rows[c], w + (size_t)c * stride, f.block_bytes);
    f.unpack(s, rows[0], sizeof rows[0]);
}

/* Block b (32 values) of the 8 rows of W from row w (the last strip's first n of them) into
 * s; of a K-quant, where b starts a super-block, its sub-blocks into s[0 .. subs - 1] (the
 * callers skip the others). */
AVX2_INLINE void unpack_block_avx2(strip8 *s, const char *w, size_t stride, Py_ssize_t b,
                                   int n, const strip8_format f) {
    if (f.subs <= 1) {
        w += (size_t)b * f.block_bytes;
        if (n < 8)
            unpack_strip_edge_avx2(s, w, stride, n, f);
        else
            f.unpack(s, w, stride);
        return;
    }
    w += (size_t)(b / f.subs) * f.block_bytes;
    if (n == 8) {
        f.unpack_super(s, w, stride);
        return;
    }
    _Alignas(64) char rows[8][NS_MAX_BLOCK_BYTES] = {{0}};
    for (int c = 0; c < n; c++) memcpy(rows[c], w + (size_t)c * stride, f.block_bytes);
    f.unpack_super(s, rows[0], sizeof rows[0]);
}

/* acc[r][c] += dot[r][c] scaled: by the strips' d (or d2, Q6_K's second half) times dx, plus
 * m sx where the format has a min. */
AVX2_INLINE void scale_dots_avx2(__m256 acc[4][3], __m256i dot[4][3],
                                const strip8 *const s[3], const ns_xq *xq, Py_ssize_t r0,
                                const int mr, const int nr, Py_ssize_t b, const int second_half,
                                const int has_min) {
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        const Py_ssize_t at = (r0 + r) * xq->blocks + b;
        const __m256 dx = _mm256_set1_ps(xq->dx[at]), sx = _mm256_set1_ps(xq->sx[at]);
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) {
            const __m256 d = second_half ? s[c]->d2 : s[c]->d;
            acc[r][c] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][c]), _mm256_mul_ps(d, dx), acc[r][c]);
            if (has_min) acc[r][c] = _mm256_fmadd_ps(s[c]->m, sx, acc[r][c]);
        }
    }
}

/* acc[r][c] over block b: rows r0 .. r0 + mr of x against strips s[c] (their block b), c < nr. */
AVX2_INLINE void block_step_avx2(__m256 acc[4][3], const strip8 *const s[3], const ns_xq *xq,
                                 Py_ssize_t r0, const int mr, const int nr, Py_ssize_t b,
                                 const strip8_format f) {
    __m256i dot[4][3];
    const Py_ssize_t q_stride = xq->blocks * QK;
    const int16_t *x = xq->q + r0 * q_stride + b * QK;
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) dot[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        if (f.halves && j == 8) { /* Q6_K: values 0..15 done, scaled by d */
            scale_dots_avx2(acc, dot, s, xq, r0, mr, nr, b, 0, 0);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
                for (int c = 0; c < nr; c++) dot[r][c] = _mm256_setzero_si256();
        }
        __m256i w[3];
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) w[c] = s[c]->p[j];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * q_stride + 2 * j, 4);
            const __m256i xb = _mm256_set1_epi32(pair);
#pragma GCC unroll 3
            for (int c = 0; c < nr; c++)
                dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(w[c], xb));
        }
    }
    scale_dots_avx2(acc, dot, s, xq, r0, mr, nr, b, f.halves, f.has_min);
}

/* Rows r0 .. r0 + mr by the nr strips from column c0 (the last one `last` columns wide), over all
 * of K. The strips' blocks come from panel (strip c's block b at panel[c * nb + b]) if given,
 * else are unpacked from W block by block, the next strips' rows prefetched meanwhile. */
AVX2_INLINE void strip_tile_avx2(const ns_qmm *a, const strip8 *panel, Py_ssize_t r0,
                                 const int mr, Py_ssize_t c0, const int nr, int last,
                                 const strip8_format f) {
    const Py_ssize_t nb = a->K / QK;
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) acc[r][c] = _mm256_setzero_ps();
    strip8 own[3], super[3][QK_K / QK]; /* super: a K-quant's super-blocks */
    const strip8 *s[3] = {own, own + 1, own + 2};
    /* The next strips' rows on their way in while this one computes: into L1 or L2 as on
     * AVX-512 (quant_strips_avx512.h). */
    const Py_ssize_t after = c0 + 8 * nr, ahead = a->N - after < 8 * nr ? a->N - after : 8 * nr;
    const char *next = a->w + (size_t)(ahead > 0 ? after : 0) * a->row_bytes;
    const Py_ssize_t lines = ahead > 0 ? (Py_ssize_t)((size_t)ahead * a->row_bytes / 64) : 0;
    const int into_l1 = lines * 64 <= NS_PREFETCH_L1_BYTES;
    for (Py_ssize_t b = 0; b < nb; b++) {
        for (Py_ssize_t l = b * lines / nb; !panel && l < (b + 1) * lines / nb; l++) {
            if (into_l1)
                _mm_prefetch(next + 64 * l, _MM_HINT_T0);
            else
                _mm_prefetch(next + 64 * l, _MM_HINT_T1);
        }
        for (int c = 0; c < nr; c++) {
            if (panel) {
                s[c] = panel + c * nb + b;
                continue;
            }
            const char *w = a->w + (size_t)(c0 + 8 * c) * a->row_bytes;
            const int n = c == nr - 1 ? last : 8;
            if (f.subs <= 1) {
                unpack_block_avx2(own + c, w, a->row_bytes, b, n, f);
                continue;
            }
            if (b % f.subs == 0) unpack_block_avx2(super[c], w, a->row_bytes, b, n, f);
            s[c] = &super[c][b % f.subs];
        }
        block_step_avx2(acc, s, a->x, r0, mr, nr, b, f);
    }
    for (int c = 0; c < nr; c++)
        for (int r = 0; r < mr; r++)
            store_cols_avx2(a->out + (r0 + r) * a->ldo + c0 + 8 * c, c == nr - 1 ? last : 8,
                            acc[r][c]);
}

/* strip_tile_avx2 with nr (1..NR_AVX2) a constant. */
AVX2_INLINE void strip_tile_nr_avx2(const ns_qmm *a, const strip8 *panel, Py_ssize_t r0,
                                    const int mr, Py_ssize_t c0, int nr, int last,
                                    const strip8_format f) {
    if (nr == 1)
        strip_tile_avx2(a, panel, r0, mr, c0, 1, last, f);
    else
        strip_tile_avx2(a, panel, r0, mr, c0, 2, last, f);
}

/* strip_tile_avx2 with mr (1..NS_GEMV_ROWS: the GEMV's 4 rows are one tile) and nr (1..NR_AVX2)
 * constants. */
AVX2_INLINE void strip_tile_any_avx2(const ns_qmm *a, const strip8 *panel, Py_ssize_t r0, int mr,
                                     Py_ssize_t c0, int nr, int last, const strip8_format f) {
    switch (mr) {
    case 1: strip_tile_nr_avx2(a, panel, r0, 1, c0, nr, last, f); break;
    case 2: strip_tile_nr_avx2(a, panel, r0, 2, c0, nr, last, f); break;
    case 3: strip_tile_nr_avx2(a, panel, r0, 3, c0, nr, last, f); break;
    default: strip_tile_nr_avx2(a, panel, r0, 4, c0, nr, last, f); break;
    }
}

/* out[r0 .. r0 + mr, n0 .. n1] straight from W (mr <= NS_GEMV_ROWS), a strip at a time: each
 * block unpacked once for all the rows, W read once. */
AVX2_INLINE void strip_gemv_avx2(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n0,
                                 Py_ssize_t n1, const strip8_format f) {
    for (Py_ssize_t c0 = n0; c0 < n1; c0 += 8)
        strip_tile_any_avx2(a, NULL, r0, mr, c0, 1, n1 - c0 < 8 ? (int)(n1 - c0) : 8, f);
}

/* Columns n0 + 8 p .. of every block, strips p..pe, unpacked into panel. */
AVX2_INLINE void unpack_panel_avx2(strip8 *panel, const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                   Py_ssize_t p, Py_ssize_t pe, const strip8_format f) {
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t s = p; s < pe; s++) {
        const Py_ssize_t c0 = n0 + 8 * s;
        const int n = n1 - c0 < 8 ? (int)(n1 - c0) : 8;
        for (Py_ssize_t b = 0; b < nb; b++) {
            const char *w = a->w + (size_t)c0 * a->row_bytes;
            if (f.subs <= 1 || b % f.subs == 0) /* a super-block fills subs blocks */
                unpack_block_avx2(panel + (s - p) * nb + b, w, a->row_bytes, b, n, f);
        }
    }
}

/* Many rows: panels of whole strips unpacked once into a buffer of at most NS_PANEL_BYTES, under
 * every tile of MR_AVX2 rows, NR_AVX2 strips at a time (as strip_gemm_avx512). */
AVX2_INLINE void strip_gemm_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                 const strip8_format f) {
    const Py_ssize_t nb = a->K / QK, strips = (n1 - n0 + 7) / 8;
    Py_ssize_t width = (Py_ssize_t)(NS_PANEL_BYTES / ((size_t)nb * sizeof(strip8)));
    width = width / NR_AVX2 * NR_AVX2;
    width = width < NR_AVX2 ? NR_AVX2 : width < strips ? width : strips; /* strips a panel */
    strip8 *panel = aligned_alloc(64, (size_t)(width * nb) * sizeof(strip8));
    for (Py_ssize_t r0 = 0; !panel && r0 < a->M; r0 += MR_AVX2)
        strip_gemv_avx2(a, r0, a->M - r0 < MR_AVX2 ? (int)(a->M - r0) : MR_AVX2, n0, n1, f);
    for (Py_ssize_t p = 0; panel && p < strips; p += width) {
        const Py_ssize_t pe = p + width < strips ? p + width : strips;
        unpack_panel_avx2(panel, a, n0, n1, p, pe, f);
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += MR_AVX2) {
            const int mr = a->M - r0 < MR_AVX2 ? (int)(a->M - r0) : MR_AVX2;
            for (Py_ssize_t s = p; s < pe; s += NR_AVX2) {
                const int nr = pe - s < NR_AVX2 ? (int)(pe - s) : NR_AVX2;
                const Py_ssize_t c0 = n0 + 8 * s, end = c0 + 8 * nr;
                const int last = (int)(8 - ((end > n1 ? end : n1) - n1));
                strip_tile_any_avx2(a, panel + (s - p) * nb, r0, mr, c0, nr, last, f);
            }
        }
    }
    free(panel);
}

/* out[:, n0:n1] of a format's matmul on the AVX2 path: what its kernels call. */
AVX2_INLINE void matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                             const strip8_format f) {
    if (a->M <= NS_GEMV_ROWS)
        strip_gemv_avx2(a, 0, (int)a->M, n0, n1, f);
    else
        strip_gemm_avx2(a, n0, n1, f);
}

#endif
#endif
