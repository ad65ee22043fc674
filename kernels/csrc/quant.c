/* out = x @ W^T with W in GGUF blocks (see quant.h): the choice of instruction set, the
 * activations' quantization, the threads, and the Python entry points.
 *
 * The path (portable C, AVX2+FMA+F16C, AVX-512 F/BW/VL with VNNI where the CPU has it) is chosen
 * once at module load from what the CPU reports, capped by the environment variable NANOSERVE_ISA
 * ("portable", "avx2", "avx512"); set_quant_isa changes it for tests and benchmarks.
 *
 * Batch invariant and deterministic: each row of x is quantized on its own, the threads split the
 * output features N (never K), and each out[m, n] is the same sequence of operations on row m of
 * x and row n of W whatever the tile of rows and columns it was computed in.
 */
#include "quant.h"

#include <omp.h>
#include <stdlib.h>

static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512"};
enum { NUM_ISAS = 3 };

static int isa_in_use = NS_ISA_PORTABLE; /* read once per call; set at load and by tests */
static int vnni_in_use = 0;

/* The best path this CPU (and its OS, which __builtin_cpu_supports checks for the AVX states)
 * runs; *vnni: whether it has AVX512-VNNI. */
static int cpu_best_isa(int *vnni) {
    *vnni = 0;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    *vnni = avx512 && __builtin_cpu_supports("avx512vnni");
    return avx512 ? NS_ISA_AVX512 : avx2 ? NS_ISA_AVX2 : NS_ISA_PORTABLE;
#else
    return NS_ISA_PORTABLE;
#endif
}

/* The path named `name`, or -1. */
static int isa_by_name(const char *name) {
    for (int i = 0; i < NUM_ISAS; i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) return i;
    return -1;
}

/* Uses path `isa` capped to what the CPU runs, and VNNI if asked and there. */
static void use_isa(int isa, int vnni) {
    int cpu_vnni;
    const int best = cpu_best_isa(&cpu_vnni);
    isa_in_use = isa < best ? isa : best;
    vnni_in_use = isa_in_use == NS_ISA_AVX512 && vnni && cpu_vnni;
}

int nanoserve_quant_init(void) {
    const char *env = getenv("NANOSERVE_ISA");
    int isa = NS_ISA_AVX512;
    if (env && *env && (isa = isa_by_name(env)) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "NANOSERVE_ISA must be one of portable, avx2, avx512 (or unset), got '%s'",
                     env);
        return -1;
    }
    use_isa(isa, 1);
    return 0;
}

/* ---------------------------------------------------------------- the activations */

const uint8_t NS_PAIRS_4[QK] = {0,  2,  16, 18, 1,  3,  17, 19, 4,  6,  20, 22, 5,  7,  21, 23,
                                8,  10, 24, 26, 9,  11, 25, 27, 12, 14, 28, 30, 13, 15, 29, 31};
const uint8_t NS_PAIRS_8[QK] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};

/* The path's layout of the activations for format qtype, int16 (wide) or int8. */
static ns_xq_layout layout_of(int isa, int vnni, int qtype, int wide) {
#if defined(__x86_64__) || defined(__i386__)
    if (isa == NS_ISA_AVX512) return ns_layout_avx512(qtype, vnni, wide);
    if (isa == NS_ISA_AVX2) return ns_layout_avx2(qtype, wide);
#endif
    (void)isa, (void)vnni;
    return ns_layout_portable(qtype, wide);
}

/* One allocation (64-byte aligned parts) for M rows of K values; returns it, or NULL. */
static void *xq_alloc(ns_xq *xq, const ns_xq_layout *l, Py_ssize_t M, Py_ssize_t K) {
    const Py_ssize_t groups = (K / QK + l->group - 1) / l->group;
    const Py_ssize_t lanes = QK / l->pieces / l->width;
    xq->blocks = groups * l->group;
    xq->q_stride = xq->blocks * QK;
    xq->lane_stride = xq->blocks * lanes;
    xq->wide = l->wide;
    const size_t elem = l->wide ? sizeof(int16_t) : sizeof(int8_t);
    const size_t q_bytes = ((size_t)(M * xq->q_stride) * elem + 63) & ~(size_t)63;
    const size_t lane_bytes = ((size_t)(M * xq->lane_stride) * 4 + 63) & ~(size_t)63;
    char *base = aligned_alloc(64, q_bytes + 3 * lane_bytes + 64);
    if (!base) return NULL;
    xq->q = (int8_t *)base;
    xq->dx = (float *)(base + q_bytes);
    xq->sx = (float *)(base + q_bytes + lane_bytes);
    xq->corr = (int32_t *)(base + q_bytes + 2 * lane_bytes);
    return base;
}

