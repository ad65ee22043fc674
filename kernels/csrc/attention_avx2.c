/* The decode attention's block step for AVX2 (with FMA and F16C): attention_simd.h compiled with
 * that instruction set's vocabulary (quant_isa.h). This file only picks it.
 */
#include "quant.h"

#if NS_X86
#include "attention_simd.h"

ATTN_BLOCK_KERNEL(ns_attn_block_avx2)
#endif
