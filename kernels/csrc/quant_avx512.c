/* The quantized matmul's AVX-512 kernels (q4_0_matmul_avx512 and the others): quant_simd.h, each
 * kernel written once for any vector width, compiled with AVX-512's vocabulary. This file only
 * picks the instruction set.
 */
#include "quant.h"

#if NS_X86
#include "quant_isa_avx512.h"
#include "quant_simd.h"
#endif
