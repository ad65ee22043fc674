/* The interface of the quantized matmul's block formats and their kernels: what a format is
 * (ns_block_format), the quantized activations and the matmul the kernels compute. quant.c drives
 * them (the path, the activations, the threads) and holds the one table of formats; each format's
 * file (quant_<name>.c) holds its reference kernel and its row of that table; quant_blocks.h its
 * block struct (ggml's), quant_simd.h its SIMD unpacking, compiled once per instruction set.
 *
 * Weights stay in llama.cpp's GGUF block formats, byte for byte: rows of blocks of 32 values
 * along K, or of super-blocks of 256 (the K-quants), whose 32-value sub-blocks (Q6_K: pairs of
 * 16-value ones) each have their own scale.
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

enum { QK = 32 };   /* values per block of the activations, and of the 32-value formats */
enum { QK_K = 256 }; /* values per super-block of the K-quants */

/* Byte j of a 4-bit block's qs: value j (q[j], 0..15) in its low nibble, value j + 16 in its
 * high one. */
static inline void ns_pack_nibbles(uint8_t qs[QK / 2], const uint8_t q[QK]) {
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)(q[j] | (q[j + QK / 2] << 4));
}

/* The largest block: the SIMD kernels copy a matrix's last rows' blocks into buffers this wide. */
enum { NS_MAX_BLOCK_BYTES = 210 }; /* Q6_K's */
/* The most bytes of W's rows the F16 GEMM takes at a time, to stay in L2 (quant_f16.h). */
enum { NS_PANEL_BYTES = 256 << 10 };
/* The GEMV prefetches the next strips' rows into L1 up to this many bytes (a third of a 48 KiB L1,
 * half of a 32 KiB one), into L2 past it. */
enum { NS_PREFETCH_L1_BYTES = 16 << 10 };

/* Rows of x quantized for the kernels: per row, q [blocks * QK] (each block's values in the order
 * its path takes them: in order on the portable path, else the format's `pairs`), and per row and
 * block dx (the block's scale) and sx (dx times the sum of its q: Q4_1's min times it is the min's
 * share of the dot). */
typedef struct {
    int16_t *q;
    float *dx, *sx;
    Py_ssize_t blocks; /* K / QK */
    /* For the AMX GEMM (quant_amx.h), else NULL: each q as its high byte q >> 8 (hi, signed) and
     * low byte q & 255 (lo, unsigned), laid out as AMX loads them: per tile of NS_AMX_ROWS rows
     * and per block, the tile's rows' 32 hi bytes one after another, then their lo bytes. The
     * rows from M up to a multiple of NS_AMX_ROWS are zeros, as are their dx and sx. */
    int8_t *tiles;
    /* For the byte GEMV (quant_bytes.h), else NULL: each q's hi and lo bytes as in `tiles`, a
     * row's blocks one after another with each block's values in order (not `pairs`), and the
     * sum of each 16 q (Q6_K's zero point times it is the zero point's share of a half's dot). */
    int8_t *hi;
    uint8_t *lo;
    int32_t *sum16;
    int32_t *hisum; /* per block, the sum of its hi (Q8_0's W offset by 128 times it) */
} ns_xq;

/* The AMX path's GEMM takes M >= NS_AMX_ROWS rows in tiles of NS_AMX_ROWS; fewer, the VNNI GEMV
 * and GEMM. */
enum { NS_AMX_ROWS = 16 };

/* One matmul for the kernels: out [M, N] float32 = x W^T with W [N, K] in blocks, row_bytes a
 * row; row m of out starts at out + m ldo (ldo >= N: a matrix of several parts in different
 * formats writes each part's columns of one output). A kernel reads N only to ask for the rows
 * ahead (ahead_of): a thread's copy holds the end of its share there. */
