/* The AVX2+FMA+F16C path of the quantized matmul (see quant.h). Built with target attributes, not
 * build flags, so that it is there whatever -march the module is built for and runs only where
 * quant.c found the CPU able to.
 *
 * The 4-bit formats go two blocks at a time: their 2 x 16 bytes of nibbles in one 256-bit register,
 * masked into low nibbles (values 0-15 of both blocks) and high ones (values 16-31), against
 * activations split the same way; maddubs (u8 x s8 -> pairs of int16; no saturation, as |q x| <=
 * 15 x 127) and madd give 8 int32 lanes, 4 per block. Q8_0 goes a block at a time with the sign
 * trick (|w| x sign(w) x, as maddubs needs one unsigned side). Each lane is then scaled by d dx in
 * float and added into a float lane; the 8 lanes are added at the end in a fixed order.
 *
 * A tile of up to MR rows of x by NR rows of W (output features) shares each unpacked weight group
 * among its rows; every output's own operations are the same in any tile, so the GEMV (M <= 4, one
 * tile of rows, streaming W once) and the GEMM (panels of W that stay in cache while tiles of rows
 * pass over them) agree bitwise.
 */
#include "quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define INLINE static inline __attribute__((target("avx2,fma,f16c"), always_inline))
#define KERNEL __attribute__((target("avx2,fma,f16c")))

enum { MR = 4, NR = 2, GEMV_ROWS = 4, PANEL_BYTES = 32 << 10 };

ns_xq_layout ns_layout_avx2(int qtype) {
    if (qtype == NS_Q8_0) return (ns_xq_layout){1, 8, 0, 0};
    return (ns_xq_layout){2, 4, 1, qtype == NS_Q4_0 ? 8 : 0};
}

/* One group of a weight row, unpacked: for 4-bit formats the nibbles (lo, hi) and d and m over
 * each block's 4 lanes; for Q8_0 |q| (lo), q (hi, for its signs) and d over the 8 lanes. */
typedef struct {
    __m256i lo, hi;
    __m256 d, m;
} wgroup;

INLINE wgroup load_q8_0(const char *g) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(g + 2));
    uint16_t d;
    memcpy(&d, g, sizeof d);
    return (wgroup){_mm256_abs_epi8(q), q, _mm256_set1_ps(_cvtsh_ss(d)), _mm256_setzero_ps()};
}

/* `count` (1 or 2) blocks of a 4-bit format from g; a missing second block is zeros. */
INLINE wgroup load_q4(const char *g, const int qtype, const int count) {
    const int bb = qtype == NS_Q4_1 ? Q4_1_BYTES : Q4_0_BYTES, at = qtype == NS_Q4_1 ? 4 : 2;
    const __m128i b0 = _mm_loadu_si128((const __m128i *)(g + at));
    const __m128i b1 = count > 1 ? _mm_loadu_si128((const __m128i *)(g + bb + at))
                                 : _mm_setzero_si128();
    const __m256i v = _mm256_set_m128i(b1, b0), low = _mm256_set1_epi8(15);
    int32_t h0, h1 = 0; /* d, and m for Q4_1, of each block */
    memcpy(&h0, g, sizeof h0);
    if (count > 1) memcpy(&h1, g + bb, sizeof h1);
    const __m256 dm = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_set_epi32(0, 0, h1, h0)));
    wgroup w = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)),
                _mm256_setzero_ps()};
    if (qtype == NS_Q4_1)
        w.m = _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
    return w;
}

/* The int32 lanes of one weight group times the activations' group at x (with their corrections
 * for Q4_0). */
INLINE __m256i dot_group(const wgroup *w, const int8_t *x, const int32_t *corr, const int qtype) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i pairs;
    if (qtype == NS_Q8_0) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
        pairs = _mm256_maddubs_epi16(w->lo, _mm256_sign_epi8(xv, w->hi));
    } else {
        const __m256i lo = _mm256_maddubs_epi16(w->lo, _mm256_loadu_si256((const __m256i *)x));
        const __m256i hi = _mm256_maddubs_epi16(w->hi, _mm256_loadu_si256((const __m256i *)x + 1));
        pairs = _mm256_add_epi16(lo, hi); /* |sum| <= 4 x 15 x 127: no overflow */
    }
    const __m256i dot = _mm256_madd_epi16(pairs, ones);
    if (qtype != NS_Q4_0) return dot;
    return _mm256_add_epi32(dot, _mm256_loadu_si256((const __m256i *)corr));
}

/* The rows and columns of one tile and where its group g lies in them. */
typedef struct {
    const ns_qmm *a;
    Py_ssize_t r0, c0;
} tile_at;

