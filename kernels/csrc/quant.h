/* The quantized matmul's block formats and the interface of their kernels: the block structs, the
 * one table of formats (NS_BLOCK_FORMATS, below), the quantized activations and the matmul the
 * kernels compute. quant.c drives them (the path, the activations, the threads); each format's
 * file (quant_q8_0.c, quant_q4_0.c, quant_q4_1.c) holds its kernels, one per instruction set.
 *
 * Weights stay in llama.cpp's GGUF block formats, byte for byte: rows of blocks of 32 values
 * along K (the structs below are ggml's).
 *
 * out = x @ W^T runs on integer activations: each row of x is quantized per block of 32 to int16
 * (dx = max|x| / 32767, q = round(x / dx)), the kernels take exact integer dot products of a
 * weight block and an activation block in int32 lanes, and scale them in float: out = sum over
 * blocks of (d dx) dot (+ m dx sum(q) for Q4_1). The integer part is exact and every path
 * quantizes x alike, so the paths differ only in the order they add the scaled blocks. The int32
 * lanes cannot overflow: a block is 32 products of |q| <= 128 by |x| <= 32767, under 2^27.
 * (int8 activations, llama.cpp's, round 258x coarser and flip greedy tokens; README.md.)
 */
#ifndef NANOSERVE_QUANT_H
#define NANOSERVE_QUANT_H

#include "nanoserve.h"

#if defined(__x86_64__) || defined(__i386__)
#define NS_X86 1
#else
#define NS_X86 0
#endif

enum { QK = 32 }; /* values per block, along K */

/* GGML's type ids of the formats: the qtype codes Python passes (c_backend.QTYPE_CODES). */
enum ns_qtype { NS_Q4_0 = 2, NS_Q4_1 = 3, NS_Q8_0 = 8 };

/* value j = qs[j] d */
typedef struct {
    uint16_t d; /* fp16 */
    int8_t qs[QK];
} block_q8_0;

/* value j = (q_j - 8) d, q_j a nibble of qs */
typedef struct {
    uint16_t d; /* fp16 */
    uint8_t qs[QK / 2];
} block_q4_0;

/* value j = q_j d + m, q_j a nibble of qs */
typedef struct {
    uint16_t d, m; /* fp16 */
    uint8_t qs[QK / 2];
} block_q4_1;

/* Byte j of a 4-bit block's qs: value j (q[j], 0..15) in its low nibble, value j + 16 in its
 * high one. */
static inline void ns_pack_nibbles(uint8_t qs[QK / 2], const uint8_t q[QK]) {
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)(q[j] | (q[j + QK / 2] << 4));
}

/* The largest block: the SIMD kernels copy a matrix's last rows' blocks into buffers this wide. */
enum { NS_MAX_BLOCK_BYTES = 40 };
/* The most bytes of unpacked weights a SIMD GEMM panel takes, to stay in L2 (unpacked 4-bit blocks
 * take 4x their bytes). */
enum { NS_PANEL_BYTES = 256 << 10 };
_Static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q8_0) <= NS_MAX_BLOCK_BYTES, "GGUF Q8_0");
_Static_assert(sizeof(block_q4_0) == 18, "GGUF Q4_0");
_Static_assert(sizeof(block_q4_1) == 20, "GGUF Q4_1");

/* Rows of x quantized for the kernels: per row, q [blocks * QK] (each block's values in the order
 * its path takes them: in order on the portable path, else the format's `pairs`), and per row and
 * block dx (the block's scale) and sx (dx times the sum of its q: Q4_1's min times it is the min's
 * share of the dot). */
typedef struct {
    int16_t *q;
    float *dx, *sx;
    Py_ssize_t blocks; /* K / QK */
} ns_xq;

/* One matmul for the kernels: out [M, N] float32 = x W^T with W [N, K] in blocks, row_bytes a
 * row. */
typedef struct {
    float *out;
    const char *w;
    const ns_xq *x;
    Py_ssize_t M, N, K;
    size_t row_bytes;
} ns_qmm;

/* A kernel: out[:, n0:n1] of a matmul. Each out[m, n] is the same operations on row m of x and
 * row n of W whatever n0, n1 and M (bitwise row invariance). */
typedef void (*ns_matmul_fn)(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);

/* The paths, in order of preference; kernels.cpu_isa() names the first three, VNNI is an option
 * of the AVX-512 one. */
enum ns_path { NS_PORTABLE, NS_AVX2, NS_AVX512, NS_AVX512_VNNI, NS_NUM_PATHS };

/* A row of the table of formats (NS_BLOCK_FORMATS): what the driver (quant.c, quant_convert.c)
 * needs of a format. */