typedef struct {
    float *out;
    const char *w;
    const ns_xq *x;
    Py_ssize_t M, N, K, ldo;
    size_t row_bytes;
    const float *xf; /* x itself [M, K], for a format whose activations stay float (float_x) */
    /* The rows of W (row_bytes each) the thread reads after W's last row: the streaming GEMV asks
     * for them ahead while it reads that row's strip (quant_experts.c's next matrix), so that the
     * jump to another matrix does not stall on memory; NULL where none follows. */
    const char *then;
    /* W comes from memory, not a cache (quant_experts.c: each expert's rows once a step): the
     * rows ahead go into L2 however few they are. Into L1, Qwen3-MoE's 2048 x 768 down
     * projections in Q6_K streamed 1.35x slower on an AMD EPYC (bench/ab_quant.py, 96 copies),
     * while SmolLM2's one stream, which reads matrices of the same strips, ran about 3% faster. */
    int from_memory;
} ns_qmm;

/* A kernel: out[:, n0:n1] of a matmul. Each out[m, n] is the same operations on row m of x and
 * row n of W whatever n0, n1 and M (bitwise row invariance). */
typedef void (*ns_matmul_fn)(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);

/* The paths, in order of preference; kernels.cpu_isa() names the first three, VNNI is an option
 * of the AVX-512 one and AMX-INT8 one of VNNI's. */
enum ns_path { NS_PORTABLE, NS_AVX2, NS_AVX512, NS_AVX512_VNNI, NS_AMX, NS_NUM_PATHS };

/* GGML's type ids of the formats: the qtype codes Python passes (c_backend.QTYPE_CODES). */
enum ns_ggml_type {
    GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30, GGML_MXFP4 = 39,
    /* nanoserve's own: the K-quants, MXFP4, Q5_0, Q5_1 and Q8_0 repacked at load in groups of
     * NS_R16 rows (quant_r16.c) */
    NS_Q4_K_R16, NS_Q5_K_R16, NS_Q6_K_R16, NS_MXFP4_R16, NS_Q5_0_R16, NS_Q5_1_R16, NS_Q8_0_R16,
    NS_NUM_GGML_TYPES
};

/* The rows of a group of an r16 format (quant_r16.c). */
enum { NS_R16 = 16 };

/* Each SIMD path's kernels by GGML type id: quant_simd.h's table, which quant_avx2.c,
 * quant_avx512.c, quant_avx512_vnni.c and quant_amx.c compile once each. */
#if NS_X86
extern const ns_matmul_fn *const NS_AVX2_KERNELS, *const NS_AVX512_KERNELS,
    *const NS_AVX512_VNNI_KERNELS, *const NS_AMX_KERNELS;
#endif

/* A block format: what the driver (quant.c, quant_convert.c) needs of it. Each format's file
 * defines one, named <NAME>_FORMAT; quant.c's table lists them. */
typedef struct ns_block_format {
    enum ns_ggml_type code;
    const char *name; /* as kernels.QUANT_TYPES has it: GGML's type name in lower case */
    size_t block_bytes;
    int block_values; /* values per block along K: QK_K for a K-quant's super-block; 0 is QK */
    /* a block's block_values values, as gguf.quants.quantize; NULL where nanoserve does not
     * quantize to the format (the K-quants: llama.cpp's quantizer searches their scales) */
    void (*quantize)(void *block, const float *x);
    void (*dequantize)(float *x, const void *block);
    const uint8_t *pairs; /* the order in which the SIMD kernels take a block's activations */
    ns_matmul_fn portable; /* the reference kernel; the SIMD paths' are in their tables */
    /* F16 and BF16 (quant_f16.c): "blocks" of 32 plain 16-bit floats whose kernels widen them and
     * multiply the float32 activations as they are (xf): no int16 rounding, no pairs. */
    int float_x;
    /* The VNNI paths' GEMV (M <= NS_BYTE_ROWS) unpacks W to bytes (quant_bytes.h), taking the
     * activations as ns_xq's hi and lo. */
    int byte_gemv;
    /* An r16 format (quant_r16.c): the format `rows` of the file (its blocks' layout and
     * arithmetic), its matrices' rows interleaved in groups of NS_R16; NULL for the others. */
    const struct ns_block_format *rows;
} ns_block_format;

