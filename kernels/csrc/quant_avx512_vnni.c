/* The AVX512-VNNI target of quant_avx512.c, in a file of its own so that it compiles in parallel
 * with the plain AVX-512 one. */
#define NS_AVX512_VNNI 1
#include "quant_avx512.c"
