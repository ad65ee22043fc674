/* The quantized matmul's AMX-INT8 kernels: the AVX-512 VNNI kernels (quant_simd.h), whose GEMM
 * runs on AMX tiles (quant_amx.h) where quant.c split the activations for it; their GEMV and
 * F16 kernels are VNNI's. This file only picks the instruction set.
 */
#include "quant.h"

#if NS_X86
#define NS_AVX512 1
#define NS_VNNI 1
#define NS_AMX 1
#include "quant_isa.h"
#include "quant_simd.h"

const ns_matmul_fn *const NS_AMX_KERNELS = SIMD_KERNELS;
#endif
