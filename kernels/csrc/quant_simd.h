/* Each format's SIMD unpacking and kernel, written once for any vector width: quant_avx2.c,
 * quant_avx512.c and quant_avx512_vnni.c compile this once per instruction set, after its
 * vocabulary (quant_isa.h), and export its table of kernels (SIMD_KERNELS, at the end) as
 * NS_AVX2_KERNELS, NS_AVX512_KERNELS and NS_AVX512_VNNI_KERNELS, which quant.c picks from.
 *
 * An unpack reads the blocks at w of STRIP_W rows of W (row c's at w + c stride) into a strip
 * (quant_strips.h): each column's scales and its values as the pairs of the format's `pairs`
 * (quant.h). A K-quant's unpacks a whole super-block, each sub-block j into s[j], from one
 * transpose of each 16 bytes of W (src_rows: a load where W is repacked, quant_r16.c).
 */
#include "quant_blocks.h"
#include "quant_f16.h"
#include "quant_strips.h"

/* ---------------------------------------------------------------- Q8_0 */

/* Each row's d, and g, g1 as transpose_rows gives the values (lane c: row c's bytes 4i .. 4i + 3
 * of qs, and of qs + 16), from the file's rows or plain loads of the r16 layout (quant_r16.c: the
 * values' words, then the rows' d). */
NS_INLINE fvec q8_0_src(ivec g[4], ivec g1[4], strip_src src) {
    if (src.r16) {
        src_rows(g, src, 0);
        src_rows(g1, src, 16);
        return src_last_half(src, sizeof(block_q8_0));
    }
    transpose_rows(g, src.w + offsetof(block_q8_0, qs), src.stride);
    transpose_rows(g1, src.w + offsetof(block_q8_0, qs) + 16, src.stride);
    return half_floats(row_words(src.w, src.stride), 0);
}

/* Lane bytes b0..b3 (values 4q..4q+3 of a half) as the pairs (b0, b2) and (b1, b3),
 * sign-extended (NS_BYTE_PAIRS). */
NS_INLINE void q8_0_unpack(strip *s, strip_src src) {
    ivec g[4], g1[4];
    s->d = q8_0_src(g, g1, src);
    s->m = fv_zero();
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        s->p[2 * q] = iv_sar16(iv_shl16(g[q], 8), 8);
        s->p[2 * q + 1] = iv_sar16(g[q], 8);
        s->p[8 + 2 * q] = iv_sar16(iv_shl16(g1[q], 8), 8);
        s->p[8 + 2 * q + 1] = iv_sar16(g1[q], 8);
    }
}

/* As q8_0_unpack, into bytes (the byte GEMV): each value plus 128, as unsigned bytes. */
NS_INLINE void q8_0_unpack_bytes(strip8 *s, strip_src src) {
    ivec g[4], g1[4];
    s->d = q8_0_src(g, g1, src);
    s->m = s->d2 = fv_zero();
    const ivec offset = iv_set8(-128);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        s->v[i] = iv_xor(g[i], offset);
        s->v[4 + i] = iv_xor(g1[i], offset);
    }
}

static const strip_format Q8_0_STRIPS = {.unpack = q8_0_unpack,
                                         .block_bytes = sizeof(block_q8_0),
                                         .unpack_bytes = q8_0_unpack_bytes,
                                         .byte_signed = 1};

static NS_KERNEL void q8_0_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q8_0_STRIPS);
}

/* ---------------------------------------------------------------- Q4_0, Q4_1 */

/* d and the nibble pairs less 8 (NS_NIBBLE_PAIRS). */
NS_INLINE void q4_0_unpack(strip *s, strip_src src) {
    const char *w = src.w;
    const size_t stride = src.stride;
    strip_heads(&s->d, &s->m, w, stride, 0);
    ivec g[4];
    transpose_rows(g, (const char *)((const block_q4_0 *)w)->qs, stride);
    nibble_pairs(s->p, g, 8);
}

