/* The K-quants, MXFP4, Q5_0, Q5_1 and Q8_0 repacked at load ("r16"): a matrix's rows in groups of
 * NS_R16 = 16 whose blocks are interleaved 4 bytes at a time, so that the SIMD kernels load a
 * strip's transposed bytes as they lie instead of transposing them (quant_strips.h's strip_src).
 * The bytes are the file's, moved: the resident size is the file's.
 *
 * Group g (rows 16 g .. 16 g + 15) holds, block after block, each block as 16 block_bytes bytes:
 * first, for each 4 bytes u of a block (words = block_bytes / 4 of them, from byte lead =
 * ns_r16_lead), the 16 rows' bytes lead + 4u .. lead + 4u + 3, row after row (64 bytes); then the
 * rows' remaining block_bytes % 4 bytes (2, Q6_K's d; 1, MXFP4's scale e, its first; 2, Q5_0's
 * and Q8_0's d, their first), row after row. A group occupies the bytes its 16 rows did, so that
 * a slice of a matrix's rows on group boundaries (an expert's) is a matrix of the layout too.
 *
 * The formats below are the files' (their arithmetic, quant_q4_k.c ...) with that layout; every
 * reader of their bytes knows it: the SIMD kernels, the portable kernel below (a row's blocks
 * gathered, then the file format's), and the de-quantization (quant_convert.c).
 */
#include "quant_blocks.h"

#include <stdlib.h>

extern const ns_block_format Q4_K_FORMAT, Q5_K_FORMAT, Q6_K_FORMAT, MXFP4_FORMAT;
extern const ns_block_format Q5_0_FORMAT, Q5_1_FORMAT, Q8_0_FORMAT;

/* Where row n's block kb starts in the group's interleaved bytes, and its tail. */
static const char *group_block(const char *w, size_t row_bytes, size_t block_bytes, Py_ssize_t n,
                               Py_ssize_t kb) {
    return w + (size_t)(n - n % NS_R16) * row_bytes + (size_t)kb * NS_R16 * block_bytes;
}

void ns_r16_block(char *dst, const char *w, size_t row_bytes, size_t block_bytes, Py_ssize_t n,
                  Py_ssize_t kb) {
    const char *g = group_block(w, row_bytes, block_bytes, n, kb);
    const size_t words = block_bytes / 4, tail = block_bytes % 4, c = (size_t)(n % NS_R16);
    const size_t lead = ns_r16_lead(block_bytes);
    for (size_t u = 0; u < words; u++) memcpy(dst + lead + 4 * u, g + 64 * u + 4 * c, 4);
    memcpy(dst, g + 64 * words + tail * c, lead);
    memcpy(dst + lead + 4 * words, g + 64 * words + tail * c + lead, tail - lead);
}

void ns_r16_repack(char *dst, const char *src, Py_ssize_t rows, size_t row_bytes,
                   size_t block_bytes) {
    const size_t words = block_bytes / 4, tail = block_bytes % 4, lead = ns_r16_lead(block_bytes);
    const Py_ssize_t nb = (Py_ssize_t)(row_bytes / block_bytes);
    for (Py_ssize_t n = 0; n < rows; n++) {
        const size_t c = (size_t)(n % NS_R16);
        for (Py_ssize_t kb = 0; kb < nb; kb++) {
            const char *from = src + (size_t)n * row_bytes + (size_t)kb * block_bytes;
            char *g = (char *)group_block(dst, row_bytes, block_bytes, n, kb);
            for (size_t u = 0; u < words; u++) memcpy(g + 64 * u + 4 * c, from + lead + 4 * u, 4);
            memcpy(g + 64 * words + tail * c, from, lead);
            memcpy(g + 64 * words + tail * c + lead, from + lead + 4 * words, tail - lead);
        }
    }
}

/* The portable kernel: each row's blocks gathered into the file's layout, then the file format's
 * kernel on that one row (the same operations, so the same results). Without memory for a row,
 * NaNs, never a wrong number. */
static void r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1,
                         const ns_block_format *f) {
    char *row = malloc(a->row_bytes ? a->row_bytes : 1);
    const Py_ssize_t nb = (Py_ssize_t)(a->row_bytes / f->block_bytes);
    for (Py_ssize_t n = n0; n < n1; n++) {
        for (Py_ssize_t kb = 0; row && kb < nb; kb++)
            ns_r16_block(row + (size_t)kb * f->block_bytes, a->w, a->row_bytes, f->block_bytes, n,
                         kb);
        ns_qmm one = *a;
        one.out = a->out + n;
        one.w = row;
        one.N = 1;
        if (row)
            f->portable(&one, 0, 1);
        else
            for (Py_ssize_t m = 0; m < a->M; m++) a->out[m * a->ldo + n] = __builtin_nanf("");
    }
    free(row);
}

static void q4_k_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &Q4_K_FORMAT);
}

static void q5_k_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &Q5_K_FORMAT);
}

static void q6_k_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &Q6_K_FORMAT);
}

static void mxfp4_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &MXFP4_FORMAT);
}

static void q5_0_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &Q5_0_FORMAT);
}

static void q5_1_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &Q5_1_FORMAT);
}

static void q8_0_r16_portable(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1) {
    r16_portable(a, n0, n1, &Q8_0_FORMAT);
}

/* An r16 format: the file format's sizes, pairs and arithmetic, its kernel the r16 one. */
#define R16_FORMAT(block, c, nm, kernel, base, values, order)                                     \
    {.code = c, .name = nm, .block_bytes = sizeof(block), .block_values = values,                 \
     .pairs = order, .portable = kernel, .byte_gemv = 1, .rows = &base}

#define KQUANT_R16(block, c, nm, kernel, base)                                                    \
    R16_FORMAT(block, c, nm, kernel, base, QK_K, NS_BYTE_PAIRS)

const ns_block_format Q4_K_R16_FORMAT =
    KQUANT_R16(block_q4_K, NS_Q4_K_R16, "q4_k_r16", q4_k_r16_portable, Q4_K_FORMAT);
const ns_block_format Q5_K_R16_FORMAT =
    KQUANT_R16(block_q5_K, NS_Q5_K_R16, "q5_k_r16", q5_k_r16_portable, Q5_K_FORMAT);
const ns_block_format Q6_K_R16_FORMAT =
    KQUANT_R16(block_q6_K, NS_Q6_K_R16, "q6_k_r16", q6_k_r16_portable, Q6_K_FORMAT);
const ns_block_format MXFP4_R16_FORMAT = R16_FORMAT(block_mxfp4, NS_MXFP4_R16, "mxfp4_r16",
                                                    mxfp4_r16_portable, MXFP4_FORMAT, QK,
                                                    NS_NIBBLE_PAIRS);
const ns_block_format Q5_0_R16_FORMAT = R16_FORMAT(block_q5_0, NS_Q5_0_R16, "q5_0_r16",
                                                   q5_0_r16_portable, Q5_0_FORMAT, QK,
                                                   NS_NIBBLE_PAIRS);
const ns_block_format Q5_1_R16_FORMAT = R16_FORMAT(block_q5_1, NS_Q5_1_R16, "q5_1_r16",
                                                   q5_1_r16_portable, Q5_1_FORMAT, QK,
                                                   NS_NIBBLE_PAIRS);
const ns_block_format Q8_0_R16_FORMAT = R16_FORMAT(block_q8_0, NS_Q8_0_R16, "q8_0_r16",
                                                   q8_0_r16_portable, Q8_0_FORMAT, QK,
                                                   NS_BYTE_PAIRS);
