/* The module nanoserve.kernels._C: its method table and constants. The entry points live beside
 * their kernels (paged_attention.c, prefill_attention.c, linear.c, norm_rope.c, decode_step.c,
 * quant.c, quant_experts.c, moe.c, quant_convert.c, copy_rows.c, argmax.c); each takes its
 * arguments by keyword (kernels/python/c_backend.py names every one), pointers as ints. */
#include "quant.h"

#include <omp.h>

static PyObject *py_openmp_max_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(omp_get_max_threads());
}

/* A (self, args, kwargs) function as the PyCFunction that METH_KEYWORDS entries hold. */
#define KW_FUNCTION(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef methods[] = {
    {"paged_attention_decode", KW_FUNCTION(nanoserve_py_paged_attention_decode),
     METH_VARARGS | METH_KEYWORDS,
     "paged_attention_decode(out, q, k_cache, v_cache, block_tables, context_lens, num_seqs, "
     "num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks_per_seq, scale, "
     "dtype_code, cache_dtype_code, num_threads, window=0): pointers as ints, contiguous "
     "tensors; cache_dtype_code 3: rows of q8_0 blocks (head_dim a multiple of 32)."},
    {"paged_attention_prefill", KW_FUNCTION(nanoserve_py_paged_attention_prefill),
     METH_VARARGS | METH_KEYWORDS,
     "paged_attention_prefill(out, q, k_cache, v_cache, block_table, num_tokens, num_q_heads, "
     "num_kv_heads, head_dim, block_size, num_blocks, table_len, context_len, scale, q_dtype, "
     "cache_dtype, num_threads, window=0): one sequence's chunk of num_tokens queries over its "
     "paged KV cache; pointers as ints, contiguous tensors."},
    {"check_prefill_table", KW_FUNCTION(nanoserve_py_check_prefill_table),
     METH_VARARGS | METH_KEYWORDS,
     "check_prefill_table(block_table, table_len, context_len, num_tokens, block_size, "
     "num_blocks): prefill attention's check of context_len and its int32 block table; "
     "ValueError names the argument."},
    {"store_kv", KW_FUNCTION(nanoserve_py_store_kv), METH_VARARGS | METH_KEYWORDS,
     "store_kv(key, value, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim, "
     "block_size, num_blocks, dtype_code, cache_dtype_code, slots_are_int64): pointers as ints; "
     "keys rounded to the cache's dtype (or quantized to q8_0, cache_dtype_code 3)."},
    {"small_linear", KW_FUNCTION(nanoserve_py_small_linear), METH_VARARGS | METH_KEYWORDS,
     "small_linear(out, x, w, M, N, K, dtype_code, num_threads): out[m, n] = sum_k x[m, k] * "
     "w[n, k] for M <= GEMV_ROWS rows, float32 (0) or bfloat16 (1); pointers as ints."},
    {"rms_norm", KW_FUNCTION(nanoserve_py_rms_norm), METH_VARARGS | METH_KEYWORDS,
     "rms_norm(out, x, w, rows, hidden, eps, dtype_code, num_threads): RMSNorm of each row."},
    {"rope", KW_FUNCTION(nanoserve_py_rope), METH_VARARGS | METH_KEYWORDS,
     "rope(qk, positions, cos, sin, rows, heads, head_dim, row_stride, table_rows, dtype_code, "
     "num_threads): rotary embedding in place; positions int64."},
    {"gated", KW_FUNCTION(nanoserve_py_gated), METH_VARARGS | METH_KEYWORDS,
     "gated(act, gate_up, rows, inter, dtype_code, gelu, num_threads): act = f(gate) * up of "
     "rows [gate | up], f silu or (gelu) GELU-tanh."},
    {"decode_layers", KW_FUNCTION(nanoserve_py_decode_layers), METH_VARARGS | METH_KEYWORDS,
     "decode_layers(h, layers, positions, slots, cos, sin, table_rows, block_tables, "
     "context_lens, max_blocks_per_seq, block_size, num_blocks, rows, hidden, heads, kv_heads, "
     "head_dim, intermediate, eps, scale, dtype_code, num_threads, windows=0, local_cos=0, "
     "local_sin=0, gelu=False, experts=0, top_k=0, expert_size=0, normalize=False): a decode "
     "step of up to "
     "GEMV_ROWS rows through every layer, h updated in place; layers: what layer_table returns; "
     "pointers as ints."},
    {"layer_table", KW_FUNCTION(nanoserve_py_layer_table), METH_VARARGS | METH_KEYWORDS,
     "layer_table(layers, cache_dtype_code=0): decode_layers' layers from a list of dicts, one "
     "a layer, {field: (pointer, format)} for every field of the C step's struct layer_weights "
     "(its weights and KV cache, by name); format 0 for floats of the step's dtype (the caches: "
     "of cache_dtype_code), else (a matrix only, with float32 activations) the GGML type id of "
     "its GGUF blocks (BLOCK_FORMATS)."},
    {"check_tables", KW_FUNCTION(nanoserve_py_check_tables), METH_VARARGS | METH_KEYWORDS,
     "check_tables(block_tables, context_lens, num_seqs, max_blocks_per_seq, block_size, "
     "num_blocks): paged attention's check of its int32 tables; ValueError names an entry."},
    {"check_slots", KW_FUNCTION(nanoserve_py_check_slots), METH_VARARGS | METH_KEYWORDS,
     "check_slots(slot_mapping, num_tokens, slots_are_int64, num_slots): the KV store's check of "
     "its slots; ValueError names one past the cache."},
    {"check_positions", KW_FUNCTION(nanoserve_py_check_positions), METH_VARARGS | METH_KEYWORDS,
     "check_positions(positions, num_positions, table_rows): RoPE's check of its int64 "
     "positions; ValueError names one outside the tables."},
    {"quant_linear", KW_FUNCTION(nanoserve_py_quant_linear), METH_VARARGS | METH_KEYWORDS,
     "quant_linear(out, x, w, M, N, K, qtype, num_threads): out [M, N] float32 = x [M, K] "
     "float32 times the transpose of w, N rows of GGUF blocks of GGML type qtype (BLOCK_FORMATS), "
     "x quantized per block to int16; pointers as ints."},
    {"quant_experts", KW_FUNCTION(nanoserve_py_quant_experts), METH_VARARGS | METH_KEYWORDS,
     "quant_experts(outs, ws, x, T, rows, P, groups, G, E, N, K, qtype, num_threads, ldo=N): for "
     "each of 1-2 weights ws[i] (E experts' [N, K] matrices of GGUF blocks, one after another) "
     "outs[i] [P, N] float32 (rows ldo apart), row p = x[rows[p]] (x [T, K] float32; rows int64 [P], or 0: x[p]) times "
     "expert e's matrix transposed for p in each group (e, start, count) of groups int64 [G, 3]; "
     "rows bitwise quant_linear's; pointers as ints (outs and ws tuples of them)."},
    {"moe_route", KW_FUNCTION(nanoserve_py_moe_route), METH_VARARGS | METH_KEYWORDS,
     "moe_route(logits, T, E, k, normalize, weights, experts, among_chosen=False): each of T "
     "rows of router logits [T, E] float32: its softmax's top k (at ties torch.topk's choice), "
     "weights [T, k] float32 (renormalized where normalize; among_chosen: the top k logits "
     "softmaxed among themselves) and experts [T, k] int64; pointers as ints."},
    {"clamped_swiglu", KW_FUNCTION(nanoserve_py_clamped_swiglu), METH_VARARGS | METH_KEYWORDS,
     "clamped_swiglu(act, gate_up, rows, inter, alpha, limit): gpt-oss's activation of float32 "
     "rows [gate | up] into act [rows, inter]; pointers as ints."},
    {"quantize", KW_FUNCTION(nanoserve_py_quantize), METH_VARARGS | METH_KEYWORDS,
     "quantize(out, w, N, K, qtype, num_threads): w [N, K] float32 into N rows of GGUF blocks, "
     "the bytes of gguf.quants.quantize."},
    {"dequantize", KW_FUNCTION(nanoserve_py_dequantize), METH_VARARGS | METH_KEYWORDS,
     "dequantize(out, w, rows, num_rows, N, K, qtype, num_threads): out [num_rows, K] float32 = "
     "rows `rows` (int64 pointer; 0 for all N in order) of the block matrix w."},
    {"copy_rows", KW_FUNCTION(nanoserve_py_copy_rows), METH_VARARGS | METH_KEYWORDS,
     "copy_rows(jobs): each (dst, src, rows, row_bytes, heads[, repack]) copies rows of row_bytes "
     "bytes, each head's rotary halves put back where heads > 0 (llama.cpp's Q and K rows), into "
     "the r16 layout of a K-quant of repack bytes a block where repack > 0, all with the GIL "
     "released; pointers as ints."},
    {"argmax_rows", KW_FUNCTION(nanoserve_py_argmax_rows), METH_VARARGS | METH_KEYWORDS,
     "argmax_rows(out, x, rows, n): out [rows] int64 = torch.argmax of each row of x [rows, n] "
     "float32 (the first largest value; the first NaN where a row has one); pointers as ints."},
    {"set_quant_isa", KW_FUNCTION(nanoserve_py_set_quant_isa), METH_VARARGS | METH_KEYWORDS,
     "set_quant_isa(isa, vnni=True, amx=True): the quantized kernels' path, 'portable', 'avx2' "
     "or 'avx512', capped to what the CPU runs, with AMX-INT8 GEMMs on the VNNI path if amx; "
     "returns (path, vnni) now in use. Not for use while a kernel runs."},
    {"quant_isa", nanoserve_py_quant_isa, METH_NOARGS,
     "(path, vnni) the quantized kernels use now."},
    {"cpu_quant_isa", nanoserve_py_cpu_quant_isa, METH_NOARGS,
     "(path, vnni): the best the CPU runs, whatever NANOSERVE_ISA says."},
    {"quant_amx", nanoserve_py_quant_amx, METH_NOARGS,
     "(in use, available): whether the quantized GEMMs run on AMX-INT8 tiles now, and whether "
     "this CPU and OS let them."},
    {"openmp_max_threads", py_openmp_max_threads, METH_NOARGS,
     "omp_get_max_threads() of the OpenMP runtime this module is bound to."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Paged-attention decode, KV store, small-M linear, RMSNorm, RoPE, the one-call decode step and "
    "matmuls on GGUF block weights; C11 + OpenMP. GEMV_ROWS: the most rows small_linear and "
    "decode_layers take; BLOCK_FORMATS: {name: (GGML type id, bytes of a block, values of a "
    "block along K, the file's format of an r16 one or None)} of the block formats.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "GEMV_ROWS", NS_GEMV_ROWS) < 0) Py_CLEAR(m);
    PyObject *formats = m ? nanoserve_block_formats() : NULL;
    if (m && (!formats || PyModule_AddObjectRef(m, "BLOCK_FORMATS", formats) < 0)) Py_CLEAR(m);
    Py_XDECREF(formats);
    if (m && PyModule_AddIntConstant(m, "STEP_ROWS", NS_STEP_ROWS) < 0) Py_CLEAR(m);
    if (m && nanoserve_quant_init() < 0) Py_CLEAR(m);
    return m;
}