/* d, m and the nibble pairs (NS_NIBBLE_PAIRS). */
NS_INLINE void q4_1_unpack(strip *s, strip_src src) {
    const char *w = src.w;
    const size_t stride = src.stride;
    strip_heads(&s->d, &s->m, w, stride, 1);
    ivec g[4];
    transpose_rows(g, (const char *)((const block_q4_1 *)w)->qs, stride);
    nibble_pairs(s->p, g, 0);
}

static const strip_format Q4_0_STRIPS = {q4_0_unpack, sizeof(block_q4_0), 0};
static const strip_format Q4_1_STRIPS = {q4_1_unpack, sizeof(block_q4_1), 1};

static NS_KERNEL void q4_0_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q4_0_STRIPS);
}

static NS_KERNEL void q4_1_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q4_1_STRIPS);
}

/* ---------------------------------------------------------------- MXFP4 */

/* Each row's scale e in its int32 lane, and g as transpose_rows gives the codes (lane c: row c's
 * bytes 4i .. 4i + 3 of qs): from the file's rows (e its block's first byte), or plain loads of
 * the r16 layout (quant_r16.c: the codes' words first, then the rows' e, one byte each). */
NS_INLINE ivec mxfp4_src(ivec g[4], strip_src src) {
    if (src.r16) {
        src_rows(g, src, 0);
        return iv_bytes32(src.w + 64 * (size_t)src.words + STRIP_W * src.half);
    }
    transpose_rows(g, (const char *)((const block_mxfp4 *)src.w)->qs, src.stride);
    return iv_and(row_words(src.w, src.stride), iv_set32(255));
}

/* d = 2^(e - 128) (ns_e8m0_half: e << 23 is 2^(e - 127) as a float's bits, the subnormal 2^-127
 * for e = 0, halved exactly) and the nibble pairs (NS_NIBBLE_PAIRS) looked up in
 * NS_MXFP4_VALUES: each int16's low byte indexes the table, its high byte (0) takes table[0] = 0,
 * and the int8 value is then sign-extended. */
NS_INLINE void mxfp4_unpack(strip *s, strip_src src) {
    ivec g[4];
    const ivec e = mxfp4_src(g, src);
    s->d = fv_mul(iv_as_fv(iv_max32(iv_shl32(e, 23), iv_set32(0x00400000))), fv_set(0.5f));
    s->m = fv_zero();
    nibble_pairs(s->p, g, 0);
    const ivec table = iv_table16(NS_MXFP4_VALUES);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) s->p[j] = iv_sar16(iv_shl16(iv_lookup8(table, s->p[j]), 8), 8);
}

/* As mxfp4_unpack, into bytes (the byte GEMV): each value (NS_MXFP4_VALUES, -12..12) plus 128,
 * as unsigned bytes, as Q8_0's. Byte j of qs holds value j (low nibble) and j + 16 (high). */
NS_INLINE void mxfp4_unpack_bytes(strip8 *s, strip_src src) {
    ivec g[4];
    const ivec e = mxfp4_src(g, src);
    s->d = fv_mul(iv_as_fv(iv_max32(iv_shl32(e, 23), iv_set32(0x00400000))), fv_set(0.5f));
    s->m = fv_zero();
    s->d2 = fv_zero();
    const ivec table = iv_table16(NS_MXFP4_VALUES), nibbles = iv_set8(15), offset = iv_set8(-128);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        s->v[i] = iv_xor(iv_lookup8(table, iv_and(g[i], nibbles)), offset);
        s->v[4 + i] = iv_xor(iv_lookup8(table, iv_and(iv_shr32(g[i], 4), nibbles)), offset);
    }
}

static const strip_format MXFP4_STRIPS = {.unpack = mxfp4_unpack,
                                          .block_bytes = sizeof(block_mxfp4),
                                          .unpack_bytes = mxfp4_unpack_bytes,
                                          .byte_signed = 1};

