/* The decode GEMV on the VNNI paths for the formats that unpack W to bytes (strip_format's
 * unpack_bytes: Q8_0, Q5_0, Q5_1, MXFP4 and the K-quants): each int16 activation q as 256 hi + lo
 * (ns_xq's hi, signed, and lo, unsigned), so that two vpdpbusd per 4 values (dot_w_x: W's unsigned
 * bytes times hi; dot_x_w: lo times W's bytes as signed) give the block's int32 dot exactly: the
 * same integer that vpdpwssd gives on the int16 pairs of strip_tile, scaled by the same
 * operations, so the results are bitwise the GEMM's. It saves widening W to int16 pairs, which
 * bounded the K-quants' int16 GEMV on an AMD EPYC (bench/experiments/int8_gemv.py). Q4_0 and Q4_1
 * gained nothing from it there (their pairs come cheaply) and keep the int16 GEMV. Q5_0 and Q5_1
 * (a K-quant file's format where a row is no whole number of super-blocks: SmolLM2's 576 values)
 * gained 1.08-1.22x at one row (bench/ab_quant.py, 576 x 1536 to 8192 x 2048), about 1x at 8.
 * Included by quant_strips.h where NS_VNNI is defined.
 */
#ifndef NANOSERVE_QUANT_BYTES_H
#define NANOSERVE_QUANT_BYTES_H

/* The exact int32 dot of values v[i0 .. i0 + n) of a block with row `at`'s activations there:
 * 256 times W's with hi, plus lo's with W. Signed W (Q8_0: v holds w + 128): the hi dot less 128
 * times the block's sum of hi, and the lo dot with v less 128 again (signed bytes). */
NS_INLINE ivec byte_dot(const ivec *v, const ns_xq *xq, Py_ssize_t at, const int i0, const int n,
                        const int is_signed) {
    const int8_t *hi = xq->hi + at * QK;
    const uint8_t *lo = xq->lo + at * QK;
    const ivec offset = iv_set8(is_signed ? -128 : 0);
    ivec dh = iv_zero(), dl = iv_zero(); /* two chains, not one: vpdpbusd's latency */
#pragma GCC unroll 8
    for (int i = i0; i < i0 + n; i++) {
        dh = dot_w_x(dh, v[i], hi + 4 * i);
        dl = dot_x_w(dl, is_signed ? iv_xor(v[i], offset) : v[i], lo + 4 * i);
    }
    if (is_signed) dh = iv_sub32(dh, iv_set32(128 * xq->hisum[at]));
    return iv_add32(iv_shl32(dh, 8), dl);
}

/* byte_dot of the values v[i0 .. i0 + 4) for up to 4 rows at once (rows at[0 .. nr)), their
 * chains interleaved: Q6_K's half-blocks are 4 vpdpbusd a chain, too short for one row's two
 * chains to hide the instruction's latency (bench/ab_quant.py on an AMD EPYC: Q6_K 1.02-1.34x at
 * 1 to 8 rows). Interleaved, Q4_K's whole blocks were 15-27% slower at 4 and 8 rows and Q8_0's
 * 2-7%: they keep byte_dot, a row at a time. */
NS_INLINE void byte_dots_half(ivec dot[4], const ivec *v, const ns_xq *xq, const Py_ssize_t at[4],
                              const int nr, const int i0) {
    ivec dh[4], dl[4];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) dh[r] = iv_zero(), dl[r] = iv_zero();
#pragma GCC unroll 4
    for (int i = i0; i < i0 + 4; i++)
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            dh[r] = dot_w_x(dh[r], v[i], xq->hi + at[r] * QK + 4 * i);
            dl[r] = dot_x_w(dl[r], v[i], xq->lo + at[r] * QK + 4 * i);
        }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) dot[r] = iv_add32(iv_shl32(dh[r], 8), dl[r]);
}

/* byte_step's Q6_K (halves): each half's dot less its zero point 32 times the half's sum of q,
 * scaled by d, then d2; 4 rows at a time. */
NS_INLINE void byte_step_halves(fvec acc[GEMV_ROWS], const strip8 *s, const ns_xq *xq,
                                Py_ssize_t r0, const int mr, Py_ssize_t b) {
#pragma GCC unroll 2
    for (int g = 0; g < mr; g += 4) {
        const int nr = mr - g < 4 ? mr - g : 4;
        Py_ssize_t at[4];
        ivec a[4], c[4];
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) at[r] = (r0 + g + r) * xq->blocks + b;
        byte_dots_half(a, s->v, xq, at, nr, 0);
        byte_dots_half(c, s->v, xq, at, nr, 4);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            const fvec dx = fv_set(xq->dx[at[r]]);
            a[r] = iv_sub32(a[r], iv_set32(32 * xq->sum16[2 * at[r]]));
            c[r] = iv_sub32(c[r], iv_set32(32 * xq->sum16[2 * at[r] + 1]));
            acc[g + r] = fv_fma(iv_to_fv(a[r]), fv_mul(s->d, dx), acc[g + r]);
            acc[g + r] = fv_fma(iv_to_fv(c[r]), fv_mul(s->d2, dx), acc[g + r]);
        }
    }
}

/* acc[r] over block b of rows r0 .. r0 + mr of x against the strip's block s, scaled as
 * scale_dots scales (Q6_K's halves: byte_step_halves). */
