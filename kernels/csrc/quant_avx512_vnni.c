/* The quantized matmul's AVX-512 kernels with VNNI's vpdpwssd for the dot steps: quant_simd.h
 * compiled with that instruction set's vocabulary (quant_isa.h). This file only picks it.
 */
#include "quant.h"

#if NS_X86
#define NS_AVX512 1
#define NS_VNNI 1
#include "quant_isa.h"
#include "quant_simd.h"

const ns_matmul_fn *const NS_AVX512_VNNI_KERNELS = SIMD_KERNELS;
#endif
