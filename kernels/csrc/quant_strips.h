/* The SIMD drivers of the quantized matmul, written once for any vector width: quant_simd.h
 * instantiates them with each format's block unpacking, and quant_avx2.c, quant_avx512.c and
 * quant_avx512_vnni.c compile that once per instruction set, whose vocabulary (quant_isa.h:
 * ivec and fvec, STRIP_W lanes, the tile sizes) is included first. Built with target attributes,
 * not build flags, so that every path is there whatever -march the module is built for and runs
 * only where quant.c found the CPU able.
 *
 * A register holds one int32 lane for each of STRIP_W consecutive output columns (a "strip"). A
 * block of a strip is unpacked once into 16 registers p[j], lane c holding two values of column
 * c's block as int16 (Q4_0's less 8), and the activations lay each block out as the same pairs
 * (the format's `pairs` in quant.h), so one vpdpwssd (vpmaddwd + vpaddd without VNNI) of p[j] with
 * its pair broadcast adds two products to STRIP_W columns at once. A block's 16 steps leave each
 * column's exact integer dot in its lane, scaled once:
 *
 *     acc = fma(float(dot), d * dx, acc);  acc = fma(m, dx * sum(q), acc)  (Q4_1)
 *
 * block after block, the same operations for an output whatever tile, strip lane or thread it is
 * in, so the GEMV (M <= GEMV_ROWS, unpacking blocks as it streams W) and the GEMM (chunks of W
 * unpacked once into a panel kept in L1 under every tile of rows) agree bitwise. Against lanes along K this does one
 * convert, multiply and FMA per 16 dot steps instead of per 2-4, and no horizontal sums;
 * unpacking costs a transpose of a strip's bytes per block, or, for the K-quants repacked at load
 * (quant_r16.c, strip_src below), plain loads of bytes laid out transposed.
 */
#ifndef NANOSERVE_QUANT_STRIPS_H
#define NANOSERVE_QUANT_STRIPS_H

#include "quant.h"

#include <stdlib.h>

/* One block of a strip, unpacked: pairs p[j] (see above), each column's d and m (Q4_1). */
typedef struct {
    ivec p[16];
    fvec d, m, d2; /* d2: Q6_K's scale of values 16..31 (halves) */
} strip;

/* One block of a strip as bytes (the byte GEMV, quant_bytes.h): v[i] lane c holds column c's
 * values 4i .. 4i + 3 of the block, unsigned (Q6_K's without its zero point); d, m, d2 as a
 * strip's. */
typedef struct {
    ivec v[8];
    fvec d, m, d2;
} strip8;

/* Where an unpacking reads a strip's blocks: row c's at w + c stride, as the file lays them out;
 * or, r16, from W repacked at load (quant_r16.c), whose groups of 16 rows interleave their blocks
 * 4 bytes at a time: the group's block holds row c's bytes 4u .. 4u + 3 at w + 64 u + 4 c, the
 * rows' remaining 2 bytes (Q6_K's d) after them at w + 64 words + 2 c, and half says which 8 of
 * the 16 rows an 8-lane strip (AVX2) is. Then the transposes of the file's layout are plain
 * loads. */
typedef struct {
    const char *w;
    size_t stride;
    int r16, half, words; /* words: the block's bytes / 4 */
} strip_src;

/* Bytes off .. off + 15 (off a multiple of 4) of the strip's rows' blocks as transpose_rows gives
 * them: g[i] lane c holds row c's bytes off + 4i .. off + 4i + 3. */
NS_INLINE void src_rows(ivec g[4], strip_src src, size_t off) {
    if (!src.r16) {
        transpose_rows(g, src.w + off, src.stride);
        return;
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) g[i] = iv_loadu(src.w + 64 * (off / 4 + (size_t)i) + 32 * src.half);
}

/* Each row's fp16 at off, the last 2 bytes of its block (Q6_K's d), as floats; of the r16 layout,
 * the rows' 2 bytes after the words (Q6_K's d, Q5_0's), one load. */
NS_INLINE fvec src_last_half(strip_src src, size_t off) {
    if (!src.r16) return half_floats(row_words(src.w + off - 2, src.stride), 1);
    return widen(src.w + 64 * (size_t)src.words + 2 * STRIP_W * src.half, 0);
}