static NS_KERNEL void mxfp4_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, MXFP4_STRIPS);
}

/* ---------------------------------------------------------------- Q5_0, Q5_1 */

/* p[j] of a 5-bit block: nibble pairs (nibble_pairs of g) with qh's bits (lane c: row c's qh) at
 * bit 4 of each int16, less zero_point (Q5_0's 16). A pair's two values are 2 apart, so each
 * takes its own shift: the low int16 of pair 4q + i is value 4q + (i & 1) 16 + i / 2. */
NS_INLINE void q5_pairs(ivec p[16], const ivec g[4], ivec qh, const int zero_point) {
    nibble_pairs(p, g, 0);
    const ivec lo = iv_set32(0x10), hi = iv_set32(0x100000), zp = iv_set16(zero_point);
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const int l = 4 * q + (i & 1) * 16 + (i >> 1);
            ivec v = iv_or_and(p[4 * q + i], iv_shift32(qh, 4 - l), lo);
            v = iv_or_and(v, iv_shift32(qh, 18 - l), hi);
            p[4 * q + i] = zero_point ? iv_sub16(v, zp) : v;
        }
}

/* A 5-bit block's d (and m where has_min), g as transpose_rows gives its qs, and its qh (lane c:
 * row c's), from the file's rows or plain loads of the r16 layout (quant_r16.c): Q5_0's words
 * are qh and qs, after its d (the rows' d then follow the words), Q5_1's d and m, qh and qs. */
NS_INLINE ivec q5_src(ivec g[4], fvec *d, fvec *m, strip_src src, const int has_min) {
    const size_t qh = has_min ? offsetof(block_q5_1, qh) : offsetof(block_q5_0, qh);
    if (!src.r16) {
        strip_heads(d, m, src.w, src.stride, has_min);
        transpose_rows(g, src.w + qh + 4, src.stride);
        return row_words(src.w + qh, src.stride);
    }
    const size_t word = has_min ? 1 : 0; /* qh's, in the words after the lead */
    if (has_min) {
        const ivec h = iv_loadu(src.w + 32 * src.half);
        *d = half_floats(h, 0);
        *m = half_floats(h, 1);
    } else {
        *d = src_last_half(src, sizeof(block_q5_0));
        *m = fv_zero();
    }
    src_rows(g, src, 4 * word + 4);
    return iv_loadu(src.w + 64 * word + 32 * src.half);
}

/* d (and m where has_min) and the 5-bit pairs (NS_NIBBLE_PAIRS), less 16 for Q5_0. */
NS_INLINE void q5_unpack(strip *s, strip_src src, const int has_min) {
    ivec g[4];
    const ivec qh = q5_src(g, &s->d, &s->m, src, has_min);
    q5_pairs(s->p, g, qh, has_min ? 0 : 16);
}

NS_INLINE void q5_0_unpack(strip *s, strip_src src) { q5_unpack(s, src, 0); }
NS_INLINE void q5_1_unpack(strip *s, strip_src src) { q5_unpack(s, src, 1); }

/* A 5-bit block's values 0..31 as bytes (the byte GEMV) into v, value 4i + t at byte t of v[i]'s
 * lanes: the nibble from g (transpose_rows of qs: v[i] the low nibbles of g[i], v[4 + i] the high
 * ones), bit 4 from qh (lane c: row c's): the byte of qh that holds v[i]'s four bits (byte i / 2)
 * copied into each byte of the lane, then each byte tested for its own bit. */
