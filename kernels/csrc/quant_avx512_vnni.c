/* The quantized matmul's AVX-512 kernels with VNNI's vpdpwssd for the dot steps
 * (q4_0_matmul_avx512_vnni and the others): quant_simd.h compiled with AVX-512's vocabulary, VNNI
 * on. This file only picks the instruction set.
 */
#include "quant.h"

#if NS_X86
#define NS_VNNI 1
#include "quant_isa_avx512.h"
#include "quant_simd.h"
#endif