/* Rows of x the byte GEMV takes, a tile of AVX-512's GEMV_ROWS (8) at a time over each strip
 * (the strip's unpacking repeated per tile, its bytes from L1/L2). Up to 16 rows it beat the
 * int16 GEMM on an AMD EPYC: 9 and 16 rows of a Q6_K 49152 x 2048 took 9.5 and 10.9 ms there,
 * 8-row calls of the byte GEMV 6.2 and 7.8 ms; at 32 rows the GEMM's panels win. */
enum { NS_BYTE_ROWS = 16 };

/* quant.c: the format with GGML type id `code`, or NULL. */
const ns_block_format *ns_block_format_of(int code);

/* quant.c's driver, shared with the experts' matmul (quant_experts.c): the path in use now, its
 * kernel of format f, the activations' buffer for M rows of K values (split into AMX tiles if
 * `split`, into hi and lo bytes if `bytes`; returns the allocation to free, or NULL), and row m
 * of x quantized into it in `order` (the format's pairs, NULL on the portable path). */
int ns_quant_path(void);

/* quant_r16.c: an r16 matrix's row n's block kb copied to dst (its rows of row_bytes, its blocks
 * of block_bytes); rows (a multiple of NS_R16) of the file's layout at src repacked into dst; the
 * byte where a block's 4-byte words start: after the bytes that lead a block of its size and are
 * no whole word, MXFP4's scale (17 bytes), Q5_0's d (22) and Q8_0's (34); Q6_K's d (210) comes
 * last. */
static inline size_t ns_r16_lead(size_t block_bytes) {
    return block_bytes % 4 == 1 ? 1 : block_bytes == 22 || block_bytes == 34 ? 2 : 0;
}
void ns_r16_block(char *dst, const char *w, size_t row_bytes, size_t block_bytes, Py_ssize_t n,
                  Py_ssize_t kb);
void ns_r16_repack(char *dst, const char *src, Py_ssize_t rows, size_t row_bytes,
                   size_t block_bytes);

/* The first of N output features that thread t of nt computes (t = nt: N): contiguous shares, on
 * an r16 format's group boundaries (N is a multiple of NS_R16 there). */
static inline Py_ssize_t ns_share(Py_ssize_t N, Py_ssize_t t, Py_ssize_t nt,
                                  const ns_block_format *f) {
    const Py_ssize_t unit = f->rows ? NS_R16 : 1;
    return N / unit * t / nt * unit;
}
ns_matmul_fn ns_path_kernel(const ns_block_format *f, int path);
void *ns_xq_alloc(ns_xq *xq, Py_ssize_t M, Py_ssize_t K, int split, int bytes);
void ns_quantize_x_row(const ns_xq *xq, const uint8_t *order, const float *x, Py_ssize_t m);

/* Values per block of f along K: a row of K values (a multiple of it) takes K / it blocks. */
static inline int ns_block_values(const ns_block_format *f) {
    return f->block_values ? f->block_values : QK;
}

/* The SIMD kernels' order of a block's values (see quant_strips.h): register p[j] of an
 * unpacked block holds values order[2j] and order[2j + 1] of each row, so the activations are laid
 * out alike. A 4-bit block unpacks its bytes' nibbles, a Q8_0 block its bytes, 4 bytes a lane. */
static const uint8_t NS_NIBBLE_PAIRS[QK] = {0,  2,  16, 18, 1,  3,  17, 19, 4,  6,  20,
                                            22, 5,  7,  21, 23, 8,  10, 24, 26, 9,  11,
                                            25, 27, 12, 14, 28, 30, 13, 15, 29, 31};
static const uint8_t NS_BYTE_PAIRS[QK] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,
                                          11, 12, 14, 13, 15, 16, 18, 17, 19, 20, 22,
                                          21, 23, 24, 26, 25, 27, 28, 30, 29, 31};

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