NS_INLINE void q5_bytes(ivec v[8], const ivec g[4], ivec qh) {
    static const uint32_t lane_bytes[16] = {0, 0x04040404, 0x08080808, 0x0c0c0c0c,
                                            0, 0x04040404, 0x08080808, 0x0c0c0c0c,
                                            0, 0x04040404, 0x08080808, 0x0c0c0c0c,
                                            0, 0x04040404, 0x08080808, 0x0c0c0c0c};
    const ivec lanes = iv_loadu((const char *)lane_bytes), nibbles = iv_set8(15);
    const ivec bit = iv_set8(16), even = iv_set32(0x08040201), odd = iv_set32(0x80402010);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        v[i] = iv_and(g[i], nibbles);
        v[4 + i] = iv_and(iv_shr32(g[i], 4), nibbles);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) { /* qh's byte k: the bits of v[2k] and v[2k + 1] */
        const ivec x = iv_lookup8(qh, iv_or(lanes, iv_set8(k)));
        v[2 * k] = iv_or_where(v[2 * k], x, even, bit);
        v[2 * k + 1] = iv_or_where(v[2 * k + 1], x, odd, bit);
    }
}

/* As q5_unpack, into bytes (the byte GEMV): the values 0..31, Q5_0's zero point left to
 * byte_step (byte_zero). */
NS_INLINE void q5_unpack_bytes(strip8 *s, strip_src src, const int has_min) {
    ivec g[4];
    const ivec qh = q5_src(g, &s->d, &s->m, src, has_min);
    s->d2 = fv_zero();
    q5_bytes(s->v, g, qh);
}

NS_INLINE void q5_0_unpack_bytes(strip8 *s, strip_src src) { q5_unpack_bytes(s, src, 0); }
NS_INLINE void q5_1_unpack_bytes(strip8 *s, strip_src src) { q5_unpack_bytes(s, src, 1); }

static const strip_format Q5_0_STRIPS = {.unpack = q5_0_unpack,
                                         .block_bytes = sizeof(block_q5_0),
                                         .unpack_bytes = q5_0_unpack_bytes,
                                         .byte_zero = 16};
static const strip_format Q5_1_STRIPS = {.unpack = q5_1_unpack,
                                         .block_bytes = sizeof(block_q5_1),
                                         .has_min = 1,
                                         .unpack_bytes = q5_1_unpack_bytes};

static NS_KERNEL void q5_0_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q5_0_STRIPS);
}

static NS_KERNEL void q5_1_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q5_1_STRIPS);
}

/* ---------------------------------------------------------------- Q4_K, Q5_K */

/* Each sub-block j's d sc and -(dmin m) (kquant_sub_scales) into s[j], from the 16 bytes that
 * start each row's block. */
NS_INLINE void kquant_heads(strip s[KQ_SUBS], strip_src src) {
    ivec g[4]; /* lane r: row r's d and dmin, scales 0..3, 4..7, 8..11 */
    src_rows(g, src, 0);
    const fvec d = half_floats(g[0], 0), dmin = half_floats(g[0], 1);
    const ivec six = iv_set32(63), four = iv_set32(15), top = iv_set32(3);
#pragma GCC unroll 8
    for (int j = 0; j < KQ_SUBS; j++) {
        const int sh = 8 * (j & 3);
        ivec sc, m;
        if (j < 4) {
            sc = iv_and(iv_shr32(g[1], sh), six);
            m = iv_and(iv_shr32(g[2], sh), six);
        } else {
            sc = iv_or(iv_and(iv_shr32(g[3], sh), four),
                       iv_shl32(iv_and(iv_shr32(g[1], sh + 6), top), 4));
            m = iv_or(iv_and(iv_shr32(g[3], sh + 4), four),
                      iv_shl32(iv_and(iv_shr32(g[2], sh + 6), top), 4));
        }
        s[j].d = fv_mul(d, iv_to_fv(sc));
        s[j].m = fv_sub(fv_zero(), fv_mul(dmin, iv_to_fv(m)));
        s[j].d2 = fv_zero();
    }
}

