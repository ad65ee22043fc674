/* The AVX-512 kernels of the quantized matmul (F, BW and VL; vpdpwssd where the CPU has VNNI),
 * laid out along N: the driver each format's file instantiates with its block unpacking
 * (q8_0_matmul_avx512 and the others). Built with target attributes, not build flags, so that it
 * is there whatever -march the module is built for and runs only where quant.c found the CPU able.
 *
 * A register holds one int32 lane for each of 16 consecutive output columns (a "strip"). A block
 * of a strip is unpacked once into 16 registers p[j], lane c holding two values of column c's
 * block as int16 (Q4_0's less 8), and the activations lay each block out as the same pairs
 * (the format's `pairs` in quant.h), so one vpdpwssd (vpmaddwd + vpaddd without VNNI) of p[j] with
 * its pair broadcast adds two products to 16 columns at once. A block's 16 steps leave each
 * column's exact integer dot in its lane, scaled once:
 *
 *     acc = fma(float(dot), d * dx, acc);  acc = fma(m, dx * sum(q), acc)  (Q4_1)
 *
 * block after block, the same operations for an output whatever tile, strip lane or thread it is
 * in, so the GEMV (M <= GEMV_ROWS_AVX512, unpacking blocks as it streams W) and the GEMM (panels
 * unpacked once and kept in L2 under every tile of rows) agree bitwise. Against lanes along K this
 * does one convert, multiply and FMA per 16 dot steps instead of per 2-4, and no horizontal sums;
 * unpacking costs a transpose of a strip's bytes per block.
 */
#ifndef NANOSERVE_QUANT_STRIPS_AVX512_H
#define NANOSERVE_QUANT_STRIPS_AVX512_H

#include "quant.h"

#if NS_X86
#include <immintrin.h>
#include <stdlib.h>

#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define AVX512_INLINE static inline __attribute__((target(AVX512_TARGET), always_inline))
/* A format's kernel on this path (its row of the table of formats points to it). */
#define AVX512_KERNEL static __attribute__((target(AVX512_TARGET)))

/* Tiles of MR rows of x by NR strips: 4 x 3 takes 12 int32 and 12 float accumulators of the 32
 * registers. */
enum { MR_AVX512 = 4, NR_AVX512 = 3 };
/* Rows the GEMV takes, in one tile of one strip (8 int32 and 8 float accumulators): a batch of 8
 * decodes unpacks each block once, straight from W, instead of into a panel that two tiles of
 * MR_AVX512 rows then read from L2 (0.84 ms against 0.72 ms on a Q4_K 8192 x 2048 at M = 8). */
enum { GEMV_ROWS_AVX512 = 8 };

/* One block of a strip, unpacked: pairs p[j] (see above), each column's d and m (Q4_1). */
typedef struct {
    __m512i p[16];
    __m512 d, m, d2; /* d2: Q6_K's scale of values 16..31 (halves) */
} strip16;

/* What the driver needs of a format, passed as a constant so that each format's kernel is compiled
 * with its own unpacking inlined: unpack(s, w, stride) unpacks the blocks at w of 16 rows of W
 * (row c's at w + c stride); has_min: Q4_1's m dx sum(q) is added. */
typedef struct {
    void (*unpack)(strip16 *s, const char *w, size_t stride);
    size_t block_bytes;
    int has_min;
    /* K-quants: blocks of subs > 1 sub-blocks of 32 values (at most QK_K / QK), unpacked
     * instead by unpack_super, all at once into s[0 .. subs - 1] (each byte of W transposed
     * once); halves (Q6_K): values 0..15 and 16..31 of a sub-block have their own scales, d and
     * d2, each half's dot scaled on its own. */
    int subs;
    void (*unpack_super)(strip16 *s, const char *w, size_t stride);
    int halves;
} strip16_format;

/* 16 rows' 16 bytes (row r at src + r * stride) as 4 registers g[q] whose lane r is row r's
 * bytes 4q .. 4q + 3. */