/* v = round(x / dx) with dx = max|x| / levels (127: llama.cpp's Q8 activations; 32767),
 * halves to even; returns dx. The same on every path, so the integer dot products are too.
 * Written so that GCC vectorises it: max|x| as an integer max of the bit patterns (monotonic for
 * |x|, and a NaN wins, making every output NaN), the clamp as selects. */
static float quantize_block(int16_t *v, const float *x, const float levels) {
    uint32_t amax_bits = 0;
    for (int j = 0; j < QK; j++) {
        const uint32_t a = ns_f32_to_bits(x[j]) & 0x7fffffffu;
        amax_bits = a > amax_bits ? a : amax_bits;
    }
    const float dx = ns_bits_to_f32(amax_bits) / levels, id = dx != 0.0f ? 1.0f / dx : 0.0f;
    for (int j = 0; j < QK; j++) {
        const float r = rintf(x[j] * id);
        v[j] = (int16_t)(int)(r > levels ? levels : r < -levels ? -levels : r);
    }
    return dx;
}

/* The sums of the values each of a block's lanes covers (see ns_xq_layout). */
static void lane_sums(int32_t *s, const int16_t *v, const ns_xq_layout *l) {
    const int piece = QK / l->pieces, lanes = piece / l->width;
    for (int i = 0; i < lanes; i++) {
        int32_t sum = 0;
        for (int p = 0; p < l->pieces; p++)
            for (int j = 0; j < l->width; j++) sum += v[p * piece + l->width * i + j];
        s[i] = sum;
    }
}

/* Block b's values into the row's q, each piece where its group has it, and its lanes. */
static void place_block(const ns_xq *xq, const ns_xq_layout *l, Py_ssize_t m, Py_ssize_t b,
                        const int16_t *v, float dx) {
    const int piece = QK / l->pieces, lanes = piece / l->width;
    const Py_ssize_t g = b / l->group, i = b % l->group;
    for (int p = 0; p < l->pieces; p++) {
        const Py_ssize_t at = m * xq->q_stride + g * l->group * QK + (p * l->group + i) * piece;
        if (l->order)
            for (int j = 0; j < QK; j++) xq->q16[at + j] = v[l->order[j]];
        else if (l->wide)
            memcpy(xq->q16 + at, v + p * piece, (size_t)piece * sizeof(int16_t));
        else
            for (int j = 0; j < piece; j++) xq->q[at + j] = (int8_t)v[p * piece + j];
    }
    int32_t s[QK];
    lane_sums(s, v, l);
    const Py_ssize_t at = m * xq->lane_stride + b * lanes;
    for (int k = 0; k < lanes; k++) {
        xq->dx[at + k] = dx;
        xq->sx[at + k] = dx * (float)s[k];
        xq->corr[at + k] = -l->corr * s[k];
    }
}

/* Row m of x, quantized (padding blocks are zeros). */
static void quantize_x_row(const ns_xq *xq, const ns_xq_layout *l, const float *x, Py_ssize_t m,
                           Py_ssize_t K) {
    const float levels = l->wide ? 32767.0f : 127.0f;
    for (Py_ssize_t b = 0; b < xq->blocks; b++) {
        int16_t v[QK] = {0};
        const float dx = b < K / QK ? quantize_block(v, x + m * K + b * QK, levels) : 0.0f;
        place_block(xq, l, m, b, v, dx);
    }
}

/* ---------------------------------------------------------------- the driver */

