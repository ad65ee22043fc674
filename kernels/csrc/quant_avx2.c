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
 * With int16 activations the weights are widened to int16 as they are unpacked and vpmaddwd takes
 * the products, 2 a lane: Q8_0 a block at a time (vpmovsxbw of each half), the 4-bit formats two
 * blocks at a time as above, their nibble bytes zero-extended by halves (values 0-7, 8-15, 16-23,
 * 24-31 of both blocks, one register each); the float half of the step is the int8 one's.
 *
 * The tiling (quant_tiles.inc): a tile of up to MR rows of x by NR rows of W (output features)
 * shares each unpacked weight group among its rows; the GEMV streams W once, the GEMM unpacks
 * panels of W once for all its tiles of rows. Every output's own operations are the same in any
 * tile, so the two agree bitwise.
 */
#include "quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <stdlib.h>

#define TARGET "avx2,fma,f16c"
#define INLINE static inline __attribute__((target(TARGET), always_inline))

/* A panel of unpacked weights takes at most PANEL_BYTES, to stay in L1/L2; the GEMV takes up to
 * GEMV_ROWS rows. The tiles' sizes (MR, NR, NR_GEMV) are set before each include of
 * quant_tiles.inc. */
enum { GEMV_ROWS = 4, PANEL_BYTES = 32 << 10 };

ns_xq_layout ns_layout_avx2(int qtype, int wide) {
    const int corr = qtype == NS_Q4_0 ? 8 : 0;
    /* int16: vpmaddwd's lanes add 2 values; Q8_0 a block at a time as two halves, the 4-bit
     * formats two blocks at a time as quarters (where unpacking the nibbles puts them). */
    if (wide && qtype == NS_Q8_0) return (ns_xq_layout){1, 2, 2, 0, 1};
    if (wide) return (ns_xq_layout){2, 4, 2, corr, 1};
    /* int8: maddubs and madd's lanes add 4 values. */
    if (qtype == NS_Q8_0) return (ns_xq_layout){1, 1, 4, 0, 0};
    return (ns_xq_layout){2, 2, 4, corr, 0};
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

/* Blocks per group: 4-bit formats two (one per 128-bit half), Q8_0 one. */
#define GROUP(qtype) ((qtype) == NS_Q8_0 ? 1 : 2)

INLINE wgroup load_group(const char *g, const int qtype, const int count) {
    return qtype == NS_Q8_0 ? load_q8_0(g) : load_q4(g, qtype, count);
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

/* acc + the lanes of dot scaled by d dx, + m sx for Q4_1: the float half of a step, the same
 * for both activation widths. */
INLINE __m256 scale_add(__m256 acc, __m256i dot, const __m256 d, const __m256 m, const float *dx,
                        const float *sx, const int qtype) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_loadu_ps(dx)), acc);
    return qtype == NS_Q4_1 ? _mm256_fmadd_ps(m, _mm256_loadu_ps(sx), acc) : acc;
}

/* acc[r][c] += group g (`count` blocks) of row r0 + r of x times row c0 + c of W, whose groups
 * come unpacked from t->panel if from_panel, else from W itself. */
INLINE void tile_step(__m256 acc[8][4], const ns_tile *t, Py_ssize_t g, const int mr,
                      const int nr, const int qtype, const int count, const int from_panel) {
    const size_t gbytes = (size_t)GROUP(qtype) * ns_block_bytes(qtype);
    const ns_xq *xq = t->a->x;
    wgroup w[4];
#pragma GCC unroll 4
    for (int c = 0; c < nr; c++)
        w[c] = from_panel ? ((const wgroup *)t->panel)[c * t->groups + g]
                          : load_group(t->a->w + (size_t)(t->c0 + c) * t->a->row_bytes +
                                           (size_t)g * gbytes,
                                       qtype, count);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const int8_t *x = xq->q + (t->r0 + r) * xq->q_stride + g * GROUP(qtype) * QK;
        const Py_ssize_t lane = (t->r0 + r) * xq->lane_stride + g * 8;
#pragma GCC unroll 4
        for (int c = 0; c < nr; c++)
            acc[r][c] = scale_add(acc[r][c], dot_group(&w[c], x, xq->corr + lane, qtype), w[c].d,
                                  w[c].m, xq->dx + lane, xq->sx + lane, qtype);
    }
}

/* ---------------------------------------------------------------- int16 activations */

/* One group of a weight row widened to int16 for vpmaddwd: piece k of its blocks in p[k] (Q8_0:
 * values 16k..16k+15 of its one block; 4-bit formats: values 8k..8k+7 of each of its two blocks,
 * one per 128-bit half), d and m over each block's lanes, as the int8 group has them. */
typedef struct {
    __m256i p[4];
    __m256 d, m;
} wgroup16;