/* Scales and the pairs (NS_BYTE_PAIRS) of each sub-block; 32 bytes of qs hold two. */
NS_INLINE void q4_k_unpack(strip *s, strip_src src) {
    kquant_heads(s, src);
    const ivec nibbles = iv_set8(15);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const size_t q = offsetof(block_q4_K, qs) + 32 * c;
        ivec g[4], g1[4], v[4], v1[4];
        src_rows(g, src, q);
        src_rows(g1, src, q + 16);
#pragma GCC unroll 2
        for (int shift = 0; shift <= 4; shift += 4) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                v[i] = iv_and(iv_shr32(g[i], shift), nibbles);
                v1[i] = iv_and(iv_shr32(g1[i], shift), nibbles);
            }
            byte_pairs(s[2 * c + shift / 4].p, v, v1, 0);
        }
    }
}

/* As q4_k_unpack, into bytes (the byte GEMV): each sub-block's nibbles as they are. The K-quants'
 * byte unpackings repeat their pair unpackings' steps rather than feed them: built from these
 * bytes (a pass through a strip8 buffer), the int16 GEMV of Q4_K, Q5_K and Q6_K measured 15-20%
 * slower on the AMD EPYC (13.7-15.5 against 16-18.5 GB/s, one thread). */
NS_INLINE void q4_k_unpack_bytes(strip8 *s, strip_src src) {
    strip heads[KQ_SUBS];
    kquant_heads(heads, src);
    const ivec nibbles = iv_set8(15);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const size_t q = offsetof(block_q4_K, qs) + 32 * c;
        ivec g[4], g1[4];
        src_rows(g, src, q);
        src_rows(g1, src, q + 16);
#pragma GCC unroll 2
        for (int shift = 0; shift <= 4; shift += 4) {
            strip8 *t = s + 2 * c + shift / 4;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                t->v[i] = iv_and(iv_shr32(g[i], shift), nibbles);
                t->v[4 + i] = iv_and(iv_shr32(g1[i], shift), nibbles);
            }
            t->d = heads[2 * c + shift / 4].d;
            t->m = heads[2 * c + shift / 4].m;
            t->d2 = fv_zero();
        }
    }
}

/* As q4_k_unpack, each value's bit of qh at bit 4. */
NS_INLINE void q5_k_unpack(strip *s, strip_src src) {
    kquant_heads(s, src);
    ivec h[4], h1[4];
    src_rows(h, src, offsetof(block_q5_K, qh));
    src_rows(h1, src, offsetof(block_q5_K, qh) + 16);
    const ivec nibbles = iv_set8(15), bit = iv_set8(16);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const size_t q = offsetof(block_q5_K, qs) + 32 * c;
        ivec g[4], g1[4], v[4], v1[4];
        src_rows(g, src, q);
        src_rows(g1, src, q + 16);
#pragma GCC unroll 2
        for (int j = 2 * c; j < 2 * c + 2; j++) {
            const int shift = 4 * (j & 1);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) { /* bit j of each byte of qh to bit 4, the nibble below */
                v[i] = iv_or(iv_and(iv_shr32(g[i], shift), nibbles),
                             iv_and(iv_shift32(h[i], 4 - j), bit));
                v1[i] = iv_or(iv_and(iv_shr32(g1[i], shift), nibbles),
                              iv_and(iv_shift32(h1[i], 4 - j), bit));
            }
            byte_pairs(s[j].p, v, v1, 0);
        }
    }
}

static void q4_k_tiles(const ns_qmm *a, const strip *panel, Py_ssize_t n0, Py_ssize_t n1,
                       gemm_chunk k);
static const strip_format Q4_K_STRIPS = {.block_bytes = sizeof(block_q4_K),
                                         .has_min = 1,
                                         .subs = KQ_SUBS,
                                         .unpack_super = q4_k_unpack,
                                         .unpack_bytes = q4_k_unpack_bytes,
                                         .tiles = q4_k_tiles};