/* A chunk of the GEMM (strip_gemm): blocks b0 .. b1 of the nr strips from strip s (of its columns
 * n0 .. n1), for rows r0 .. r1. GEMM_BLOCKS: a chunk's blocks, a K-quant's super-block (each
 * unpacked whole); GEMM_BAND: its rows. */
typedef struct gemm_chunk {
    Py_ssize_t s, r0, r1, b0, b1;
    int nr;
} gemm_chunk;
enum { GEMM_BLOCKS = QK_K / QK, GEMM_BAND = 512 };

/* What the driver needs of a format, passed as a constant so that each format's kernel is compiled
 * with its own unpacking inlined: unpack(s, src) unpacks the blocks of STRIP_W rows of W at src;
 * has_min: Q4_1's m dx sum(q) is added. */
typedef struct {
    void (*unpack)(strip *s, strip_src src);
    size_t block_bytes;
    int has_min;
    /* K-quants: blocks of subs > 1 sub-blocks of 32 values (at most QK_K / QK), unpacked
     * instead by unpack_super, all at once into s[0 .. subs - 1] (each byte of W transposed
     * once); halves (Q6_K): values 0..15 and 16..31 of a sub-block have their own scales, d and
     * d2, each half's dot scaled on its own. */
    int subs;
    void (*unpack_super)(strip *s, strip_src src);
    int halves;
    /* Where the format has a byte GEMV (ns_block_format's byte_gemv): as unpack_super (or
     * unpack), into bytes (strip8) */
    void (*unpack_bytes)(strip8 *s, strip_src src);
    /* Q8_0's signed bytes, unpacked offset by 128 (unsigned); byte_dot takes the offset off */
    int byte_signed;
    /* Q5_0's values unpacked as 0..31: byte_step takes byte_zero (16) times the block's sum of q
     * off the dot */
    int byte_zero;
    int r16; /* W repacked in groups of 16 rows (strip_src, quant_r16.c) */
    /* Where set, the GEMM's panel_tiles as a function of its own (OUT_OF_LINE_TILES), which a
     * K-quant's kernels on both layouts share, so that the layout cannot change the tiles' code:
     * inlined into each kernel, one perf profile of a pp512 on an AMD EPYC gave the r16 kernel
     * 7% more samples than the file layout's, from the same source. */
    void (*tiles)(const ns_qmm *a, const strip *panel, Py_ssize_t n0, Py_ssize_t n1,
                  gemm_chunk k);
} strip_format;

/* v shifted left by s bits (right by -s), s a constant after unrolling. */
NS_INLINE ivec iv_shift32(ivec v, int s) { return s >= 0 ? iv_shl32(v, s) : iv_shr32(v, -s); }

/* Each row's block d (and m if has_min), from the 32 bits at each block's start (every block
 * starts with its fp16 d, Q4_1's with d and m). */
NS_INLINE void strip_heads(fvec *d, fvec *m, const char *w, size_t stride, const int has_min) {
    const ivec h = row_words(w, stride);
    *d = half_floats(h, 0);
    *m = has_min ? half_floats(h, 1) : fv_zero();
}

/* The pairs of a 4-bit block from g (transpose_rows of its 16 bytes of nibbles), less zero_point
 * (Q4_0's 8): lane bytes b0..b3 (values 4q..4q+3 in the low nibbles, 4q+16.. in the high ones) as
 * the pairs of nibbles 4 bits apart: (b0, b2) low, then high, (b1, b3) low, then high
 * (NS_NIBBLE_PAIRS). */
NS_INLINE void nibble_pairs(ivec p[16], const ivec g[4], const int zero_point) {
    const ivec nibbles = iv_set32(0x000F000F), zp = iv_set16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const ivec v = iv_and(iv_shr32(g[q], 4 * i), nibbles);
            p[4 * q + i] = zero_point ? iv_sub16(v, zp) : v;
        }
}

/* The pairs of 32 values that are bytes (v[q] lane bytes: values 4q..4q+3, v1's 16 + 4q..), in
 * NS_BYTE_PAIRS' order, less zero_point (Q6_K's 32). */
NS_INLINE void byte_pairs(ivec p[16], const ivec v[4], const ivec v1[4], const int zero_point) {
    const ivec low = iv_set32(0x00FF00FF), zp = iv_set16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        p[2 * q] = iv_sub16(iv_and(v[q], low), zp);
        p[2 * q + 1] = iv_sub16(iv_shr16(v[q], 8), zp);
        p[8 + 2 * q] = iv_sub16(iv_and(v1[q], low), zp);
        p[8 + 2 * q + 1] = iv_sub16(iv_shr16(v1[q], 8), zp);
    }
}