AVX512_INLINE void transpose_rows_avx512(__m512i g[4], const char *src, size_t stride) {
    __m512i z[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const char *p = src + (size_t)(4 * i) * stride;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + stride)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * stride)), 2);
        z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 3);
    }
    /* z[i] element 4 l + q is row 4 i + l's dword q. First rows 0-7 (z0, z1) and 8-15 (z2, z3):
     * dwords 0 and 1 of the eight rows, then 2 and 3; then the two halves of the rows. */
    const __m512i even =
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(2));
    const __m512i a01 = _mm512_permutex2var_epi32(z[0], even, z[1]);
    const __m512i b01 = _mm512_permutex2var_epi32(z[0], odd, z[1]);
    const __m512i a23 = _mm512_permutex2var_epi32(z[2], even, z[3]);
    const __m512i b23 = _mm512_permutex2var_epi32(z[2], odd, z[3]);
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    g[0] = _mm512_permutex2var_epi32(a01, lo, a23);
    g[1] = _mm512_permutex2var_epi32(a01, hi, a23);
    g[2] = _mm512_permutex2var_epi32(b01, lo, b23);
    g[3] = _mm512_permutex2var_epi32(b01, hi, b23);
}

/* Each of 16 rows' block d (and m if has_min), from the 32 bits at each block's start (every
 * block starts with its fp16 d, Q4_1's with d and m), gathered in one instruction: 16 scalar
 * stores read back as a vector would stall on store forwarding at every block. */
AVX512_INLINE void strip_heads_avx512(__m512 *d, __m512 *m, const char *w, size_t stride,
                                      const int has_min) {
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)stride));
    const __m512i h = _mm512_i32gather_epi32(rows, w, 1);
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
    *m = has_min ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)))
                 : _mm512_setzero_ps();
}

/* The pairs of a 4-bit block from g (transpose_rows_avx512 of its 16 bytes of nibbles), less
 * zero_point (Q4_0's 8): lane bytes b0..b3 (values 4q..4q+3 in the low nibbles, 4q+16.. in the
 * high ones) as the pairs of nibbles 4 bits apart: (b0, b2) low, then high, (b1, b3) low, then
 * high (NS_NIBBLE_PAIRS). */
AVX512_INLINE void nibble_pairs_avx512(__m512i p[16], const __m512i g[4], const int zero_point) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), zp = _mm512_set1_epi16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_and_si512(_mm512_srli_epi32(g[q], 4 * i), nibbles);
            p[4 * q + i] = zero_point ? _mm512_sub_epi16(v, zp) : v;
        }
}

/* acc plus the int32 sums of the int16 pairs of w times x: one vpdpwssd with VNNI, else vpmaddwd
 * and vpaddd. vpdpwssd is written as assembly, not its intrinsic, so that one driver serves both
 * kernels: the intrinsic would need the VNNI target on every function it is inlined through, and
 * the plain kernel must not have it. */
AVX512_INLINE __m512i dot_pairs_avx512(__m512i acc, __m512i w, __m512i x, const int vnni) {
    if (!vnni) return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* v's first n lanes to out. */
AVX512_INLINE void store_cols_avx512(float *out, int n, __m512 v) {
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), v);
}

/* The unpacking for the first n < 16 rows, the others zeros (copied, so nothing past W is read). */
AVX512_INLINE void unpack_strip_edge_avx512(strip16 *s, const char *w, size_t stride, int n,
                                            const strip16_format f) {
    _Alignas(64) char rows[16][NS_MAX_BLOCK_BYTES] = {{0}};
    for (int c = 0; c < n; c++) memcpy(rows[c], w + (size_t)c * stride, f.block_bytes);
    f.unpack(s, rows[0], sizeof rows[0]);
}

/* Block b (32 values) of the 16 rows of W from row w (the last strip's first n of them) into
 * s; of a K-quant, where b starts a super-block, its sub-blocks into s[0 .. subs - 1] (the
 * callers skip the others). */