OUT_OF_LINE_TILES(q4_k_tiles, Q4_K_STRIPS)
/* As q5_k_unpack, into bytes (the byte GEMV). */
NS_INLINE void q5_k_unpack_bytes(strip8 *s, strip_src src) {
    strip heads[KQ_SUBS];
    kquant_heads(heads, src);
    ivec h[4], h1[4];
    src_rows(h, src, offsetof(block_q5_K, qh));
    src_rows(h1, src, offsetof(block_q5_K, qh) + 16);
    const ivec nibbles = iv_set8(15), bit = iv_set8(16);
#pragma GCC unroll 4
    for (int c = 0; c < KQ_SUBS / 2; c++) {
        const size_t q = offsetof(block_q5_K, qs) + 32 * c;
        ivec g[4], g1[4];
        src_rows(g, src, q);
        src_rows(g1, src, q + 16);
#pragma GCC unroll 2
        for (int j = 2 * c; j < 2 * c + 2; j++) {
            const int shift = 4 * (j & 1);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                s[j].v[i] = iv_or(iv_and(iv_shr32(g[i], shift), nibbles),
                                  iv_and(iv_shift32(h[i], 4 - j), bit));
                s[j].v[4 + i] = iv_or(iv_and(iv_shr32(g1[i], shift), nibbles),
                                      iv_and(iv_shift32(h1[i], 4 - j), bit));
            }
            s[j].d = heads[j].d;
            s[j].m = heads[j].m;
            s[j].d2 = fv_zero();
        }
    }
}

static void q5_k_tiles(const ns_qmm *a, const strip *panel, Py_ssize_t n0, Py_ssize_t n1,
                       gemm_chunk k);
static const strip_format Q5_K_STRIPS = {.block_bytes = sizeof(block_q5_K),
                                         .has_min = 1,
                                         .subs = KQ_SUBS,
                                         .unpack_super = q5_k_unpack,
                                         .unpack_bytes = q5_k_unpack_bytes,
                                         .tiles = q5_k_tiles};
OUT_OF_LINE_TILES(q5_k_tiles, Q5_K_STRIPS)

static NS_KERNEL void q4_k_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q4_K_STRIPS);
}

static NS_KERNEL void q5_k_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q5_K_STRIPS);
}

/* ---------------------------------------------------------------- Q6_K */

/* Scale 2t + which (which: 0 or 1) of each row, from g (lane r: a row's scales 4i .. 4i + 3,
 * i = t / 2), sign-extended, as int32 lanes: its byte shifted to the top, then back down. */
NS_INLINE ivec q6_k_scale(ivec g, int t, int which) {
    const int byte = 2 * (t & 1) + which;
    return iv_sar32(iv_shl32(g, 24 - 8 * byte), 24);
}

/* d sc of each sub-block's halves and the pairs less 32 (NS_BYTE_PAIRS), from one transpose of
 * each 16 bytes of ql, qh and the scales. */
NS_INLINE void q6_k_unpack(strip *s, strip_src src) {
    const fvec d = src_last_half(src, offsetof(block_q6_K, d));
    ivec sc[4];
    src_rows(sc, src, offsetof(block_q6_K, scales));
#pragma GCC unroll 8
    for (int t = 0; t < KQ_SUBS; t++) {
        s[t].d = fv_mul(d, iv_to_fv(q6_k_scale(sc[t / 2], t, 0)));
        s[t].d2 = fv_mul(d, iv_to_fv(q6_k_scale(sc[t / 2], t, 1)));
        s[t].m = fv_zero();
    }
    const ivec nibbles = iv_set8(15), two = iv_set8(3 << 4);
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
        ivec h[4], h1[4];
        src_rows(h, src, offsetof(block_q6_K, qh) + 32 * half);
        src_rows(h1, src, offsetof(block_q6_K, qh) + 32 * half + 16);
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) { /* ql bytes 32k .. 32k + 31: sub-blocks k, k + 2 */
            ivec g[4], g1[4];
            src_rows(g, src, offsetof(block_q6_K, ql) + 64 * half + 32 * k);
            src_rows(g1, src, offsetof(block_q6_K, ql) + 64 * half + 32 * k + 16);
#pragma GCC unroll 2
            for (int u = k; u < 4; u += 2) {
                const int shift = 4 * (u >> 1);
                ivec v[4], v1[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) { /* qh's 2 bits at 2u to bits 4, 5 of each byte */
                    v[i] = iv_or(iv_and(iv_shr32(g[i], shift), nibbles),
                                 iv_and(iv_shift32(h[i], 4 - 2 * u), two));
                    v1[i] = iv_or(iv_and(iv_shr32(g1[i], shift), nibbles),
                                  iv_and(iv_shift32(h1[i], 4 - 2 * u), two));
                }
                byte_pairs(s[4 * half + u].p, v, v1, 32);
            }
        }
    }
}

