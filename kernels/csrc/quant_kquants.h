/* What the K-quant formats (quant_q4_k.c, quant_q5_k.c, quant_q6_k.c) share: super-blocks of
 * QK_K = 256 values whose sub-blocks of 32 (Q6_K: 16) values each have a scale. The matmul takes
 * a super-block one 32-value sub-block at a time, as a 32-value format's block (the activations'
 * blocks are 32 values), the sub-block's scale folded into the block's d:
 *
 *     out += (d sc) dx dot(q, x) - (dmin m) sx      (Q4_K, Q5_K: 8 sub-blocks of 32)
 *     out += (d sc_lo) dx dot_lo + (d sc_hi) dx dot_hi      (Q6_K: 16 sub-blocks of 16)
 *
 * Q4_K and Q5_K start alike: fp16 d and dmin, then 12 bytes holding 8 six-bit scales and 8
 * six-bit mins (ggml's get_scale_min_k4 layout): sub-block j < 4 has the low 6 bits of bytes j
 * (scale) and j + 4 (min); j >= 4 has byte j + 4's low (scale) and high (min) nibbles as low 4
 * bits, bytes j - 4's and j's top 2 bits as high ones.
 */
#ifndef NANOSERVE_QUANT_KQUANTS_H
#define NANOSERVE_QUANT_KQUANTS_H

#include "quant_blocks.h"

/* Sub-block j's 6-bit scale and min. */
static inline void kquant_scale_min(const uint8_t s[12], int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Sub-block j's d sc and -(dmin m): what its dot and its activations' sx are scaled by. */
static inline void kquant_sub_scales(const kquant_head *h, int j, float *d, float *neg_m) {
    int sc, m;
    kquant_scale_min(h->scales, j, &sc, &m);
    *d = ns_f16_to_f32(h->d) * (float)sc;
    *neg_m = -(ns_f16_to_f32(h->dmin) * (float)m);
}

#endif