AVX512_INLINE void unpack_block_avx512(strip16 *s, const char *w, size_t stride, Py_ssize_t b,
                                   int n, const strip16_format f) {
    if (f.subs <= 1) {
        w += (size_t)b * f.block_bytes;
        if (n < 16)
            unpack_strip_edge_avx512(s, w, stride, n, f);
        else
            f.unpack(s, w, stride);
        return;
    }
    w += (size_t)(b / f.subs) * f.block_bytes;
    if (n == 16) {
        f.unpack_super(s, w, stride);
        return;
    }
    _Alignas(64) char rows[16][NS_MAX_BLOCK_BYTES] = {{0}};
    for (int c = 0; c < n; c++) memcpy(rows[c], w + (size_t)c * stride, f.block_bytes);
    f.unpack_super(s, rows[0], sizeof rows[0]);
}

/* acc[r][c] += dot[r][c] scaled: by the strips' d (or d2, Q6_K's second half) times dx, plus
 * m sx where the format has a min. */
AVX512_INLINE void scale_dots_avx512(__m512 acc[GEMV_ROWS_AVX512][3],
                                     __m512i dot[GEMV_ROWS_AVX512][3],
                                const strip16 *const s[3], const ns_xq *xq, Py_ssize_t r0,
                                const int mr, const int nr, Py_ssize_t b, const int second_half,
                                const int has_min) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const Py_ssize_t at = (r0 + r) * xq->blocks + b;
        const __m512 dx = _mm512_set1_ps(xq->dx[at]), sx = _mm512_set1_ps(xq->sx[at]);
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) {
            const __m512 d = second_half ? s[c]->d2 : s[c]->d;
            acc[r][c] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(d, dx), acc[r][c]);
            if (has_min) acc[r][c] = _mm512_fmadd_ps(s[c]->m, sx, acc[r][c]);
        }
    }
}

/* acc[r][c] over block b: rows r0 .. r0 + mr of x against strips s[c] (their block b), c < nr. */
AVX512_INLINE void block_step_avx512(__m512 acc[GEMV_ROWS_AVX512][3], const strip16 *const s[3],
                                     const ns_xq *xq,
                                     Py_ssize_t r0, const int mr, const int nr, Py_ssize_t b,
                                     const strip16_format f, const int vnni) {
    __m512i dot[GEMV_ROWS_AVX512][3];
    const Py_ssize_t q_stride = xq->blocks * QK;
    const int16_t *x = xq->q + r0 * q_stride + b * QK;
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) dot[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        if (f.halves && j == 8) { /* Q6_K: values 0..15 done, scaled by d */
            scale_dots_avx512(acc, dot, s, xq, r0, mr, nr, b, 0, 0);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
                for (int c = 0; c < nr; c++) dot[r][c] = _mm512_setzero_si512();
        }
        __m512i w[3];
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) w[c] = s[c]->p[j];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * q_stride + 2 * j, 4);
            const __m512i xb = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
            for (int c = 0; c < nr; c++) dot[r][c] = dot_pairs_avx512(dot[r][c], w[c], xb, vnni);
        }
    }
    scale_dots_avx512(acc, dot, s, xq, r0, mr, nr, b, f.halves, f.has_min);
}

/* Rows r0 .. r0 + mr by the nr strips from column c0 (the last one `last` columns wide), over all
 * of K. The strips' blocks come from panel (strip c's block b at panel[c * nb + b]) if given,
 * else are unpacked from W block by block. */
