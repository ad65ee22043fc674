/* The quantized GEMM on AMX-INT8 tiles, exact: the same int32 dot of every block as the AVX-512
 * VNNI kernels, scaled by the same float operations in the same order, so its outputs are theirs
 * bit for bit. quant_strips.h includes it where the including file (quant_amx.c) defines NS_AMX,
 * after AVX-512's vocabulary (quant_isa.h), and calls it when quant.c split the activations.
 *
 * AMX multiplies bytes, the activations are int16: each q = 256 hi + lo with hi = q >> 8 signed
 * and lo = q & 255 unsigned (quant.c's split: ns_xq's tiles), so
 *
 *     dot(q, w) = 256 TDPBSSD(hi, w) + TDPBUSD(lo, w)
 *
 * exactly, every weight value these kernels take fitting int8 (Q8_0's bytes, the others' 4- and
 * 5-bit values). A tile product runs over one block (32 bytes along K), so that each block's
 * dot comes out on its own and is scaled as the strips scale it: acc = fma(float(dot), d dx,
 * acc), then Q4_1's and the K-quants' m sx. (Not Q6_K: quant_strips.h's strip_matmul.)
 *
 * The weights stay in their GGUF blocks: a panel of strips is unpacked (quant_simd.h's unpacking,
 * the same as the VNNI GEMM's) and repacked into B's layout (amx_block) in a per-call buffer that
 * stays in L2, and every tile of AMX_ROWS rows of x passes over it, two strips at a time: tiles
 * 0, 1 hold x's hi and lo, 2, 3 the two strips' weights, 4..7 the four int32 results. Storing
 * those (2 int32 per output and block) and reading them back, not the products, bounds its
 * speed: 1.16-1.41x the VNNI GEMM at 512 rows (bench/experiments/amx_gemm.py).
 */
#ifndef NANOSERVE_QUANT_AMX_H
#define NANOSERVE_QUANT_AMX_H

#include <immintrin.h>

enum { AMX_ROWS = NS_AMX_ROWS }; /* rows of x a tile takes */
/* The most bytes of a panel (whole strips, in L2): every tile of rows reads the activations of all
 * of K, from L3 once they outgrow L2, per panel. */
enum { AMX_PANEL_BYTES = 1 << 20 };

/* One block of a strip in B's layout: row g holds, for each column c, its values at positions
 * 4g .. 4g + 3 of the format's pairs order as 4 int8 (AMX's groups of 4 along K); and each
 * column's d and m as the strip has them. */
typedef struct {
    int8_t b[QK / 4][4 * STRIP_W];
    float d[STRIP_W], m[STRIP_W];
} amx_block;

/* The tile configuration (palette 1): 16 rows of x by a block's 32 bytes in tiles 0 and 1, its
 * 8 rows of a strip's 64 bytes in 2 and 3, 16 rows of 16 int32 in 4..7. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Stops the compiler moving memory accesses across the tile loads and stores, whose intrinsics
 * are asm statements that do not tell it which memory they touch. */
#define AMX_FENCE() __asm__ volatile("" ::: "memory")

/* Loads the configuration on this thread: a tile's shape is per-thread state. */
NS_INLINE void amx_configure(void) {
    amx_config c = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t >= 2 && t < 4 ? QK / 4 : AMX_ROWS;
        c.colsb[t] = t < 2 ? QK : 4 * STRIP_W;
    }
    _tile_loadconfig(&c);
}

/* s (an unpacked block of a strip) in B's layout: pair registers 2g and 2g + 1 hold positions
 * 4g, 4g + 1 and 4g + 2, 4g + 3 as int16 lanes; their low bytes, side by side, are row g. */
