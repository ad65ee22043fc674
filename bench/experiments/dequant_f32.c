/* The road not taken, kept for `python -m bench.bench_quant --compare-dequant`: the same matmul on
 * GGUF block weights with the weights de-quantized to float32 instead of the activations quantized
 * to int16 (what nanoserve.kernels ships, quant*.c). Not part of the module; the benchmark
 * compiles this file with the system compiler (-O3, -march=native or x86-64-v3) and loads it with
 * ctypes.
 *
 * GEMV (M <= 4): each block expanded to 32 floats in registers (w = q d + m) and FMA'd against
 * each float row of x; blocks in order, 16 lanes, one pass over W.
 * GEMM: a panel of 32 columns de-quantized once into a transposed float buffer [K][32] (in L1/L2),
 * then a 6 x 32 outer-product micro-kernel (x broadcast, 12 accumulators), the classic SGEMM
 * shape, FMA-bound. Neither is batch invariant with the other; this is only for the timings.
 *
 * GCC vector extensions for the float arithmetic, one register wide; intrinsics for the integer
 * widening; -march picks AVX-512 or AVX2.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One register of floats: GCC splits wider generic vectors badly under AVX2. */
#ifdef __AVX512F__
enum { VL = 16 };
#else
enum { VL = 8 };
#endif
typedef float vf __attribute__((vector_size(4 * VL)));

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, QK = 32, MR = 6, NC = 32 };

static int block_bytes(int qtype) { return qtype == Q8_0 ? 34 : qtype == Q4_1 ? 20 : 18; }

static inline float f16(const char *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* 16 bytes of u8 (u = 1) or s8 values as floats, into v[0..16 / VL). */
static inline void bytes_f32(vf *v, __m128i b, int u) {
#ifdef __AVX512F__
    const __m512 f = _mm512_cvtepi32_ps(u ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
    memcpy(v, &f, sizeof f);
#else
    const __m128i b1 = _mm_srli_si128(b, 8);
    const __m256 f0 = _mm256_cvtepi32_ps(u ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
    const __m256 f1 = _mm256_cvtepi32_ps(u ? _mm256_cvtepu8_epi32(b1) : _mm256_cvtepi8_epi32(b1));
    memcpy(v, &f0, sizeof f0);
    memcpy(v + 1, &f1, sizeof f1);
#endif
}

/* The 32 values of a block, w[0..32 / VL); intrinsics for the integer widening, which GCC 12's
 * generic vector conversions turn into scalar code. */
static inline void block_f32(const char *blk, int qtype, vf *w) {
    const float d = f16(blk);
    const int half = 16 / VL;
    if (qtype == Q8_0) {
        bytes_f32(w, _mm_loadu_si128((const __m128i *)(blk + 2)), 0);
        bytes_f32(w + half, _mm_loadu_si128((const __m128i *)(blk + 18)), 0);
        for (int i = 0; i < 2 * half; i++) w[i] *= d;
        return;
    }
    const float m = qtype == Q4_1 ? f16(blk + 2) : -8.0f * d;
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(15);
    bytes_f32(w, _mm_and_si128(q, low), 1);
    bytes_f32(w + half, _mm_and_si128(_mm_srli_epi16(q, 4), low), 1);
    for (int i = 0; i < 2 * half; i++) w[i] = w[i] * d + m;
}

static inline float hsum(const vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

static inline void gemv_col(float *out, const float *x, const char *row, int M, long N, long K,
                            long n, int qtype) {
    vf acc[4] = {{0}, {0}, {0}, {0}};
    const int bb = block_bytes(qtype);
    for (long b = 0; b < K / QK; b++) {
        vf w[QK / VL];
        block_f32(row + b * bb, qtype, w);
        for (int m = 0; m < M; m++)
            for (int i = 0; i < QK / VL; i++) {
                vf xv;
                memcpy(&xv, x + m * K + b * QK + i * VL, sizeof xv);
                acc[m] += w[i] * xv;
            }
    }
    for (int m = 0; m < M; m++) out[m * N + n] = hsum(acc[m]);
}

void dq_gemv(float *out, const float *x, const char *w, long M, long N, long K, int qtype,
             int threads) {
    const long rb = K / QK * block_bytes(qtype);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const char *row = w + n * rb;
        switch (M) { /* M as a constant, for the unrolled row loop */
        case 1: gemv_col(out, x, row, 1, N, K, n, qtype); break;
        case 2: gemv_col(out, x, row, 2, N, K, n, qtype); break;
        case 3: gemv_col(out, x, row, 3, N, K, n, qtype); break;
        default: gemv_col(out, x, row, 4, N, K, n, qtype); break;
        }
    }
}

/* Columns n0..n0+nc (nc <= NC) of W into wt [K][NC], float32, zeros past nc. */
static void dequant_panel(float *wt, const char *w, long n0, long nc, long K, int qtype) {
    const int bb = block_bytes(qtype);
    const long rb = K / QK * bb;
    memset(wt, 0, sizeof(float) * K * NC);
    for (long c = 0; c < nc; c++)
        for (long b = 0; b < K / QK; b++) {
            float v[QK];
            block_f32(w + (n0 + c) * rb + b * bb, qtype, (vf *)v);
            for (int j = 0; j < QK; j++) wt[(b * QK + j) * NC + c] = v[j];
        }
}

/* out[r0..r0+mr, n0..n0+nc] from the transposed panel: mr x 32 accumulators along K. */
static inline void micro(float *out, const float *x, const float *wt, long r0, int mr, long n0,
                         long nc, long N, long K) {
    vf acc[MR][NC / VL] = {{{0}}};
    for (long k = 0; k < K; k++) {
        vf w[NC / VL];
        memcpy(w, wt + k * NC, sizeof w);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const vf xv = (vf){0} + x[(r0 + r) * K + k];
#pragma GCC unroll 4
            for (int i = 0; i < NC / VL; i++) acc[r][i] += xv * w[i];
        }
    }
    for (int r = 0; r < mr; r++)
        for (long c = 0; c < nc; c++) out[(r0 + r) * N + n0 + c] = acc[r][c / VL][c % VL];
}

void dq_gemm(float *out, const float *x, const char *w, long M, long N, long K, int qtype,
             int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *wt = aligned_alloc(64, sizeof(float) * K * NC);
#pragma omp for schedule(static)
        for (long n0 = 0; n0 < N; n0 += NC) {
            const long nc = N - n0 < NC ? N - n0 : NC;
            dequant_panel(wt, w, n0, nc, K, qtype);
            long r0 = 0;
            for (; r0 + MR <= M; r0 += MR) micro(out, x, wt, r0, MR, n0, nc, N, K);
            for (; r0 < M; r0++) micro(out, x, wt, r0, 1, n0, nc, N, K);
        }
        free(wt);
    }
}
