/* The decode attention's block step for AVX-512 (F, BW and VL): attention_simd.h compiled with
 * that instruction set's vocabulary (quant_isa.h). This file only picks it.
 */
#include "quant.h"

#if NS_X86
#define NS_AVX512 1
#include "attention_simd.h"

ATTN_BLOCK_KERNEL(ns_attn_block_avx512)
#endif
