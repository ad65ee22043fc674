/* The AVX-512 path of the quantized matmul (see quant.h and quant_avx2.c, whose scheme this widens
 * to 512 bits): AVX-512 F/BW/VL, with vpdpbusd where the CPU has AVX512-VNNI. The body,
 * quant_avx512.inc, is compiled twice from this file, once for each target; quant.c picks one.
 *
 * Every format goes four blocks at a time, one per 128-bit lane: bytes 0-15 of each block's
 * values in one register, 16-31 in another (a 4-bit block's low and high nibbles; a Q8_0 block's
 * halves), against activations split the same way, so each block gets 4 int32 lanes and a group's
 * scaling is one convert, one multiply and one FMA however many bits the weights have. One load
 * (two for Q8_0) and one vpermw spread each block's fp16 d (and m) over its lanes. With VNNI,
 * Q8_0's signed weights go in as q + 128 (unsigned) and the activations' lane sums times 128 come
 * off in the dot's starting value, as Q4_0's zero point 8 does; without, the sign trick of the
 * AVX2 path. int16 activations (quant_avx512_i16.inc) turn the registers around: a lane for each of
 * 16 output columns, pairs of a block's values widened to int16 once per block, vpdpwssd (VNNI) or
 * vpmaddwd + vpaddd taking the products, one scaling per 16 of them.
 *
 * Compiled twice, so that the two targets build in parallel: on its own for the AVX-512 F/BW/VL
 * target and the layouts, and through quant_avx512_vnni.c (NS_AVX512_VNNI defined) for VNNI.
 */
#include "quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <stdlib.h>

/* A panel of unpacked weights takes at most PANEL_BYTES (int8; PANEL_STRIP_BYTES int16, whose
 * unpacked strips are 4x the bytes of 4-bit blocks) to stay in L1/L2; the GEMV takes up to
 * GEMV_ROWS rows. The int8 tiles' sizes (MR, NR, NR_GEMV) are set in quant_avx512.inc. */
enum { GEMV_ROWS = 4, PANEL_BYTES = 32 << 10, PANEL_STRIP_BYTES = 256 << 10 };

/* Blocks per group, one per 128-bit lane, whatever the format. */
#define GROUP(qtype) 4

#ifndef NS_AVX512_VNNI
ns_xq_layout ns_layout_avx512(int qtype, int vnni, int wide) {
    /* int16: a block at a time, its values in the pairs a vpdpwssd broadcasts (see
     * quant_strips.inc); one lane a block; Q4_0's weights come unpacked less 8. */
    if (wide) return (ns_xq_layout){1, 1, QK, 0, 1, qtype == NS_Q8_0 ? NS_PAIRS_8 : NS_PAIRS_4};
    /* int8: halves of 16 bytes, maddubs + madd / vpdpbusd adding 4 a lane. */
    const int corr = qtype == NS_Q4_0 ? 8 : qtype == NS_Q8_0 && vnni ? 128 : 0;
    return (ns_xq_layout){GROUP(qtype), 2, 4, corr, 0};
}
#endif

/* vpermt2w indices (16-bit words of a group's first 64 bytes, then 32 on for Q8_0's second load
 * from byte 68): each block's d over its lanes, then Q4_1's m; a block's d is its first word, m its
 * second. */
#define REP4(w) w, w, w, w
static const uint16_t HEADS_Q4_1[32] = {REP4(0), REP4(10), REP4(20), REP4(30),
                                        REP4(1), REP4(11), REP4(21), REP4(31)};
static const uint16_t HEADS_Q4_0[32] = {REP4(0), REP4(9), REP4(18), REP4(27)};
static const uint16_t HEADS_Q8_0[32] = {REP4(0), REP4(17), REP4(32), REP4(49)};
#undef REP4

#ifndef NS_AVX512_VNNI
#define TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define VNNI 0
#define NAME(f) f##_plain
#define ENTRY ns_qmm_avx512
#else
#define TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define VNNI 1
#define NAME(f) f##_vnni
#define ENTRY ns_qmm_avx512_vnni
#endif
#include "quant_avx512.inc"

void ENTRY(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    if (a->x->wide)
        NAME(qmm_i16)(a, n0, n1);
    else
        NAME(qmm)(a, n0, n1);
}

#endif
