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
 * The int8 tiling (quant_tiles.inc): a tile of up to MR rows of x by NR rows of W (output
 * features) shares each unpacked weight group among its rows; the GEMV streams W once, the GEMM
 * unpacks panels of W once for all its tiles of rows. Every output's own operations are the same
 * in any tile, so the two agree bitwise.
 *
 * int16 activations take quant_strips.inc's kernels, laid out along N (8 output columns a
 * register, vpmaddwd + vpaddd), as the AVX-512 path does. Here, without VNNI, they measured within
 * 5% of the lanes-along-K kernel they replaced (faster at M = 1500, 2-4% slower over a decode's
 * matrices from memory): the two vpmaddwd + vpaddd per 16 products bound both.
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
enum { GEMV_ROWS = 4, PANEL_BYTES = 32 << 10, PANEL_STRIP_BYTES = 256 << 10 };

ns_xq_layout ns_layout_avx2(int qtype, int wide) {
    const int corr = qtype == NS_Q4_0 ? 8 : 0;
    /* int16: a block at a time, its values in the pairs a vpmaddwd broadcasts (see
     * quant_strips.inc); one lane a block; Q4_0's weights come unpacked less 8. */
    if (wide) return (ns_xq_layout){1, 1, QK, 0, 1, qtype == NS_Q8_0 ? NS_PAIRS_8 : NS_PAIRS_4};
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

#undef VEC
#undef VEC_ZERO
#undef VEC_SUM

/* ---------------------------------------------------------------- int16 activations */

/* quant_strips.inc's kernels, 8 output columns a register, vpmaddwd + vpaddd. */
#define SNAME(f) f##_avx2
#define SW 8
#define VI __m256i
#define VF __m256
#define VI_ZERO _mm256_setzero_si256
#define VF_ZERO _mm256_setzero_ps
#define VI_SET1 _mm256_set1_epi32
#define VI_SET1_16 _mm256_set1_epi16
#define VF_SET1 _mm256_set1_ps
#define VI_AND _mm256_and_si256
#define VI_SRLI32 _mm256_srli_epi32
#define VI_SLLI16 _mm256_slli_epi16
#define VI_SRAI16 _mm256_srai_epi16
#define VI_SUB16 _mm256_sub_epi16
#define VF_CVT _mm256_cvtepi32_ps
#define VF_MUL _mm256_mul_ps
#define VF_FMA _mm256_fmadd_ps
#define DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
/* 16 registers: 3 x 2 tiles take 6 int32 and 6 float accumulators, 2 weights and a broadcast. */
#define MR 3
#define NR 2

/* 8 rows' 16 bytes (row r at src + r * stride) as g[q], lane r row r's bytes 4q..4q+3: rows r
 * and r + 4 in the halves of one register, then a 4 x 4 transpose of dwords within each half. */
INLINE void transpose_rows(__m256i g[4], const char *src, size_t stride) {
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

/* Each of 8 rows' block d (and m for Q4_1): the 4 bytes at each block's start, assembled in
 * registers, their 16-bit halves packed and widened. */
INLINE void strip_heads(__m256 *d, __m256 *m, const char *w, size_t stride, const int qtype) {
    uint32_t h[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) memcpy(&h[c], w + (size_t)c * stride, 4);
    const __m256i v = _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4],
                                        (int)h[5], (int)h[6], (int)h[7]);
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    /* packus of values under 2^16 keeps them; per 128-bit half, so the halves are put together. */
    const __m256i ds = _mm256_packus_epi32(_mm256_and_si256(v, low), _mm256_setzero_si256());
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(ds, 0x08)));
    if (qtype != NS_Q4_1) {
        *m = _mm256_setzero_ps();
        return;
    }
    const __m256i ms = _mm256_packus_epi32(_mm256_srli_epi32(v, 16), _mm256_setzero_si256());
    *m = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(ms, 0x08)));
}

/* v's first n lanes to out. */
INLINE void store_cols(float *out, int n, __m256 v) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
}

#include "quant_strips.inc"

void ns_qmm_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    if (a->x->wide)
        qmm_i16_avx2(a, n0, n1);
    else
        qmm_avx2(a, n0, n1);
}

#endif