NS_INLINE void amx_pack(amx_block *o, const strip *s) {
    /* vpshufb indexes within each 128-bit lane: dword k takes bytes 4k and 4k + 2 of one register
     * (0x80: a zero byte), the first's into its bytes 0, 1 and the second's into 2, 3 */
    const ivec k = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    const ivec at = _mm512_mullo_epi32(k, _mm512_set1_epi32(0x04040404));
    const ivec first = _mm512_or_si512(_mm512_set1_epi32((int)0x80800200u), at);
    const ivec second = _mm512_or_si512(_mm512_set1_epi32((int)0x02008080u), at);
#pragma GCC unroll 8
    for (int g = 0; g < QK / 4; g++)
        _mm512_storeu_si512(o->b[g], _mm512_or_si512(_mm512_shuffle_epi8(s->p[2 * g], first),
                                                     _mm512_shuffle_epi8(s->p[2 * g + 1], second)));
    _mm512_storeu_ps(o->d, s->d);
    _mm512_storeu_ps(o->m, s->m);
}

/* Strips p .. pe of columns from n0 (each of nb blocks) unpacked and packed into panel. */
NS_INLINE void amx_unpack_panel(amx_block *panel, const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                                Py_ssize_t p, Py_ssize_t pe, const strip_format f) {
    const Py_ssize_t nb = a->K / QK;
    strip s[QK_K / QK];
    for (Py_ssize_t i = p; i < pe; i++) {
        const Py_ssize_t c0 = n0 + STRIP_W * i;
        const int n = n1 - c0 < STRIP_W ? (int)(n1 - c0) : STRIP_W;
        for (Py_ssize_t b = 0; b < nb; b++) {
            if (f.subs <= 1 || b % f.subs == 0) unpack_block(s, a, c0, b, n, f);
            amx_pack(panel + (i - p) * nb + b, &s[f.subs <= 1 ? 0 : b % f.subs]);
        }
    }
    AMX_FENCE();
}

/* acc[r] += the int32 dots in hi and lo (hi's times 256) of block b scaled, r < AMX_ROWS: by the
 * columns' d times row r's dx, then m sx where the format has a min. Rows past M have zero x, dx
 * and sx, so they add zeros. */
NS_INLINE void amx_scale(fvec acc[AMX_ROWS], const int32_t hi[AMX_ROWS][STRIP_W],
                         const int32_t lo[AMX_ROWS][STRIP_W], const float *d, const float *m,
                         const ns_xq *xq, Py_ssize_t r0, Py_ssize_t b, const int has_min) {
    const fvec dv = fv_load(d), mv = has_min ? fv_load(m) : fv_zero();
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        const Py_ssize_t at = (r0 + r) * xq->blocks + b;
        const ivec dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(hi[r]), 8),
                                          _mm512_loadu_si512(lo[r]));
        acc[r] = fv_fma(iv_to_fv(dot), fv_mul(dv, fv_set(xq->dx[at])), acc[r]);
        if (has_min) acc[r] = fv_fma(mv, fv_set(xq->sx[at]), acc[r]);
    }
}

/* Block b's int32 dots into dots (hi and lo of strip 0, then of strip 1; nr strips): x's tile
 * xt (its blocks' hi and lo, quant.h's layout) against the strips' blocks w0[b], w1[b]. */
NS_INLINE void amx_dots(int32_t dots[4][AMX_ROWS][STRIP_W], const int8_t *xt, const amx_block *w0,
                        const amx_block *w1, Py_ssize_t b, const int nr) {
    const int8_t *x = xt + b * 2 * AMX_ROWS * QK;
    _tile_loadd(0, x, QK);
    _tile_loadd(1, x + AMX_ROWS * QK, QK);
    _tile_loadd(2, w0[b].b, 4 * STRIP_W);
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbssd(4, 0, 2);
    _tile_dpbusd(5, 1, 2);
    if (nr == 2) {
        _tile_loadd(3, w1[b].b, 4 * STRIP_W);
        _tile_zero(6);
        _tile_zero(7);
        _tile_dpbssd(6, 0, 3);
        _tile_dpbusd(7, 1, 3);
    }
    _tile_stored(4, dots[0], 4 * STRIP_W);
    _tile_stored(5, dots[1], 4 * STRIP_W);
    if (nr == 2) {
        _tile_stored(6, dots[2], 4 * STRIP_W);
        _tile_stored(7, dots[3], 4 * STRIP_W);
    }
    AMX_FENCE();
}

