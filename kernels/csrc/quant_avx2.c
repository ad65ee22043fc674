/* The quantized matmul's AVX2 kernels (q4_0_matmul_avx2 and the others): quant_simd.h, each
 * kernel written once for any vector width, compiled with AVX2's vocabulary. This file only picks
 * the instruction set; quant_avx512.c and quant_avx512_vnni.c do the same for AVX-512.
 */
#include "quant.h"

#if NS_X86
#include "quant_isa_avx2.h"
#include "quant_simd.h"
#endif