typedef void (*qmm_fn)(const ns_qmm *, Py_ssize_t, Py_ssize_t);

static qmm_fn kernel_of(int isa, int vnni) {
#if defined(__x86_64__) || defined(__i386__)
    if (isa == NS_ISA_AVX512) return vnni ? ns_qmm_avx512_vnni : ns_qmm_avx512;
    if (isa == NS_ISA_AVX2) return ns_qmm_avx2;
#endif
    (void)isa, (void)vnni;
    return ns_qmm_portable;
}

int nanoserve_quant_matmul(float *out, const float *x, const void *w, Py_ssize_t M, Py_ssize_t N,
                           Py_ssize_t K, int qtype, int act, int num_threads) {
    const int isa = isa_in_use, vnni = vnni_in_use;
    const ns_xq_layout l = layout_of(isa, vnni, qtype, act != NS_ACT_INT8);
    ns_xq xq;
    void *base = xq_alloc(&xq, &l, M, K);
    if (!base) return -1;
    const ns_qmm a = {out, (const char *)w, &xq, M, N, K, (size_t)(K / QK) * ns_block_bytes(qtype),
                      qtype};
    const qmm_fn kernel = kernel_of(isa, vnni);
    if (num_threads > N) num_threads = N > 0 ? (int)N : 1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (Py_ssize_t m = 0; m < M; m++) quantize_x_row(&xq, &l, x, m, K);
        /* A contiguous range of output features per thread; the split never changes a result. */
        const Py_ssize_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const Py_ssize_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
        if (n0 < n1) kernel(&a, n0, n1);
    }
    free(base);
    return 0;
}

/* ---------------------------------------------------------------- Python entry points */

PyObject *nanoserve_py_quant_linear(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "x", "w", "M", "N", "K", "qtype", "num_threads",
                             "activations", NULL};
    unsigned long long out, x, w;
    Py_ssize_t M, N, K;
    int qtype, num_threads, act = NS_ACT_INT16;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKnnnii|i", kwlist, &out, &x, &w, &M, &N, &K,
                                     &qtype, &num_threads, &act) ||
        nanoserve_check_activations("quant_linear", act) < 0)
        return NULL;
    if (!ns_block_bytes(qtype) || M < 0 || N < 0 || K < 0 || K % QK || num_threads < 1) {
        PyErr_Format(PyExc_ValueError, "quant_linear: qtype code %d, [M, N, K] = [%zd, %zd, %zd] "
                     "or num_threads %d out of range (K a multiple of 32)", qtype, M, N, K,
                     num_threads);
        return NULL;
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    if (M > 0 && N > 0)
        rc = nanoserve_quant_matmul((float *)(uintptr_t)out, (const float *)(uintptr_t)x,
                                    (const void *)(uintptr_t)w, M, N, K, qtype, act,
                                    num_threads);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

int nanoserve_check_activations(const char *fn, int act) {
    if (act == NS_ACT_INT8 || act == NS_ACT_INT16) return 0;
    PyErr_Format(PyExc_ValueError, "%s: activations code %d is neither 16 (int16) nor 8 (int8)",
                 fn, act);
    return -1;
}

/* (path, vnni) */
static PyObject *isa_tuple(int isa, int vnni) {
    return Py_BuildValue("(sO)", ISA_NAMES[isa], vnni ? Py_True : Py_False);
}

PyObject *nanoserve_py_quant_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return isa_tuple(isa_in_use, vnni_in_use);
}

PyObject *nanoserve_py_cpu_quant_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    int vnni;
    const int best = cpu_best_isa(&vnni);
    return isa_tuple(best, vnni);
}

PyObject *nanoserve_py_set_quant_isa(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"isa", "vnni", NULL};
    const char *name;
    int vnni = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|p", kwlist, &name, &vnni)) return NULL;
    const int isa = isa_by_name(name);
    if (isa < 0) {
        PyErr_Format(PyExc_ValueError, "isa must be one of portable, avx2, avx512, got '%s'",
                     name);
        return NULL;
    }
    use_isa(isa, vnni);
    return isa_tuple(isa_in_use, vnni_in_use);
}