AVX512_INLINE void strip_tile_avx512(const ns_qmm *a, const strip16 *panel, Py_ssize_t r0,
                                     const int mr, Py_ssize_t c0, const int nr, int last,
                                     const strip16_format f, const int vnni) {
    const Py_ssize_t nb = a->K / QK;
    __m512 acc[GEMV_ROWS_AVX512][3];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_ps();
    strip16 own[3], super[3][QK_K / QK]; /* super: a K-quant's super-blocks */
    const strip16 *s[3] = {own, own + 1, own + 2};
    /* Streaming W (no panel): the rows of the next strips, a share of their lines a block, on
     * their way in while this one computes (none after W's last row): into L1 where they are a
     * small part of it (NS_PREFETCH_L1_BYTES), else into L2, since a strip of long rows
     * (Llama-3.2-1B's 8192 x 2048 in Q6_K: 27 KiB) would push out the one being read. */
    const Py_ssize_t after = c0 + 16 * nr, ahead = a->N - after < 16 * nr ? a->N - after : 16 * nr;
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
            const char *w = a->w + (size_t)(c0 + 16 * c) * a->row_bytes;
            const int n = c == nr - 1 ? last : 16;
            if (f.subs <= 1) {
                unpack_block_avx512(own + c, w, a->row_bytes, b, n, f);
                continue;
            }
            if (b % f.subs == 0) unpack_block_avx512(super[c], w, a->row_bytes, b, n, f);
            s[c] = &super[c][b % f.subs];
        }
        block_step_avx512(acc, s, a->x, r0, mr, nr, b, f, vnni);
    }
    for (int c = 0; c < nr; c++)
        for (int r = 0; r < mr; r++)
            store_cols_avx512(a->out + (r0 + r) * a->ldo + c0 + 16 * c, c == nr - 1 ? last : 16,
                              acc[r][c]);
}

/* strip_tile_avx512 with nr (1..NR_AVX512) a constant. */
AVX512_INLINE void strip_tile_nr_avx512(const ns_qmm *a, const strip16 *panel, Py_ssize_t r0,
                                        const int mr, Py_ssize_t c0, int nr, int last,
                                        const strip16_format f, const int vnni) {
    if (nr == 1)
        strip_tile_avx512(a, panel, r0, mr, c0, 1, last, f, vnni);
    else if (nr == 2)
        strip_tile_avx512(a, panel, r0, mr, c0, 2, last, f, vnni);
    else
        strip_tile_avx512(a, panel, r0, mr, c0, 3, last, f, vnni);
}

/* strip_tile_avx512 with mr (1..4) and nr (1..NR_AVX512) constants. */
AVX512_INLINE void strip_tile_any_avx512(const ns_qmm *a, const strip16 *panel, Py_ssize_t r0,
                                         int mr, Py_ssize_t c0, int nr, int last,
                                         const strip16_format f, const int vnni) {
    switch (mr) {
    case 1: strip_tile_nr_avx512(a, panel, r0, 1, c0, nr, last, f, vnni); break;
    case 2: strip_tile_nr_avx512(a, panel, r0, 2, c0, nr, last, f, vnni); break;
    case 3: strip_tile_nr_avx512(a, panel, r0, 3, c0, nr, last, f, vnni); break;
    default: strip_tile_nr_avx512(a, panel, r0, 4, c0, nr, last, f, vnni); break;
    }
}

/* One strip of mr (5..GEMV_ROWS_AVX512) rows, mr a constant. */
AVX512_INLINE void strip_tile_wide_avx512(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t c0,
                                          int last, const strip16_format f, const int vnni) {
    switch (mr) {
    case 5: strip_tile_avx512(a, NULL, r0, 5, c0, 1, last, f, vnni); break;
    case 6: strip_tile_avx512(a, NULL, r0, 6, c0, 1, last, f, vnni); break;
    case 7: strip_tile_avx512(a, NULL, r0, 7, c0, 1, last, f, vnni); break;
    default: strip_tile_avx512(a, NULL, r0, 8, c0, 1, last, f, vnni); break;
    }
}

/* out[r0 .. r0 + mr, n0 .. n1] straight from W (mr <= GEMV_ROWS_AVX512), one strip at a time: each
 * block unpacked once for all the rows, W read once, the unpacked strip kept in registers. */
