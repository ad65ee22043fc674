/* The AVX-512 path of the quantized matmul (see quant.h and quant_avx2.c, whose scheme this widens
 * to 512 bits): AVX-512 F/BW/VL, with vpdpbusd where the CPU has AVX512-VNNI. The body,
 * quant_avx512.inc, is compiled twice from this file, once for each target; quant.c picks one.
 *
 * The 4-bit formats go four blocks at a time (one per 128-bit lane), Q8_0 two (one per 256-bit
 * half). The fp16 headers of a group all lie in its first 64 bytes (4 x 20, 4 x 18 and 2 x 34
 * bytes are all at least 64), so one load and one vpermw spread each block's d (and m) over its
 * lanes. With VNNI, Q8_0's signed weights go in as q + 128 (unsigned) and the activations' lane
 * sums times 128 come off in the dot's starting value, as Q4_0's zero point 8 does; without, the
 * sign trick of the AVX2 path.
 */
#include "quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

enum { MR = 4, NR = 2, GEMV_ROWS = 4, PANEL_BYTES = 32 << 10 };

ns_xq_layout ns_layout_avx512(int qtype, int vnni) {
    if (qtype == NS_Q8_0) return (ns_xq_layout){2, 8, 0, vnni ? 128 : 0};
    return (ns_xq_layout){4, 4, 1, qtype == NS_Q4_0 ? 8 : 0};
}

/* vpermw indices (16-bit words of a group's first 64 bytes): each block's d over its lanes, then
 * (4-bit formats) each block's m; a block's d is its first word, m its second. */
#define REP4(w) w, w, w, w
#define REP8(w) REP4(w), REP4(w)
static const uint16_t HEADS_Q4_1[32] = {REP4(0), REP4(10), REP4(20), REP4(30),
                                        REP4(1), REP4(11), REP4(21), REP4(31)};
static const uint16_t HEADS_Q4_0[32] = {REP4(0), REP4(9), REP4(18), REP4(27)};
static const uint16_t HEADS_Q8_0[32] = {REP8(0), REP8(17)};
#undef REP4
#undef REP8

#define TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define VNNI 0
#define NAME(f) f##_plain
#include "quant_avx512.inc"
#undef TARGET
#undef VNNI
#undef NAME

#define TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define VNNI 1
#define NAME(f) f##_vnni
#include "quant_avx512.inc"

void ns_qmm_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) { qmm_plain(a, n0, n1); }
void ns_qmm_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) { qmm_vnni(a, n0, n1); }

#endif