INLINE wgroup16 load_group16(const char *g, const int qtype, const int count) {
    wgroup16 w;
    if (qtype == NS_Q8_0) {
        w.p[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 2)));
        w.p[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 18)));
        w.p[2] = w.p[3] = _mm256_setzero_si256();
        uint16_t d;
        memcpy(&d, g, sizeof d);
        w.d = _mm256_set1_ps(_cvtsh_ss(d));
        w.m = _mm256_setzero_ps();
        return w;
    }
    /* The nibbles as bytes (lo: values 0-15, hi: 16-31 of each block), zero-extended by halves. */
    const wgroup n = load_q4(g, qtype, count);
    const __m256i zero = _mm256_setzero_si256();
    w.p[0] = _mm256_unpacklo_epi8(n.lo, zero);
    w.p[1] = _mm256_unpackhi_epi8(n.lo, zero);
    w.p[2] = _mm256_unpacklo_epi8(n.hi, zero);
    w.p[3] = _mm256_unpackhi_epi8(n.hi, zero);
    w.d = n.d;
    w.m = n.m;
    return w;
}

/* Piece k of a widened weight group times piece k of the int16 activations at x: 8 int32 lanes
 * of 2 products. */
INLINE __m256i madd_piece(const wgroup16 *w, const int16_t *x, int k) {
    return _mm256_madd_epi16(w->p[k], _mm256_loadu_si256((const __m256i *)x + k));
}

/* The int32 lanes (2 x 2 products each for Q8_0, 4 x 2 for the 4-bit formats) of a widened weight
 * group times the int16 activations' group at x, with their corrections for Q4_0. Exact: |lane|
 * <= 8 x 128 x 32767. */
INLINE __m256i dot_group16(const wgroup16 *w, const int16_t *x, const int32_t *corr,
                           const int qtype) {
    const __m256i dot = _mm256_add_epi32(madd_piece(w, x, 0), madd_piece(w, x, 1));
    if (qtype == NS_Q8_0) return dot;
    const __m256i all = _mm256_add_epi32(
        dot, _mm256_add_epi32(madd_piece(w, x, 2), madd_piece(w, x, 3)));
    if (qtype != NS_Q4_0) return all;
    return _mm256_add_epi32(all, _mm256_loadu_si256((const __m256i *)corr));
}

/* tile_step for int16 activations. */
INLINE void tile_step16(__m256 acc[8][4], const ns_tile *t, Py_ssize_t g, const int mr,
                        const int nr, const int qtype, const int count, const int from_panel) {
    const size_t gbytes = (size_t)GROUP(qtype) * ns_block_bytes(qtype);
    const ns_xq *xq = t->a->x;
    wgroup16 w[4];
#pragma GCC unroll 4
    for (int c = 0; c < nr; c++)
        w[c] = from_panel ? ((const wgroup16 *)t->panel)[c * t->groups + g]
                          : load_group16(t->a->w + (size_t)(t->c0 + c) * t->a->row_bytes +
                                             (size_t)g * gbytes,
                                         qtype, count);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const int16_t *x = xq->q16 + (t->r0 + r) * xq->q_stride + g * GROUP(qtype) * QK;
        const Py_ssize_t lane = (t->r0 + r) * xq->lane_stride + g * 8;
#pragma GCC unroll 4
        for (int c = 0; c < nr; c++)
            acc[r][c] = scale_add(acc[r][c], dot_group16(&w[c], x, xq->corr + lane, qtype),
                                  w[c].d, w[c].m, xq->dx + lane, xq->sx + lane, qtype);
    }
}

/* The 8 lanes added in a fixed order. */
INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define VEC __m256
#define VEC_ZERO _mm256_setzero_ps
#define VEC_SUM hsum

/* int8, as measured on an x86-64-v3 build (16 registers): 3 x 2 tiles beat 4 x 2, 2 x 2 and
 * 4 x 1 by 5-10% at M = 256, one column at a time beats two by ~15% at M = 4. */
#define MR 3
#define NR 2
#define NR_GEMV 1
#define TNAME(f) f##_avx2
#include "quant_tiles.inc"
#undef MR
#undef NR
#undef NR_GEMV
#undef TNAME

/* int16, the same tiling over the widened groups and int16 activations: as measured (AVX-512
 * machine, this path forced), two columns at a time beat one by 5-10% at M = 1 and 4; 3 x 2, 4 x 2
 * and 6 x 2 GEMM tiles are within noise at M = 256. */
#define TNAME(f) f##_avx2_i16
#define wgroup wgroup16
#define load_group load_group16
#define tile_step tile_step16
#define MR 3
#define NR 2
#define NR_GEMV 2
#include "quant_tiles.inc"

void ns_qmm_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    if (a->x->wide)
        qmm_avx2_i16(a, n0, n1);
    else
        qmm_avx2(a, n0, n1);
}

#endif
