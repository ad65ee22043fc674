/* The quantized matmul's internals, shared by quant.c (formats, quantize and dequantize, the
 * activations' quantization, the ISA choice, the threaded driver, the Python entry points) and the
 * kernels of each instruction set (quant_portable.c, quant_avx2.c, quant_avx512.c).
 *
 * Weights stay in llama.cpp's GGUF block formats, byte for byte: rows of blocks of 32 values along
 * K. Q8_0: fp16 d, 32 int8 q; value = q d. Q4_0: fp16 d, 16 bytes; value = (q - 8) d. Q4_1: fp16
 * d, fp16 m, 16 bytes; value = q d + m. In a 4-bit block byte j holds value j in its low nibble and
 * value j + 16 in its high one.
 *
 * out = x @ W^T runs on integer activations: each row of x is quantized per block of 32 (dx =
 * max|x| / L, q = round(x / dx)) to int16 (L = 32767, the default) or to int8 (L = 127, as
 * llama.cpp's Q8 activations), the kernels take exact integer dot products of a weight block and an
 * activation block in int32 lanes, and scale them in float: out = sum over blocks of (d dx) * dot
 * (+ m dx sum(q) for Q4_1). The integer part is exact and every path quantizes x alike, so the
 * paths differ only in how they add the scaled lanes.
 *
 * int8 halves the activations' bytes and lets one maddubs / vpdpbusd do 4 products a lane, but its
 * rounding (dx / 2 a value) puts each matmul ~0.6-1% (relative norm) off x @ W^T on SmolLM2-135M,
 * enough to flip greedy tokens; int16 rounds 258x finer at 2 products a lane (vpmaddwd /
 * vpdpwssd), with the weights widened to int16 as they are unpacked. Its int32 lanes cannot
 * overflow: a block is 32 products of |q| <= 128 by |x| <= 32767, under 2^27.
 *
 * Against the alternative, de-quantizing the weights to float (kept in
 * csrc/experiments/dequant_f32.c for bench/bench_quant.py --compare-dequant), int8 measured 1.6-2x
 * faster at M = 1 and 4 on SmolLM2-135M's larger matrices (the batch-1 decode; 192 x 576 is a
 * tie, call overhead), and 1.3-2.5x faster at M = 32 and 256; at M = 256 it beat de-quantizing
 * and then MKL's float32 GEMM too (AVX-512 VNNI).
 */
#ifndef NANOSERVE_QUANT_H
#define NANOSERVE_QUANT_H

#include "nanoserve.h"

enum { QK = 32 }; /* values per block, along K */

/* The paths, in order of preference; kernels.cpu_isa() names them. */
enum ns_isa { NS_ISA_PORTABLE = 0, NS_ISA_AVX2 = 1, NS_ISA_AVX512 = 2 };

/* How a path wants the activations: `group` blocks go through the kernel at a time (the row's
 * blocks are padded with zero blocks to a whole number of groups); each block is cut into `pieces`
 * runs of QK / pieces values, and a group lays out the first pieces of its blocks, then their
 * second pieces, and so on (where the weights' registers have them: a 4-bit block's low and high
 * nibbles, say); with one block a group that is the values in order. Lane i of a block (of QK /
 * pieces / width) covers values width i .. width i + width - 1 of each of its pieces: the values
 * one int32 lane of the path's dot product adds. `corr`: the factor of corr below; `wide`: int16
 * activations, else int8; `order` (with one piece and one block a group, or NULL): each block's
 * values in this order (value order[j] at j). */
typedef struct {
    int group, pieces, width, corr, wide;
    const uint8_t *order;
} ns_xq_layout;

/* Rows of activations quantized for one layout. Per row: q (int8) or q16 (int16) [blocks * 32];
 * per row and lane: dx (the block's scale), corr (-corr times the lane's sum of q: Q4_0's zero
 * point 8, Q8_0's +128 offset under VNNI, added to the integer dot) and sx (dx times the lane's sum
 * of q: Q4_1's min times it is the min's share of the dot). `blocks` counts the padding. */
typedef struct {
    union {
        int8_t *q;
        int16_t *q16;
    };
    float *dx, *sx;
    int32_t *corr;
    Py_ssize_t blocks, q_stride, lane_stride; /* elements between rows */
    int wide;
} ns_xq;

/* One matmul for the kernels: out [M, N] float32 = x W^T with W [N, K] of qtype, row_bytes per
 * row of blocks, and x quantized as the path asked. */
typedef struct {
    float *out;
    const char *w;
    const ns_xq *x;
    Py_ssize_t M, N, K;
    size_t row_bytes;
    int qtype;
} ns_qmm;

/* A tile of it: rows r0.. of x by rows c0.. of W (columns of out); `panel`, when set, holds W's
 * groups already unpacked by the path (`groups` a row of W), row c0's first. */
typedef struct {
    const ns_qmm *a;
    Py_ssize_t r0, c0;
    const void *panel;
    Py_ssize_t groups;
} ns_tile;

/* The int16 strip kernels' pairs of a block's values (quant_strips.inc), in the order of their
 * registers p[0..15]: bytes 4q..4q+3 of a column's block unpack into 4 registers of pairs (4-bit;
 * a byte's low nibble is value j, its high one j + 16) or, per half, 2 (Q8_0). */
extern const uint8_t NS_PAIRS_4[QK], NS_PAIRS_8[QK];

/* Each path: its activation layout for a format and int16 (wide) or int8 activations, and
 * out[:, n0:n1] (from a->x->wide). */
ns_xq_layout ns_layout_portable(int qtype, int wide);
void ns_qmm_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
#if defined(__x86_64__) || defined(__i386__)
ns_xq_layout ns_layout_avx2(int qtype, int wide);
void ns_qmm_avx2(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
ns_xq_layout ns_layout_avx512(int qtype, int vnni, int wide);
void ns_qmm_avx512(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
void ns_qmm_avx512_vnni(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1);
#endif

/* The 16 bits of a block's fp16 at p (unaligned), as float32. */
static inline float ns_f16_at(const char *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return ns_f16_to_f32(h);
}

/* f as computed, never fused with a following add: gguf's numpy reference rounds x * id before it
 * adds 8.5 (or 0.5, or m), and -ffp-contract=fast would otherwise make that one FMA. */
static inline float ns_unfused(float f) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
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
