/* The core's peak rate of the dot instructions the quantized GEMM is built on (dot_peak.py):
 * 12 independent accumulators, so that only the instruction's throughput bounds the loop. */
#include <immintrin.h>

#define CHAINS 12

#define PEAK_LOOP(name, vec, init, op, a, b, reduce)                                               \
    __attribute__((target("avx512f,avx512bw,avx512vnni"))) long long name(long long n) {          \
        vec acc[CHAINS], x = a, y = b;                                                             \
        for (int i = 0; i < CHAINS; i++) acc[i] = init;                                            \
        for (long long k = 0; k < n; k++) {                                                        \
            _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; i++) acc[i] = op(acc[i], x, y);   \
            __asm__ volatile("" : "+v"(x));                                                        \
        }                                                                                          \
        long long s = 0;                                                                           \
        for (int i = 0; i < CHAINS; i++) s += (long long)reduce(acc[i]);                           \
        return s;                                                                                  \
    }

PEAK_LOOP(peak_vpdpwssd, __m512i, _mm512_setzero_si512(), _mm512_dpwssd_epi32,
          _mm512_set1_epi16(3), _mm512_set1_epi16(5), _mm512_reduce_add_epi32)
PEAK_LOOP(peak_vpdpbusd, __m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32,
          _mm512_set1_epi8(3), _mm512_set1_epi8(5), _mm512_reduce_add_epi32)
PEAK_LOOP(peak_vfmadd, __m512, _mm512_setzero_ps(), _mm512_fmadd_ps, _mm512_set1_ps(1.0f),
          _mm512_set1_ps(0.0f), _mm512_reduce_add_ps)