/* Where the strip of columns from c0 reads the block that holds block b (a K-quant's super-block
 * b / subs). r16: c0 is a multiple of 8 (of 16 on AVX-512), as the threads' shares are. */
NS_INLINE strip_src src_of(const ns_qmm *a, Py_ssize_t c0, Py_ssize_t b, const strip_format f) {
    const size_t kb = (size_t)(f.subs <= 1 ? b : b / f.subs);
    if (!f.r16) return (strip_src){a->w + (size_t)c0 * a->row_bytes + kb * f.block_bytes,
                                   a->row_bytes, 0, 0, 0};
    const Py_ssize_t g0 = c0 - c0 % NS_R16; /* the group's first row */
    return (strip_src){a->w + (size_t)g0 * a->row_bytes + kb * NS_R16 * f.block_bytes, 0, 1,
                       (int)(c0 % NS_R16) / 8, (int)(f.block_bytes / 4)};
}

/* The unpacking of block b (32 values) of the STRIP_W rows of W from column c0 (the last strip's
 * first n of them) into s; of a K-quant, where b starts a super-block, its sub-blocks into
 * s[0 .. subs - 1] (the callers skip the others). Past n rows, zeros (copied, so nothing past W
 * is read); r16's groups have all their 16 rows, whose extra columns no one stores. */
NS_INLINE void unpack_block(strip *s, const ns_qmm *a, Py_ssize_t c0, Py_ssize_t b, int n,
                            const strip_format f) {
    void (*const unpack)(strip *, strip_src) = f.subs <= 1 ? f.unpack : f.unpack_super;
    const strip_src src = src_of(a, c0, b, f);
    if (n == STRIP_W || f.r16) {
        unpack(s, src);
        return;
    }
    _Alignas(64) char rows[STRIP_W][NS_MAX_BLOCK_BYTES] = {{0}};
    for (int c = 0; c < n; c++) memcpy(rows[c], src.w + (size_t)c * src.stride, f.block_bytes);
    unpack(s, (strip_src){rows[0], sizeof rows[0], 0, 0, 0});
}

/* Streaming W (no panel): the rows of the next strips, a share of their lines a block, on their
 * way in while this one computes (none after W's last row): into L1 where they are a small part
 * of it (NS_PREFETCH_L1_BYTES) and W is not from_memory, else into L2, since a strip of long
 * rows (Llama-3.2-1B's 8192 x 2048 in Q6_K: 27 KiB) would push out the one being read. */
typedef struct {
    const char *next;
    Py_ssize_t lines;
    int into_l1;
} ahead;

/* The rows after the nr strips from column c0; past W's last row, as many of a->then's. */
NS_INLINE ahead ahead_of(const ns_qmm *a, Py_ssize_t c0, int nr) {
    const Py_ssize_t after = c0 + STRIP_W * nr;
    Py_ssize_t rows = a->N - after < STRIP_W * nr ? a->N - after : STRIP_W * nr;
    const char *next = a->w + (size_t)(rows > 0 ? after : 0) * a->row_bytes;
    if (rows <= 0 && a->then) rows = STRIP_W * nr, next = a->then;
    const Py_ssize_t lines = rows > 0 ? (Py_ssize_t)((size_t)rows * a->row_bytes / 64) : 0;
    return (ahead){next, lines, !a->from_memory && lines * 64 <= NS_PREFETCH_L1_BYTES};
}

/* Block b's share (of nb) of the lines ahead. */
NS_INLINE void prefetch_share(ahead p, Py_ssize_t b, Py_ssize_t nb) {
    for (Py_ssize_t l = b * p.lines / nb; l < (b + 1) * p.lines / nb; l++) {
        if (p.into_l1)
            _mm_prefetch(p.next + 64 * l, _MM_HINT_T0);
        else
            _mm_prefetch(p.next + 64 * l, _MM_HINT_T1);
    }
}

/* acc[r][c] += dot[r][c] scaled: by the strips' d (or d2, Q6_K's second half) times dx, plus
 * m sx where the format has a min. */