AVX512_INLINE void strip_gemv_avx512(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n0,
                                     Py_ssize_t n1, const strip16_format f, const int vnni) {
    for (Py_ssize_t c0 = n0; c0 < n1; c0 += 16) {
        const int last = n1 - c0 < 16 ? (int)(n1 - c0) : 16;
        if (mr > MR_AVX512)
            strip_tile_wide_avx512(a, r0, mr, c0, last, f, vnni);
        else
            strip_tile_any_avx512(a, NULL, r0, mr, c0, 1, last, f, vnni);
    }
}

/* Columns n0 + 16 p .. of every block, strips p..pe, unpacked into panel. */
AVX512_INLINE void unpack_panel_avx512(strip16 *panel, const ns_qmm *a, Py_ssize_t n0,
                                       Py_ssize_t n1, Py_ssize_t p, Py_ssize_t pe,
                                       const strip16_format f) {
    const Py_ssize_t nb = a->K / QK;
    for (Py_ssize_t s = p; s < pe; s++) {
        const Py_ssize_t c0 = n0 + 16 * s;
        const int n = n1 - c0 < 16 ? (int)(n1 - c0) : 16;
        for (Py_ssize_t b = 0; b < nb; b++) {
            const char *w = a->w + (size_t)c0 * a->row_bytes;
            if (f.subs <= 1 || b % f.subs == 0) /* a super-block fills subs blocks */
                unpack_block_avx512(panel + (s - p) * nb + b, w, a->row_bytes, b, n, f);
        }
    }
}

/* Many rows: panels of whole strips (every block), unpacked once into a buffer of at most
 * NS_PANEL_BYTES that stays in L2 while every tile of MR_AVX512 rows passes over it, NR_AVX512
 * strips at a time. Without memory for the buffer, tiles of rows unpack as the GEMV does (the same
 * values and operations, so the same results). */
AVX512_INLINE void strip_gemm_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                     const strip16_format f, const int vnni) {
    const Py_ssize_t nb = a->K / QK, strips = (n1 - n0 + 15) / 16;
    Py_ssize_t width = (Py_ssize_t)(NS_PANEL_BYTES / ((size_t)nb * sizeof(strip16)));
    width = width / NR_AVX512 * NR_AVX512;
    width = width < NR_AVX512 ? NR_AVX512 : width < strips ? width : strips; /* strips a panel */
    strip16 *panel = aligned_alloc(64, (size_t)(width * nb) * sizeof(strip16));
    for (Py_ssize_t r0 = 0; !panel && r0 < a->M; r0 += MR_AVX512) {
        const int mr = a->M - r0 < MR_AVX512 ? (int)(a->M - r0) : MR_AVX512;
        strip_gemv_avx512(a, r0, mr, n0, n1, f, vnni);
    }
    for (Py_ssize_t p = 0; panel && p < strips; p += width) {
        const Py_ssize_t pe = p + width < strips ? p + width : strips;
        unpack_panel_avx512(panel, a, n0, n1, p, pe, f);
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += MR_AVX512) {
            const int mr = a->M - r0 < MR_AVX512 ? (int)(a->M - r0) : MR_AVX512;
            for (Py_ssize_t s = p; s < pe; s += NR_AVX512) {
                const int nr = pe - s < NR_AVX512 ? (int)(pe - s) : NR_AVX512;
                const Py_ssize_t c0 = n0 + 16 * s, end = c0 + 16 * nr;
                const int last = (int)(16 - ((end > n1 ? end : n1) - n1));
                strip_tile_any_avx512(a, panel + (s - p) * nb, r0, mr, c0, nr, last, f, vnni);
            }
        }
    }
    free(panel);
}

/* out[:, n0:n1] of a format's matmul on the AVX-512 path: what its kernels call. */
AVX512_INLINE void matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                 const strip16_format f, const int vnni) {
    if (a->M <= GEMV_ROWS_AVX512)
        strip_gemv_avx512(a, 0, (int)a->M, n0, n1, f, vnni);
    else
        strip_gemm_avx512(a, n0, n1, f, vnni);
}

#endif
#endif
