/* The quantized matmul's AVX2 (with FMA and F16C) kernels: quant_simd.h compiled with
 * that instruction set's vocabulary (quant_isa.h). This file only picks it.
 */
#include "quant.h"

#if NS_X86
#include "quant_isa.h"
#include "quant_simd.h"

const ns_matmul_fn *const NS_AVX2_KERNELS = SIMD_KERNELS;
#endif