NS_INLINE void scale_dots(fvec acc[GEMV_ROWS][TILE_NR], ivec dot[GEMV_ROWS][TILE_NR],
                          const strip *const s[TILE_NR], const ns_xq *xq, Py_ssize_t r0,
                          const int mr, const int nr, Py_ssize_t b, const int second_half,
                          const int has_min) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const Py_ssize_t at = (r0 + r) * xq->blocks + b;
        const fvec dx = fv_set(xq->dx[at]), sx = fv_set(xq->sx[at]);
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) {
            const fvec d = second_half ? s[c]->d2 : s[c]->d;
            acc[r][c] = fv_fma(iv_to_fv(dot[r][c]), fv_mul(d, dx), acc[r][c]);
            if (has_min) acc[r][c] = fv_fma(s[c]->m, sx, acc[r][c]);
        }
    }
}

/* acc[r][c] over block b: rows r0 .. r0 + mr of x against strips s[c] (their block b), c < nr. */
NS_INLINE void block_step(fvec acc[GEMV_ROWS][TILE_NR], const strip *const s[TILE_NR],
                          const ns_xq *xq, Py_ssize_t r0, const int mr, const int nr,
                          Py_ssize_t b, const strip_format f) {
    /* odd: where nr == 1 (the GEMV), the odd steps' dots, a second chain beside dot's, since one
     * chain of vpdpwssd waits on its latency (AMD EPYC: 16.5 against 19.5 GB/s for vpmaddwd and
     * vpaddd); added into dot before scaling, so the integer, and the result, are the same. */
    ivec dot[GEMV_ROWS][TILE_NR], odd[GEMV_ROWS];
    const Py_ssize_t q_stride = xq->blocks * QK;
    const int16_t *x = xq->q + r0 * q_stride + b * QK;
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        odd[r] = iv_zero();
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) dot[r][c] = iv_zero();
    }
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        if (f.halves && j == 8) { /* Q6_K: values 0..15 done, scaled by d */
#pragma GCC unroll 8
            for (int r = 0; nr == 1 && r < mr; r++) dot[r][0] = iv_add32(dot[r][0], odd[r]);
            scale_dots(acc, dot, s, xq, r0, mr, nr, b, 0, 0);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                odd[r] = iv_zero();
#pragma GCC unroll 3
                for (int c = 0; c < nr; c++) dot[r][c] = iv_zero();
            }
        }
        ivec w[TILE_NR];
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++) w[c] = s[c]->p[j];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * q_stride + 2 * j, 4);
            const ivec xb = iv_set32(pair);
            if (nr == 1 && (j & 1)) {
                odd[r] = dot_pairs(odd[r], w[0], xb);
                continue;
            }
#pragma GCC unroll 3
            for (int c = 0; c < nr; c++) dot[r][c] = dot_pairs(dot[r][c], w[c], xb);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; nr == 1 && r < mr; r++) dot[r][0] = iv_add32(dot[r][0], odd[r]);
    scale_dots(acc, dot, s, xq, r0, mr, nr, b, f.halves, f.has_min);
}

/* Rows r0 .. r0 + mr by the nr strips from column c0 (the last one `last` columns wide), over
 * blocks b0 .. b1 of K. The strips' blocks come from panel (strip c's block b at
 * panel[c * (b1 - b0) + b - b0]) if given, else are unpacked from W block by block. The sums start
 * from out's where b0 > 0 (a chunk of K after another: strip_gemm), so that a row's operations and
 * their order are those of one pass over K. */
NS_INLINE void strip_tile(const ns_qmm *a, const strip *panel, Py_ssize_t r0, const int mr,
                          Py_ssize_t c0, const int nr, int last, Py_ssize_t b0, Py_ssize_t b1,
                          const strip_format f) {
    const Py_ssize_t nb = a->K / QK;
    fvec acc[GEMV_ROWS][TILE_NR];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int c = 0; c < nr; c++)
            acc[r][c] = b0 == 0 ? fv_zero()
                                : load_cols(a->out + (r0 + r) * a->ldo + c0 + STRIP_W * c,
                                            c == nr - 1 ? last : STRIP_W);
    strip own[TILE_NR], super[TILE_NR][QK_K / QK]; /* super: a K-quant's super-blocks */
    const strip *s[TILE_NR];
    for (int c = 0; c < TILE_NR; c++) s[c] = own + c;
    const ahead next = ahead_of(a, c0, nr);
    for (Py_ssize_t b = b0; b < b1; b++) {
        if (!panel) prefetch_share(next, b, nb);
        for (int c = 0; c < nr; c++) {
            if (panel) {
                s[c] = panel + c * (b1 - b0) + b - b0;
                continue;
            }
            const Py_ssize_t at = c0 + STRIP_W * c;
            const int n = c == nr - 1 ? last : STRIP_W;
            if (f.subs <= 1) {
                unpack_block(own + c, a, at, b, n, f);
                continue;
            }
            if (b % f.subs == 0) unpack_block(super[c], a, at, b, n, f);
            s[c] = &super[c][b % f.subs];
        }
        block_step(acc, s, a->x, r0, mr, nr, b, f);
    }
    for (int c = 0; c < nr; c++)
        for (int r = 0; r < mr; r++)
            store_cols(a->out + (r0 + r) * a->ldo + c0 + STRIP_W * c,
                       c == nr - 1 ? last : STRIP_W, acc[r][c]);
}