NS_INLINE void byte_step(fvec acc[GEMV_ROWS], const strip8 *s, const ns_xq *xq, Py_ssize_t r0,
                         const int mr, Py_ssize_t b, const strip_format f) {
    if (f.halves) {
        byte_step_halves(acc, s, xq, r0, mr, b);
        return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
        const Py_ssize_t at = (r0 + r) * xq->blocks + b;
        const fvec dx = fv_set(xq->dx[at]);
        ivec dot = byte_dot(s->v, xq, at, 0, 8, f.byte_signed);
        if (f.byte_zero) {
            const int32_t sum = xq->sum16[2 * at] + xq->sum16[2 * at + 1]; /* the block's q */
            dot = iv_sub32(dot, iv_set32(f.byte_zero * sum));
        }
        acc[r] = fv_fma(iv_to_fv(dot), fv_mul(s->d, dx), acc[r]);
        if (f.has_min) acc[r] = fv_fma(s->m, fv_set(xq->sx[at]), acc[r]);
    }
}

/* Block b of the strip's rows from column c0 (the last strip's first n) as bytes into s, as
 * unpack_block does for pairs. */
NS_INLINE void unpack_bytes_block(strip8 *s, const ns_qmm *a, Py_ssize_t c0, Py_ssize_t b, int n,
                                  const strip_format f) {
    const strip_src src = src_of(a, c0, b, f);
    if (n == STRIP_W || f.r16) {
        f.unpack_bytes(s, src);
        return;
    }
    _Alignas(64) char rows[STRIP_W][NS_MAX_BLOCK_BYTES] = {{0}};
    for (int c = 0; c < n; c++) memcpy(rows[c], src.w + (size_t)c * src.stride, f.block_bytes);
    f.unpack_bytes(s, (strip_src){rows[0], sizeof rows[0], 0, 0, 0});
}

/* Rows r0 .. r0 + mr of out by the strip from column c0 (`last` columns wide), over all of K. */
NS_INLINE void byte_tile(const ns_qmm *a, Py_ssize_t r0, const int mr, Py_ssize_t c0, int last,
                         const strip_format f) {
    const Py_ssize_t nb = a->K / QK;
    const int subs = f.subs <= 1 ? 1 : f.subs;
    fvec acc[GEMV_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r] = fv_zero();
    strip8 s[QK_K / QK];
    const ahead next = ahead_of(a, c0, 1);
    /* A super-block's sub-blocks as a loop unrolled with constant indices into s (the strip no
     * longer goes through the stack): Q4_K's one-row GEMV 1.14-1.17x on an AMD EPYC
     * (bench/ab_quant.py). Q6_K's took 12-18% longer so at 4 and 8 rows, within what two files of
     * one build differ by at 8 rows there, and keeps the loop over b there. At 1 and 2 rows of
     * at most 3 super-blocks, the unrolled loop ran Qwen3-MoE's 2048 x 768 Q6_K down projections
     * 1.20-1.26x faster streaming (96 copies); the experts' call alone 1.20x (8 tokens). Longer
     * rows keep the loop over b: unrolled, 2048 x 1536 ran 0.90-1.00x, 8192 x 2048 0.89-1.04x. */
    if (!f.halves || (mr <= 2 && nb <= 3 * subs)) {
        for (Py_ssize_t b0 = 0; b0 < nb; b0 += subs) {
            unpack_bytes_block(s, a, c0, b0, last, f);
#pragma GCC unroll 8
            for (int j = 0; j < subs; j++) {
                prefetch_share(next, b0 + j, nb);
                byte_step(acc, s + j, a->x, r0, mr, b0 + j, f);
            }
        }
    } else {
        for (Py_ssize_t b = 0; b < nb; b++) {
            prefetch_share(next, b, nb);
            if (b % subs == 0) unpack_bytes_block(s, a, c0, b, last, f);
            byte_step(acc, s + b % subs, a->x, r0, mr, b, f);
        }
    }
    for (int r = 0; r < mr; r++) store_cols(a->out + (r0 + r) * a->ldo + c0, last, acc[r]);
}

/* out[:, n0:n1] for M <= NS_BYTE_ROWS rows, a strip at a time, GEMV_ROWS rows of it at a time. */
NS_INLINE void byte_gemv(const ns_qmm *a, Py_ssize_t n0, Py_ssize_t n1, const strip_format f) {
    _Static_assert(GEMV_ROWS == 8, "the tiles below are of up to 8 rows");
    for (Py_ssize_t c0 = n0; c0 < n1; c0 += STRIP_W) {
        const int last = n1 - c0 < STRIP_W ? (int)(n1 - c0) : STRIP_W;
        for (Py_ssize_t r0 = 0; r0 < a->M; r0 += GEMV_ROWS) {
            switch (a->M - r0) {
            case 1: byte_tile(a, r0, 1, c0, last, f); break;
            case 2: byte_tile(a, r0, 2, c0, last, f); break;
            case 3: byte_tile(a, r0, 3, c0, last, f); break;
            case 4: byte_tile(a, r0, 4, c0, last, f); break;
            case 5: byte_tile(a, r0, 5, c0, last, f); break;
            case 6: byte_tile(a, r0, 6, c0, last, f); break;
            case 7: byte_tile(a, r0, 7, c0, last, f); break;
            default: byte_tile(a, r0, 8, c0, last, f); break;
            }
        }
    }
}

#endif
