/* out = x @ W^T with W in GGUF blocks (see quant.h): the choice of instruction set, the
 * activations' quantization, the threads, and the Python entry points of the matmul.
 *
 * The path (portable C, AVX2+FMA+F16C, AVX-512 F/BW/VL with VNNI where the CPU has it) is chosen
 * once at module load from what the CPU reports, capped by the environment variable NANOSERVE_ISA
 * ("portable", "avx2", "avx512"); set_quant_isa changes it for tests and benchmarks. The format's
 * row of the table of formats (FORMATS, below) gives the path's kernel. On the VNNI path, GEMMs
 * of M >= NS_AMX_ROWS run on AMX-INT8 tiles (quant_amx.h, the same results bit for bit) where
 * the CPU has them and Linux lets the process use them, unless NANOSERVE_AMX is 0.
 *
 * Batch invariant and deterministic: each row of x is quantized on its own, the threads split the
 * output features N (never K), and each out[m, n] is the same sequence of operations on row m of
 * x and row n of W whatever the tile of rows and columns it was computed in.
 */
#include "quant.h"

#include <omp.h>
#include <stdlib.h>
#if NS_X86 && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* The formats, each defined in its file quant_<name>.c: adding one is a line here, its file, its
 * GGML id (quant.h) and its SIMD kernel (quant_simd.h). Python reads them from _C.BLOCK_FORMATS. */
extern const ns_block_format Q8_0_FORMAT, Q4_0_FORMAT, Q4_1_FORMAT;
extern const ns_block_format Q5_0_FORMAT, Q5_1_FORMAT, Q4_K_FORMAT, Q5_K_FORMAT, Q6_K_FORMAT;
extern const ns_block_format F16_FORMAT, BF16_FORMAT, MXFP4_FORMAT;
extern const ns_block_format Q4_K_R16_FORMAT, Q5_K_R16_FORMAT, Q6_K_R16_FORMAT, MXFP4_R16_FORMAT;
extern const ns_block_format Q5_0_R16_FORMAT, Q5_1_R16_FORMAT, Q8_0_R16_FORMAT;
static const ns_block_format *const FORMATS[] = {
    &Q8_0_FORMAT,     &Q4_0_FORMAT,     &Q4_1_FORMAT,    &Q5_0_FORMAT, &Q5_1_FORMAT,
    &Q4_K_FORMAT,     &Q5_K_FORMAT,     &Q6_K_FORMAT,    &F16_FORMAT,  &BF16_FORMAT,
    &MXFP4_FORMAT,    &Q4_K_R16_FORMAT, &Q5_K_R16_FORMAT, &Q6_K_R16_FORMAT, &MXFP4_R16_FORMAT,
    &Q5_0_R16_FORMAT, &Q5_1_R16_FORMAT, &Q8_0_R16_FORMAT};
enum { NUM_FORMATS = sizeof FORMATS / sizeof FORMATS[0] };

const ns_block_format *ns_block_format_of(int code) {
    for (int i = 0; i < NUM_FORMATS; i++)
        if ((int)FORMATS[i]->code == code) return FORMATS[i];
    return NULL;
}

/* The names of the paths NS_PORTABLE, NS_AVX2 and NS_AVX512 (whose VNNI is a flag here). */
static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512"};
enum { NUM_ISAS = 3 };

static int isa_in_use = NS_PORTABLE; /* read once per call; set at load and by tests */
static int vnni_in_use = 0;
static int amx_in_use = 0;  /* only with vnni_in_use */
static int cpu_amx = -1;    /* whether the process may use AMX-INT8: -1 until asked */

/* Whether the CPU has AMX-INT8 (cpuid leaf 7: EDX bits 24, amx-tile, and 25, amx-int8) and Linux
 * grants this process the tiles' state (XFEATURE_XTILEDATA, 18, through ARCH_REQ_XCOMP_PERM): a
 * tile instruction without that grant kills the process. Asked once. */
static int cpu_has_amx(void) {
    if (cpu_amx >= 0) return cpu_amx;
    cpu_amx = 0;
#if NS_X86 && defined(__linux__)
    unsigned eax, ebx, ecx, edx;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 24 & 1) && (edx >> 25 & 1))
        cpu_amx = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
#endif
    return cpu_amx;
}

/* The best path this CPU (and its OS, which __builtin_cpu_supports checks for the AVX states)
 * runs; *vnni: whether it has AVX512-VNNI. */
static int cpu_best_isa(int *vnni) {
    *vnni = 0;
#if defined(__GNUC__) && NS_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    *vnni = avx512 && __builtin_cpu_supports("avx512vnni");
    return avx512 ? NS_AVX512 : avx2 ? NS_AVX2 : NS_PORTABLE;
#else
    return NS_PORTABLE;
#endif
}