/* strip_tile with nr (1..TILE_NR) a constant. */
NS_INLINE void strip_tile_nr(const ns_qmm *a, const strip *panel, Py_ssize_t r0, const int mr,
                             Py_ssize_t c0, int nr, int last, Py_ssize_t b0, Py_ssize_t b1,
                             const strip_format f) {
    if (nr == 1)
        strip_tile(a, panel, r0, mr, c0, 1, last, b0, b1, f);
    else if (nr == 2 || TILE_NR == 2)
        strip_tile(a, panel, r0, mr, c0, 2, last, b0, b1, f);
    else
        strip_tile(a, panel, r0, mr, c0, 3, last, b0, b1, f);
}

/* strip_tile with mr (1..4) and nr (1..TILE_NR) constants. */
NS_INLINE void strip_tile_any(const ns_qmm *a, const strip *panel, Py_ssize_t r0, int mr,
                              Py_ssize_t c0, int nr, int last, Py_ssize_t b0, Py_ssize_t b1,
                              const strip_format f) {
    switch (mr) {
    case 1: strip_tile_nr(a, panel, r0, 1, c0, nr, last, b0, b1, f); break;
    case 2: strip_tile_nr(a, panel, r0, 2, c0, nr, last, b0, b1, f); break;
    case 3: strip_tile_nr(a, panel, r0, 3, c0, nr, last, b0, b1, f); break;
    default: strip_tile_nr(a, panel, r0, 4, c0, nr, last, b0, b1, f); break;
    }
}

/* One strip of mr (5..8, AVX-512's GEMV) rows, mr a constant. */
NS_INLINE void strip_tile_wide(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t c0, int last,
                               const strip_format f) {
    switch (mr) {
    case 5: strip_tile(a, NULL, r0, 5, c0, 1, last, 0, a->K / QK, f); break;
    case 6: strip_tile(a, NULL, r0, 6, c0, 1, last, 0, a->K / QK, f); break;
    case 7: strip_tile(a, NULL, r0, 7, c0, 1, last, 0, a->K / QK, f); break;
    default: strip_tile(a, NULL, r0, 8, c0, 1, last, 0, a->K / QK, f); break;
    }
}

/* out[r0 .. r0 + mr, n0 .. n1] straight from W (mr <= GEMV_ROWS), one strip at a time: each block
 * unpacked once for all the rows, W read once, the unpacked strip kept in registers. */
NS_INLINE void strip_gemv(const ns_qmm *a, Py_ssize_t r0, int mr, Py_ssize_t n0, Py_ssize_t n1,
                          const strip_format f) {
    for (Py_ssize_t c0 = n0; c0 < n1; c0 += STRIP_W) {
        const int last = n1 - c0 < STRIP_W ? (int)(n1 - c0) : STRIP_W;
        if (GEMV_ROWS > 4 && mr > 4)
            strip_tile_wide(a, r0, mr, c0, last, f);
        else
            strip_tile_any(a, NULL, r0, mr, c0, 1, last, 0, a->K / QK, f);
    }
}

/* The chunk's blocks of its strips, unpacked into panel (strip_tile's layout). */
NS_INLINE void unpack_chunk(strip *panel, const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                            gemm_chunk k, const strip_format f) {
    for (int c = 0; c < k.nr; c++) {
        const Py_ssize_t c0 = n0 + STRIP_W * (k.s + c);
        const int n = n1 - c0 < STRIP_W ? (int)(n1 - c0) : STRIP_W;
        for (Py_ssize_t b = k.b0; b < k.b1; b++) {
            if (f.subs <= 1 || b % f.subs == 0) /* a super-block fills subs blocks */
                unpack_block(panel + c * (k.b1 - k.b0) + b - k.b0, a, c0, b, n, f);
        }
    }
}