/* Rows r0 .. r0 + AMX_ROWS of x (the first mr stored) by nr (1 or 2) strips from column c0 (the
 * last one `last` columns wide), over all of K, their blocks at w (strip c's block b at
 * w[c nb + b]). Each block's dots go to one of two buffers, so that the scaling of block b - 1
 * can run while the tiles compute block b. */
NS_INLINE void amx_tile(const ns_qmm *a, const amx_block *w, Py_ssize_t r0, int mr, Py_ssize_t c0,
                        const int nr, int last, const strip_format f) {
    const ns_xq *xq = a->x;
    const Py_ssize_t nb = a->K / QK;
    const int8_t *xt = xq->tiles + r0 * a->K * 2;
    fvec acc[2][AMX_ROWS];
    _Alignas(64) int32_t dots[2][4][AMX_ROWS][STRIP_W];
#pragma GCC unroll 2
    for (int c = 0; c < nr; c++)
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) acc[c][r] = fv_zero();
    for (Py_ssize_t b = 0; b <= nb; b++) {
        if (b < nb) amx_dots(dots[b & 1], xt, w, w + nb, b, nr);
        if (b == 0) continue;
#pragma GCC unroll 2
        for (int c = 0; c < nr; c++)
            amx_scale(acc[c], dots[(b - 1) & 1][2 * c], dots[(b - 1) & 1][2 * c + 1],
                      w[c * nb + b - 1].d, w[c * nb + b - 1].m, xq, r0, b - 1, f.has_min);
    }
    for (int c = 0; c < nr; c++)
        for (int r = 0; r < mr; r++)
            store_cols(a->out + (r0 + r) * a->ldo + c0 + STRIP_W * c,
                       c == nr - 1 ? last : STRIP_W, acc[c][r]);
}

/* out[:, n0:n1] on AMX: panels of whole strips (every block) in B's layout, at most
 * AMX_PANEL_BYTES, under every tile of AMX_ROWS rows of x, two strips at a time. Without memory
 * for the panel, the VNNI GEMM (the same results). */
NS_INLINE void amx_gemm(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1, const strip_format f) {
    const Py_ssize_t nb = a->K / QK, strips = (n1 - n0 + STRIP_W - 1) / STRIP_W;
    Py_ssize_t width = (Py_ssize_t)(AMX_PANEL_BYTES / ((size_t)nb * sizeof(amx_block)));
    width = width / 2 * 2;
    width = width < 2 ? 2 : width < strips ? width : strips;
    amx_block *panel = aligned_alloc(64, (size_t)(width * nb) * sizeof(amx_block));
    if (!panel) {
        strip_gemm(a, n0, n1, f);
        return;
    }
    amx_configure();
    for (Py_ssize_t p = 0; p < strips; p += width) {
        const Py_ssize_t pe = p + width < strips ? p + width : strips;
        amx_unpack_panel(panel, a, n0, n1, p, pe, f);
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += AMX_ROWS) {
            const int mr = a->M - r0 < AMX_ROWS ? (int)(a->M - r0) : AMX_ROWS;
            for (Py_ssize_t s = p; s < pe; s += 2) {
                const Py_ssize_t c0 = n0 + STRIP_W * s, end = c0 + STRIP_W * 2;
                const amx_block *w = panel + (s - p) * nb;
                if (pe - s >= 2) {
                    const int last = (int)(STRIP_W - ((end > n1 ? end : n1) - n1));
                    amx_tile(a, w, r0, mr, c0, 2, last, f);
                } else {
                    amx_tile(a, w, r0, mr, c0, 1, (int)(n1 - c0), f);
                }
            }
        }
    }
    _tile_release();
    free(panel);
}

#endif