/* The path named `name`, or -1. */
static int isa_by_name(const char *name) {
    for (int i = 0; i < NUM_ISAS; i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) return i;
    return -1;
}

/* Uses path `isa` capped to what the CPU runs, VNNI if asked and there, and AMX if asked and
 * there with VNNI. */
static void use_isa(int isa, int vnni, int amx) {
    int cpu_vnni;
    const int best = cpu_best_isa(&cpu_vnni);
    isa_in_use = isa < best ? isa : best;
    vnni_in_use = isa_in_use == NS_AVX512 && vnni && cpu_vnni;
    amx_in_use = vnni_in_use && amx && cpu_has_amx();
}

int nanoserve_quant_init(void) {
    const char *env = getenv("NANOSERVE_ISA");
    int isa = NS_AVX512;
    if (env && *env && (isa = isa_by_name(env)) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "NANOSERVE_ISA must be one of portable, avx2, avx512 (or unset), got '%s'",
                     env);
        return -1;
    }
    const char *amx = getenv("NANOSERVE_AMX");
    if (amx && *amx && strcmp(amx, "0") != 0 && strcmp(amx, "1") != 0) {
        PyErr_Format(PyExc_ValueError, "NANOSERVE_AMX must be 0 or 1 (or unset), got '%s'", amx);
        return -1;
    }
    use_isa(isa, 1, !(amx && strcmp(amx, "0") == 0));
    return 0;
}

/* ---------------------------------------------------------------- the activations */

/* One allocation (64-byte aligned parts) for M rows of K values, and their split into hi and lo
 * bytes (tiles) if `split` (M rounded up to NS_AMX_ROWS rows, the extra ones zeros), or in order
 * (hi, lo) if `bytes`; returns it, or NULL. */
void *ns_xq_alloc(ns_xq *xq, Py_ssize_t M, Py_ssize_t K, int split, int bytes) {
    xq->blocks = K / QK;
    const Py_ssize_t rows = split ? (M + NS_AMX_ROWS - 1) / NS_AMX_ROWS * NS_AMX_ROWS : M;
    const size_t q_bytes = ((size_t)(M * K) * sizeof(int16_t) + 63) & ~(size_t)63;
    const size_t scale_bytes = ((size_t)(rows * xq->blocks) * sizeof(float) + 63) & ~(size_t)63;
    const size_t tile_bytes = split ? (size_t)(rows * K) * 2 : 0;
    const size_t byte_bytes = bytes ? ((size_t)(M * K) + 63) & ~(size_t)63 : 0;
    const size_t sum_bytes = bytes ? (size_t)(M * K / 16 + M * K / QK) * sizeof(int32_t) : 0;
    char *base = aligned_alloc(
        64, q_bytes + 2 * scale_bytes + tile_bytes + 2 * byte_bytes + sum_bytes + 64);
    if (!base) return NULL;
    xq->q = (int16_t *)base;
    xq->dx = (float *)(base + q_bytes);
    xq->sx = (float *)(base + q_bytes + scale_bytes);
    xq->tiles = NULL;
    xq->hi = bytes ? (int8_t *)(base + q_bytes + 2 * scale_bytes + tile_bytes) : NULL;
    xq->lo = bytes ? (uint8_t *)(base + q_bytes + 2 * scale_bytes + tile_bytes + byte_bytes) : NULL;
    xq->sum16 = bytes ? (int32_t *)(base + q_bytes + 2 * scale_bytes + tile_bytes + 2 * byte_bytes)
                      : NULL;
    xq->hisum = bytes ? xq->sum16 + M * K / 16 : NULL;
    if (split) {
        xq->tiles = (int8_t *)(base + q_bytes + 2 * scale_bytes);
        const size_t pad = (size_t)(rows - M) * (size_t)xq->blocks;
        memset(xq->dx + M * xq->blocks, 0, pad * sizeof(float));
        memset(xq->sx + M * xq->blocks, 0, pad * sizeof(float));
        /* the last tile, whose rows past M stay zeros (M's are written by ns_quantize_x_row) */
        if (pad) memset(xq->tiles + (rows - NS_AMX_ROWS) * K * 2, 0, (size_t)(NS_AMX_ROWS * K) * 2);
    }
    return base;
}

/* v = round(x / dx) with dx = max|x| / 32767, halves to even; returns dx. The same on every
 * path, so the integer dot products are too. Written so that GCC vectorises it: max|x| as an
 * integer max of the bit patterns (monotonic for |x|, and a NaN wins, making every output NaN),
 * the clamp as selects. */