/* As q6_k_unpack, into bytes (the byte GEMV): the values 0..63, their zero point left to
 * byte_step. */
NS_INLINE void q6_k_unpack_bytes(strip8 *s, strip_src src) {
    const fvec d = src_last_half(src, offsetof(block_q6_K, d));
    ivec sc[4];
    src_rows(sc, src, offsetof(block_q6_K, scales));
#pragma GCC unroll 8
    for (int t = 0; t < KQ_SUBS; t++) {
        s[t].d = fv_mul(d, iv_to_fv(q6_k_scale(sc[t / 2], t, 0)));
        s[t].d2 = fv_mul(d, iv_to_fv(q6_k_scale(sc[t / 2], t, 1)));
        s[t].m = fv_zero();
    }
    const ivec nibbles = iv_set8(15), two = iv_set8(3 << 4);
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
        ivec h[4], h1[4];
        src_rows(h, src, offsetof(block_q6_K, qh) + 32 * half);
        src_rows(h1, src, offsetof(block_q6_K, qh) + 32 * half + 16);
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            ivec g[4], g1[4];
            src_rows(g, src, offsetof(block_q6_K, ql) + 64 * half + 32 * k);
            src_rows(g1, src, offsetof(block_q6_K, ql) + 64 * half + 32 * k + 16);
#pragma GCC unroll 2
            for (int u = k; u < 4; u += 2) {
                const int shift = 4 * (u >> 1);
                ivec *v = s[4 * half + u].v;
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    v[i] = iv_or(iv_and(iv_shr32(g[i], shift), nibbles),
                                 iv_and(iv_shift32(h[i], 4 - 2 * u), two));
                    v[4 + i] = iv_or(iv_and(iv_shr32(g1[i], shift), nibbles),
                                     iv_and(iv_shift32(h1[i], 4 - 2 * u), two));
                }
            }
        }
    }
}

static void q6_k_tiles(const ns_qmm *a, const strip *panel, Py_ssize_t n0, Py_ssize_t n1,
                       gemm_chunk k);
static const strip_format Q6_K_STRIPS = {.block_bytes = sizeof(block_q6_K),
                                         .subs = KQ_SUBS,
                                         .unpack_super = q6_k_unpack,
                                         .halves = 1,
                                         .unpack_bytes = q6_k_unpack_bytes,
                                         .tiles = q6_k_tiles};
OUT_OF_LINE_TILES(q6_k_tiles, Q6_K_STRIPS)

static NS_KERNEL void q6_k_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, Q6_K_STRIPS);
}

/* ----------------------------------- the K-quants, MXFP4, Q5_0, Q5_1 and Q8_0 repacked (r16) */

/* The strip formats above with r16 set: the same unpackings, reading W through strip_src's loads. */
NS_INLINE strip_format repacked(strip_format f) {
    f.r16 = 1;
    return f;
}

static NS_KERNEL void q4_k_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(Q4_K_STRIPS));
}

static NS_KERNEL void q5_k_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(Q5_K_STRIPS));
}

static NS_KERNEL void q6_k_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(Q6_K_STRIPS));
}