/* Every tile of TILE_MR rows of the chunk over its unpacked panel. */
NS_INLINE void panel_tiles(const ns_qmm *a, const strip *panel, Py_ssize_t n0, Py_ssize_t n1,
                           gemm_chunk k, const strip_format f) {
    const Py_ssize_t c0 = n0 + STRIP_W * k.s, end = c0 + STRIP_W * k.nr;
    const int last = (int)(STRIP_W - ((end > n1 ? end : n1) - n1));
    for (Py_ssize_t r0 = k.r0; r0 < k.r1; r0 += TILE_MR) {
        const int mr = k.r1 - r0 < TILE_MR ? (int)(k.r1 - r0) : TILE_MR;
        strip_tile_any(a, panel, r0, mr, c0, k.nr, last, k.b0, k.b1, f);
    }
}

/* The out-of-line panel_tiles of the format whose strip_format is `strips`, named `name`. */
#define OUT_OF_LINE_TILES(name, strips)                                                            \
    static NS_KERNEL __attribute__((noinline)) void name(const ns_qmm *a, const strip *panel,      \
                                                         Py_ssize_t n0, Py_ssize_t n1,            \
                                                         gemm_chunk k) {                          \
        panel_tiles(a, panel, n0, n1, k, strips);                                                  \
    }

/* Many rows: W unpacked GEMM_BLOCKS blocks of TILE_NR strips at a time into a panel that stays in
 * L1 (29 KiB on AVX-512), which every tile of TILE_MR rows of a band of GEMM_BAND rows passes
 * over, the band's sums kept in out between chunks (their activations, 256 KiB, and sums in
 * L2). A panel of whole strips (every block) in L2, as before 2026-12-05, was read from L2 by
 * every tile of rows: on an AMD EPYC its tiles ran at 60% of vpdpwssd's peak. */
NS_INLINE void strip_gemm(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1, const strip_format f) {
    const Py_ssize_t nb = a->K / QK, strips = (n1 - n0 + STRIP_W - 1) / STRIP_W;
    _Alignas(64) strip panel[TILE_NR * GEMM_BLOCKS];
    for (Py_ssize_t s = 0; s < strips; s += TILE_NR) {
        const int nr = strips - s < TILE_NR ? (int)(strips - s) : TILE_NR;
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += GEMM_BAND)
            for (Py_ssize_t b0 = 0; b0 < nb; b0 += GEMM_BLOCKS) {
                const gemm_chunk k = {s, r0, r0 + GEMM_BAND < a->M ? r0 + GEMM_BAND : a->M, b0,
                                      b0 + GEMM_BLOCKS < nb ? b0 + GEMM_BLOCKS : nb, nr};
                unpack_chunk(panel, a, n0, n1, k, f);
                if (f.tiles)
                    f.tiles(a, panel, n0, n1, k);
                else
                    panel_tiles(a, panel, n0, n1, k, f);
            }
    }
}

#ifdef NS_AMX
#include "quant_amx.h"
#endif
#ifdef NS_VNNI
#include "quant_bytes.h"
#endif

/* out[:, n0:n1] of a format's matmul: what its kernels call. On the VNNI paths, the byte GEMV
 * where quant.c split the activations for it (M <= NS_BYTE_ROWS and a format that has one). On the
 * AMX path, the AMX GEMM where
 * quant.c split the activations for it (M >= NS_AMX_ROWS), but for Q6_K: its 16-value halves
 * give AMX twice the dots to store per block, and a first version that took them ran at 0.7-0.9x
 * the VNNI GEMM at 512 rows (the other formats: 1.16-1.41x, bench/experiments/amx_gemm.py). */
NS_INLINE void strip_matmul(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1, const strip_format f) {
#ifdef NS_VNNI
    if (a->x->hi && f.unpack_bytes) {
        byte_gemv(a, n0, n1, f);
        return;
    }
#endif
#ifdef NS_AMX
    if (a->x->tiles && !f.halves) {
        amx_gemm(a, n0, n1, f);
        return;
    }
#endif
    if (a->M <= GEMV_ROWS)
        strip_gemv(a, 0, (int)a->M, n0, n1, f);
    else
        strip_gemm(a, n0, n1, f);
}

#endif