static float quantize_block(int16_t *v, const float *x) {
    const float levels = 32767.0f;
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

/* Sum of n int16 values, vectorised (GCC's cost model left 16 of them scalar). */
static int32_t sum_i16(const int16_t *v, int n) {
    int32_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < n; j++) s += v[j];
    return s;
}

/* A block's values as hi and lo bytes (v = 256 hi + lo) and the sum of hi. */
static int32_t split_bytes(const int16_t *restrict v, int8_t *restrict hi, uint8_t *restrict lo) {
    int32_t hs = 0;
#pragma omp simd reduction(+ : hs)
    for (int j = 0; j < QK; j++) {
        hi[j] = (int8_t)(v[j] >> 8);
        lo[j] = (uint8_t)(v[j] & 255);
        hs += v[j] >> 8;
    }
    return hs;
}

/* Row m of x, quantized: each block's values in `order` (value order[j] at j), or in order when
 * it is NULL, its dx and sx, and its split into hi and lo where xq has them (tiles, or hi and
 * lo in order). Where xq has no q (the byte GEMV reads hi and lo only), q is not written. xq's
 * pointers are read once into locals, and the bytes written through restrict pointers: stores of
 * bytes may alias anything, and GCC reloaded xq's fields at every byte, in a loop it left
 * scalar. */
void ns_quantize_x_row(const ns_xq *xq, const uint8_t *order, const float *x, Py_ssize_t m) {
    const Py_ssize_t blocks = xq->blocks;
    int8_t *const tiles = xq->tiles, *const his = xq->hi;
    uint8_t *const los = xq->lo;
    int16_t *const qs = xq->q;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const Py_ssize_t at = m * blocks + b;
        int16_t v[QK];
        const float dx = quantize_block(v, x + at * QK);
        const int32_t s0 = sum_i16(v, QK / 2), s1 = sum_i16(v + QK / 2, QK / 2);
        xq->dx[at] = dx;
        xq->sx[at] = dx * (float)(s0 + s1);
        if (qs) {
            int16_t *q = qs + at * QK;
            for (int j = 0; j < QK; j++) q[j] = order ? v[order[j]] : v[j];
        }
        if (tiles) {
            int8_t *hi = tiles + ((m / NS_AMX_ROWS * blocks + b) * 2 * NS_AMX_ROWS +
                                  m % NS_AMX_ROWS) * QK;
            const int16_t *q = qs + at * QK;
            for (int j = 0; j < QK; j++) {
                hi[j] = (int8_t)(q[j] >> 8);
                hi[NS_AMX_ROWS * QK + j] = (int8_t)(q[j] & 255); /* lo, as the same bits */
            }
        }
        if (!his) continue;
        xq->hisum[at] = split_bytes(v, his + at * QK, los + at * QK);
        xq->sum16[at * 2] = s0;
        xq->sum16[at * 2 + 1] = s1;
    }
}

/* ---------------------------------------------------------------- the driver */

/* The format's kernel on the path. */
ns_matmul_fn ns_path_kernel(const ns_block_format *f, int path) {
    switch (path) {
#if NS_X86
    case NS_AVX2: return NS_AVX2_KERNELS[f->code];
    case NS_AVX512: return NS_AVX512_KERNELS[f->code];
    case NS_AVX512_VNNI: return NS_AVX512_VNNI_KERNELS[f->code];
    case NS_AMX: return NS_AMX_KERNELS[f->code];
#endif
    default: return f->portable;
    }
}

int ns_quant_path(void) {
    return isa_in_use + vnni_in_use + amx_in_use; /* NS_AVX512 + 1 is NS_AVX512_VNNI, + 2 NS_AMX */
}

/* Where thread t of nt starts reading the next matrix (NULL: none follows in blocks). */
static const char *next_share(const ns_next *then, Py_ssize_t t, Py_ssize_t nt) {
    if (!then || !then->w) return NULL;
    const ns_block_format *g = ns_block_format_of(then->qtype);
    if (!g) return NULL;
    const size_t row_bytes = (size_t)(then->K / ns_block_values(g)) * g->block_bytes;
    return (const char *)then->w + (size_t)ns_share(then->N, t, nt, g) * row_bytes;
}

int nanoserve_quant_matmul(float *out, Py_ssize_t ldo, const float *x, const void *w, Py_ssize_t M,
                           Py_ssize_t N, Py_ssize_t K, int qtype, int num_threads) {
    return nanoserve_quant_matmul_then(out, ldo, x, w, M, N, K, qtype, num_threads, NULL);
}