typedef struct {
    int code;          /* ns_qtype */
    const char *name;  /* as kernels.QUANT_TYPES has it */
    size_t block_bytes;
    void (*quantize)(void *block, const float *x); /* 32 values, as gguf.quants.quantize */
    void (*dequantize)(float *x, const void *block);
    const uint8_t *pairs; /* the order in which the SIMD kernels take a block's activations */
    ns_matmul_fn matmul[NS_NUM_PATHS]; /* the SIMD paths' on x86 only */
} ns_block_format;

/* Each format's functions, in its file quant_<name>.c. */
void q8_0_quantize(void *block, const float *x);
void q8_0_dequantize(float *x, const void *block);
void q8_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_0_quantize(void *block, const float *x);
void q4_0_dequantize(float *x, const void *block);
void q4_0_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_1_quantize(void *block, const float *x);
void q4_1_dequantize(float *x, const void *block);
void q4_1_matmul_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
#if NS_X86
void q8_0_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q8_0_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q8_0_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_0_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_0_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_0_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_1_matmul_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_1_matmul_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void q4_1_matmul_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
#endif

/* The SIMD kernels' order of a block's values (see quant_strips_avx512.h): register p[j] of an
 * unpacked block holds values order[2j] and order[2j + 1] of each row, so the activations are laid
 * out alike. A 4-bit block unpacks its bytes' nibbles, a Q8_0 block its bytes, 4 bytes a lane. */
static const uint8_t NS_NIBBLE_PAIRS[QK] = {0,  2,  16, 18, 1,  3,  17, 19, 4,  6,  20,
                                            22, 5,  7,  21, 23, 8,  10, 24, 26, 9,  11,
                                            25, 27, 12, 14, 28, 30, 13, 15, 29, 31};
static const uint8_t NS_BYTE_PAIRS[QK] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,
                                          11, 12, 14, 13, 15, 16, 18, 17, 19, 20, 22,
                                          21, 23, 24, 26, 25, 27, 28, 30, 29, 31};

/* The formats: adding one is a row here and its file of kernels. Read through ns_block_format_of
 * (a file that never calls it leaves the table out of its object). */
static const ns_block_format NS_BLOCK_FORMATS[] = {
    {NS_Q8_0, "q8_0", sizeof(block_q8_0), q8_0_quantize, q8_0_dequantize, NS_BYTE_PAIRS,
     {[NS_PORTABLE] = q8_0_matmul_portable,
#if NS_X86
      [NS_AVX2] = q8_0_matmul_avx2, [NS_AVX512] = q8_0_matmul_avx512,
      [NS_AVX512_VNNI] = q8_0_matmul_avx512_vnni
#endif
     }},
    {NS_Q4_0, "q4_0", sizeof(block_q4_0), q4_0_quantize, q4_0_dequantize, NS_NIBBLE_PAIRS,
     {[NS_PORTABLE] = q4_0_matmul_portable,
#if NS_X86
      [NS_AVX2] = q4_0_matmul_avx2, [NS_AVX512] = q4_0_matmul_avx512,
      [NS_AVX512_VNNI] = q4_0_matmul_avx512_vnni
#endif
     }},
    {NS_Q4_1, "q4_1", sizeof(block_q4_1), q4_1_quantize, q4_1_dequantize, NS_NIBBLE_PAIRS,
     {[NS_PORTABLE] = q4_1_matmul_portable,
#if NS_X86
      [NS_AVX2] = q4_1_matmul_avx2, [NS_AVX512] = q4_1_matmul_avx512,
      [NS_AVX512_VNNI] = q4_1_matmul_avx512_vnni
#endif
     }},
};
enum { NS_NUM_FORMATS = sizeof NS_BLOCK_FORMATS / sizeof NS_BLOCK_FORMATS[0] };

/* The format with GGML type id `code`, or NULL. */
static inline const ns_block_format *ns_block_format_of(int code) {
    for (int i = 0; i < NS_NUM_FORMATS; i++)
        if (NS_BLOCK_FORMATS[i].code == code) return &NS_BLOCK_FORMATS[i];
    return NULL;
}

/* f as computed, never fused with a following add: gguf's numpy reference rounds x * id before it
 * adds 8.5 (or 0.5, or m), and -ffp-contract=fast would otherwise make that one FMA. */
static inline float ns_unfused(float f) {
#if defined(__GNUC__) && NS_X86
    __asm__("" : "+x"(f));
#elif defined(__GNUC__) && defined(__aarch64__)
    __asm__("" : "+w"(f));
#else
    volatile float v = f;
    f = v;
#endif
    return f;
}

#endif