static NS_KERNEL void q5_0_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(Q5_0_STRIPS));
}

static NS_KERNEL void q5_1_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(Q5_1_STRIPS));
}

static NS_KERNEL void q8_0_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(Q8_0_STRIPS));
}

static NS_KERNEL void mxfp4_r16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    strip_matmul(a, n0, n1, repacked(MXFP4_STRIPS));
}

/* ---------------------------------------------------------------- F16, BF16 */

/* out[r0 .. r0 + mr, n .. n + nc] (nc <= F16_ROWS): per row of x and of W, 2 STRIP_W lanes along K
 * in two registers, added and then reduced in a fixed order; each output's operations the same
 * whatever nc. */
NS_INLINE void f16_dots_rows(const ns_qmm *a, Py_ssize_t r0, const int mr, Py_ssize_t n,
                             const int nc, const char *row, const int bf16) {
    fvec acc[NS_GEMV_ROWS][F16_ROWS][2];
#pragma GCC unroll 4
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++) acc[m][c][0] = acc[m][c][1] = fv_zero();
    const float *x = a->xf + r0 * a->K;
    for (Py_ssize_t k = 0; k < a->K; k += 2 * STRIP_W) {
        fvec w[F16_ROWS][2];
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++) {
            w[c][0] = widen(row + c * a->row_bytes + 2 * k, bf16);
            w[c][1] = widen(row + c * a->row_bytes + 2 * k + 2 * STRIP_W, bf16);
        }
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            const fvec x0 = fv_load(x + m * a->K + k), x1 = fv_load(x + m * a->K + k + STRIP_W);
#pragma GCC unroll 2
            for (int c = 0; c < nc; c++) {
                acc[m][c][0] = fv_fma(x0, w[c][0], acc[m][c][0]);
                acc[m][c][1] = fv_fma(x1, w[c][1], acc[m][c][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++)
            a->out[(r0 + m) * a->ldo + n + c] = fv_sum(fv_add(acc[m][c][0], acc[m][c][1]));
}

/* f16_dots_rows, F16_ROWS of W's rows at a time. */
NS_INLINE void f16_dots(const ns_qmm *a, Py_ssize_t r0, const int mr, Py_ssize_t n, const int nc,
                        const char *row, const int bf16) {
    if (nc <= F16_ROWS) {
        f16_dots_rows(a, r0, mr, n, nc, row, bf16);
        return;
    }
    for (int c = 0; c < nc; c++) f16_dots_rows(a, r0, mr, n + c, 1, row + c * a->row_bytes, bf16);
}

static NS_KERNEL void f16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 0, f16_dots);
}

static NS_KERNEL void bf16_simd(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    f16_matmul(a, n0, n1, 1, f16_dots);
}

/* This instruction set's kernels by GGML type id: the file that compiles this exports it. */
static const ns_matmul_fn SIMD_KERNELS[NS_NUM_GGML_TYPES] = {
    [GGML_Q8_0] = q8_0_simd, [GGML_Q4_0] = q4_0_simd, [GGML_Q4_1] = q4_1_simd,
    [GGML_Q5_0] = q5_0_simd, [GGML_Q5_1] = q5_1_simd, [GGML_Q4_K] = q4_k_simd,
    [GGML_Q5_K] = q5_k_simd, [GGML_Q6_K] = q6_k_simd, [GGML_F16] = f16_simd,
    [GGML_BF16] = bf16_simd, [GGML_MXFP4] = mxfp4_simd, [NS_Q4_K_R16] = q4_k_r16_simd,
    [NS_Q5_K_R16] = q5_k_r16_simd, [NS_Q6_K_R16] = q6_k_r16_simd, [NS_MXFP4_R16] = mxfp4_r16_simd,
    [NS_Q5_0_R16] = q5_0_r16_simd, [NS_Q5_1_R16] = q5_1_r16_simd, [NS_Q8_0_R16] = q8_0_r16_simd,
};