/* acc[r][c] += group g (`count` blocks) of row r0 + r of x times row c0 + c of W. */
INLINE void tile_step(__m256 acc[MR][NR], const tile_at *t, Py_ssize_t g, const int mr,
                      const int nr, const int qtype, const int count) {
    const ns_xq_layout l = ns_layout_avx2(qtype);
    const size_t gbytes = (size_t)l.group * ns_block_bytes(qtype);
    const ns_xq *xq = t->a->x;
    wgroup w[NR];
#pragma GCC unroll 2
    for (int c = 0; c < nr; c++) {
        const char *grp = t->a->w + (size_t)(t->c0 + c) * t->a->row_bytes + (size_t)g * gbytes;
        w[c] = qtype == NS_Q8_0 ? load_q8_0(grp) : load_q4(grp, qtype, count);
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        const int8_t *x = xq->q + (t->r0 + r) * xq->q_stride + g * l.group * QK;
        const Py_ssize_t lane = (t->r0 + r) * xq->lane_stride + g * 8;
        const __m256 dx = _mm256_loadu_ps(xq->dx + lane), sx = _mm256_loadu_ps(xq->sx + lane);
#pragma GCC unroll 2
        for (int c = 0; c < nr; c++) {
            const __m256i dot = dot_group(&w[c], x, xq->corr + lane, qtype);
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(w[c].d, dx),
                                        acc[r][c]);
            if (qtype == NS_Q4_1) acc[r][c] = _mm256_fmadd_ps(w[c].m, sx, acc[r][c]);
        }
    }
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* out for rows r0..r0+mr of x and rows c0..c0+nr of W, over all of K. */
INLINE void tile(const ns_qmm *a, Py_ssize_t r0, Py_ssize_t c0, const int mr, const int nr,
                 const int qtype) {
    const int group = ns_layout_avx2(qtype).group;
    const Py_ssize_t nb = a->K / QK, full = nb / group, rest = nb % group;
    const tile_at t = {a, r0, c0};
    __m256 acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = _mm256_setzero_ps();
    for (Py_ssize_t g = 0; g < full; g++) tile_step(acc, &t, g, mr, nr, qtype, group);
    if (rest) tile_step(acc, &t, full, mr, nr, qtype, (int)rest);
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) a->out[(r0 + r) * a->N + c0 + c] = hsum(acc[r][c]);
}

/* tile() with mr (1..MR) and nr (1..NR) as constants. */
INLINE void tile_any(const ns_qmm *a, Py_ssize_t r0, Py_ssize_t c0, int mr, int nr,
                     const int qtype) {
    _Static_assert(MR == 4 && NR == 2, "a case for each tile shape");
    switch ((mr - 1) * NR + nr - 1) {
    case 0: tile(a, r0, c0, 1, 1, qtype); break;
    case 1: tile(a, r0, c0, 1, 2, qtype); break;
    case 2: tile(a, r0, c0, 2, 1, qtype); break;
    case 3: tile(a, r0, c0, 2, 2, qtype); break;
    case 4: tile(a, r0, c0, 3, 1, qtype); break;
    case 5: tile(a, r0, c0, 3, 2, qtype); break;
    case 6: tile(a, r0, c0, 4, 1, qtype); break;
    default: tile(a, r0, c0, 4, 2, qtype); break;
    }
}

/* Columns n0..n1: a few rows stream W once; more go over panels of W that stay in cache. */
INLINE void columns(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1, const int qtype) {
    if (a->M <= GEMV_ROWS) {
        for (Py_ssize_t c = n0; c < n1; c++) tile_any(a, 0, c, (int)a->M, 1, qtype);
        return;
    }
    Py_ssize_t panel = (Py_ssize_t)(PANEL_BYTES / a->row_bytes) / NR * NR;
    if (panel < NR) panel = NR;
    for (Py_ssize_t p = n0; p < n1; p += panel) {
        const Py_ssize_t pe = p + panel < n1 ? p + panel : n1;
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += MR) {
            const int mr = a->M - r0 < MR ? (int)(a->M - r0) : MR;
            for (Py_ssize_t c = p; c < pe; c += NR)
                tile_any(a, r0, c, mr, pe - c < NR ? (int)(pe - c) : NR, qtype);
        }
    }
}

KERNEL void ns_qmm_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    if (a->qtype == NS_Q8_0)
        columns(a, n0, n1, NS_Q8_0);
    else if (a->qtype == NS_Q4_0)
        columns(a, n0, n1, NS_Q4_0);
    else
        columns(a, n0, n1, NS_Q4_1);
}

#endif
