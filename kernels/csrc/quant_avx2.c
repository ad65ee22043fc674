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
#define NAME(f) f##_avx2
#define INLINE static inline __attribute__((target(TARGET), always_inline))

/* GEMM tiles of MR rows by NR columns, GEMV tiles of NR_GEMV columns, as measured on an
 * x86-64-v3 build (16 registers): 3 x 2 tiles beat 4 x 2, 2 x 2 and 4 x 1 by 5-10% at M = 256,
 * one column at a time beats two by ~15% at M = 4. A panel of unpacked weights takes at most
 * PANEL_BYTES, to stay in L1/L2. */
enum { MR = 3, NR = 2, NR_GEMV = 1, GEMV_ROWS = 4, PANEL_BYTES = 32 << 10 };

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
        const __m256 dx = _mm256_loadu_ps(xq->dx + lane), sx = _mm256_loadu_ps(xq->sx + lane);
#pragma GCC unroll 4
        for (int c = 0; c < nr; c++) {
            const __m256i dot = dot_group(&w[c], x, xq->corr + lane, qtype);
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(w[c].d, dx),
                                        acc[r][c]);
            if (qtype == NS_Q4_1) acc[r][c] = _mm256_fmadd_ps(w[c].m, sx, acc[r][c]);
        }
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
#include "quant_tiles.inc"

void ns_qmm_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) { qmm_avx2(a, n0, n1); }

#endif
