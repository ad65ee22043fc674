/* What Q5_0 and Q5_1 share (quant_q5_0.c, quant_q5_1.c): a 5-bit value is its nibble in qs (as
 * Q4_0's) and a fifth bit, bit j of the block's 32-bit qh for value j.
 */
#ifndef NANOSERVE_QUANT_Q5_H
#define NANOSERVE_QUANT_Q5_H

#include "quant_blocks.h"

/* Value j (0..31) of a block from its qs and qh, 0..31. */
static inline int q5_value(const uint8_t qs[QK / 2], uint32_t qh, int j) {
    const int nibble = j < QK / 2 ? qs[j] & 15 : qs[j - QK / 2] >> 4;
    return nibble | (int)((qh >> j) & 1u) << 4;
}

/* The 32 values of x as 5-bit q (in 0..31) packed into qs and qh, gguf's layout. */
static inline void q5_pack(uint8_t qs[QK / 2], uint8_t qh[4], const uint8_t q[QK]) {
    uint32_t bits = 0;
    uint8_t low[QK];
    for (int j = 0; j < QK; j++) {
        low[j] = q[j] & 15;
        bits |= (uint32_t)(q[j] >> 4) << j;
    }
    ns_pack_nibbles(qs, low);
    memcpy(qh, &bits, 4); /* little-endian, as gguf's packbits(bitorder="little") */
}

#endif