int nanoserve_quant_matmul_then(float *out, Py_ssize_t ldo, const float *x, const void *w,
                                Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, int qtype,
                                int num_threads, const ns_next *then) {
    const ns_block_format *f = ns_block_format_of(qtype);
    const int path = ns_quant_path();
    const uint8_t *order = path == NS_PORTABLE ? NULL : f->pairs;
    ns_xq xq = {0};
    void *base = NULL; /* the quantized activations, which a float_x format does without */
    const int split = path == NS_AMX && M >= NS_AMX_ROWS;
    const int bytes = path >= NS_AVX512_VNNI && M <= NS_BYTE_ROWS && !split && f->byte_gemv;
    if (!f->float_x && !(base = ns_xq_alloc(&xq, M, K, split, bytes))) return -1;
    if (bytes) xq.q = NULL; /* the byte GEMV reads hi and lo only */
    const ns_qmm a = {out, (const char *)w, &xq, M, N, K, ldo,
                      (size_t)(K / ns_block_values(f)) * f->block_bytes, x};
    const ns_matmul_fn kernel = ns_path_kernel(f, path);
    if (num_threads > N) num_threads = N > 0 ? (int)N : 1;
#pragma omp parallel num_threads(num_threads)
    {
        if (!f->float_x) {
#pragma omp for schedule(static)
            for (Py_ssize_t m = 0; m < M; m++) ns_quantize_x_row(&xq, order, x, m);
        }
        /* A contiguous range of output features per thread; the split never changes a result.
         * Past its range the thread's GEMV asks ahead for its share of the next matrix. */
        const Py_ssize_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const Py_ssize_t n0 = ns_share(N, t, nt, f), n1 = ns_share(N, t + 1, nt, f);
        ns_qmm mine = a;
        mine.N = n1;
        mine.then = next_share(then, t, nt);
        if (n0 < n1) kernel(&mine, n0, n1);
    }
    free(base);
    return 0;
}

size_t nanoserve_block_bytes(int qtype) {
    const ns_block_format *f = ns_block_format_of(qtype);
    return f ? f->block_bytes : 0;
}

/* ---------------------------------------------------------------- Python entry points */

PyObject *nanoserve_py_quant_linear(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"out", "x", "w", "M", "N", "K", "qtype", "num_threads", "ldo", NULL};
    unsigned long long out, x, w;
    Py_ssize_t M, N, K, ldo = -1; /* -1: N, out is [M, N] */
    int qtype, num_threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKnnnii|n", kwlist, &out, &x, &w, &M, &N, &K,
                                     &qtype, &num_threads, &ldo))
        return NULL;
    if (ldo == -1) ldo = N;
    const ns_block_format *f = ns_block_format_of(qtype);
    if (!f || M < 0 || N < 0 || K < 0 || K % ns_block_values(f) || num_threads < 1 || ldo < N ||
        (f->rows && N % NS_R16)) {
        PyErr_Format(PyExc_ValueError, "quant_linear: qtype code %d, [M, N, K] = [%zd, %zd, %zd], "
                     "num_threads %d or ldo %zd out of range", qtype, M, N, K, num_threads, ldo);
        return NULL;
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    if (M > 0 && N > 0)
        rc = nanoserve_quant_matmul((float *)(uintptr_t)out, ldo, (const float *)(uintptr_t)x,
                                    (const void *)(uintptr_t)w, M, N, K, qtype, num_threads);
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyObject *nanoserve_block_formats(void) {
    PyObject *formats = PyDict_New();
    for (int i = 0; formats && i < NUM_FORMATS; i++) {
        const ns_block_format *f = FORMATS[i];
        PyObject *row = Py_BuildValue("(iniz)", f->code, (Py_ssize_t)f->block_bytes,
                                      ns_block_values(f), f->rows ? f->rows->name : NULL);
        if (!row || PyDict_SetItemString(formats, f->name, row) < 0) Py_CLEAR(formats);
        Py_XDECREF(row);
    }
    return formats;
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
    static char *kwlist[] = {"isa", "vnni", "amx", NULL};
    const char *name;
    int vnni = 1, amx = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|pp", kwlist, &name, &vnni, &amx))
        return NULL;
    const int isa = isa_by_name(name);
    if (isa < 0) {
        PyErr_Format(PyExc_ValueError, "isa must be one of portable, avx2, avx512, got '%s'",
                     name);
        return NULL;
    }
    use_isa(isa, vnni, amx);
    return isa_tuple(isa_in_use, vnni_in_use);
}

PyObject *nanoserve_py_quant_amx(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return Py_BuildValue("(OO)", amx_in_use ? Py_True : Py_False,
                         cpu_has_amx() ? Py_True : Py_False);
}
