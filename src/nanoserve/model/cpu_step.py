"""Every decoder layer of a CPU decode step of up to 4 rows in one C call (up to 16 where every
matrix is in GGUF blocks: a speculative verification's rows; see engine/spec/ngram.py).

The layer-by-layer path makes about 25 Python calls per layer; at batch 1, where a step is a few
milliseconds of weight reading, their overhead is a sizeable share of it. The C step
(kernels/csrc/decode_step.c) runs the same kernels (RMSNorm, GEMV, RoPE, KV store, paged
attention) back to back, so a decode step returns to Python once. Prefill chunks, larger batches,
other devices and dtypes take the layer-by-layer path. A family's options (biases, Qwen3's q/k
norms, Gemma 3's output norms) are fields of the C step too, a null pointer where the model has
none; Gemma 3's windows (one per layer, with the local RoPE tables) and GELU-tanh are arguments.
A mixture of experts (Qwen3-MoE, Mixtral, gpt-oss with its sinks) takes the C step in float32
(kernels/csrc/moe.c: router, routing, the chosen experts' matmuls; its sizes are arguments). A
Gemma model in bfloat16 decodes layer by layer (its norm weights are float32), as does a mixture
of experts in bfloat16; the log says so.
"""

from __future__ import annotations

import math

import torch

from nanoserve.kernels import (
    KV_Q8_0,
    SMALL_LINEAR_MAX_ROWS,
    QuantizedParts,
    QuantizedWeight,
    c_backend,
    cache_row_width,
)
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.moe import Experts
from nanoserve.model.quantized import Blocks
from nanoserve.model.weights import LAYER, LayerWeights, Matrix, matrices

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
# The fields of the C step's struct layer_weights: every field of a layer.
C_FIELDS = tuple(name for name, _ in LAYER)


class CpuDecodeStep:
    def __init__(self, layers: list[LayerWeights], config: ModelConfig) -> None:
        """Reads the weights' addresses once: replacing a layer's tensors afterwards would leave
        this step reading the old ones (nothing in nanoserve does)."""
        self.config = config
        self.scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
        # Per layer, each weight by its name (a field of the C step's struct layer_weights).
        self.weights = [{name: _stored(getattr(x, name)) for name in C_FIELDS} for x in layers]
        # The quantized matmul takes any number of rows; the float GEMV up to 4, a float router
        # beside blocks up to 16 (as the layer path multiplies it: model/linear.py's gemv_rows).
        blocks = all(
            isinstance(m.weight, Blocks)
            or (m is x.router and getattr(m, "gemv_rows", 0) >= c_backend.STEP_ROWS)
            for x in layers
            for m in _all_matrices(x)
        )
        self.max_rows = c_backend.STEP_ROWS if blocks else SMALL_LINEAR_MAX_ROWS
        self.windows = (
            torch.tensor(config.layer_windows, dtype=torch.int64) if config.layer_windows else None
        )
        self._caches: list[torch.Tensor] = []  # the cache tensors behind self._table
        self._table: object = None

    @staticmethod
    def supported(layers: list[LayerWeights], config: ModelConfig) -> bool:
        """Every matrix takes the C GEMV (CPU, float32 or bfloat16, C kernels on) or is kept in
        GGUF blocks (then with float32 activations), and every norm weight is of the activations'
        dtype (Gemma's are float32 in any model: in bfloat16 such a model decodes layer by
        layer)."""
        if not_in_c(layers):
            return False
        ms = [m for layer in layers for m in _all_matrices(layer)]
        blocks = any(isinstance(m.weight, Blocks) for m in ms)
        floats_ok = all(m.gemv or isinstance(m.weight, Blocks) for m in ms)
        dtype = layers[0].input_norm.dtype if layers else torch.float32
        return c_backend.enabled() and floats_ok and not (blocks and dtype != torch.float32)

    def applies(self, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step of 1 to max_rows tokens whose metadata has the C step's types and
        shapes."""
        n = positions.shape[0]
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        return (
            1 <= n <= self.max_rows
            and meta.num_decode == n
            and not meta.prefills
            and meta.backend in ("auto", "c")
            and positions.dtype == meta.slot_mapping.dtype == torch.int64
            and tables.dtype == lens.dtype == torch.int32
            and tables.dim() == 2
            and tables.shape[0] == lens.shape[0] == n
            and all(t.is_cpu and t.is_contiguous() for t in (positions, tables, lens))
            and meta.slot_mapping.is_contiguous()
        )

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        cos: torch.Tensor,
        sin: torch.Tensor,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Runs every layer on h ([num_tokens, hidden], updated in place)."""
        c, k_cache = self.config, kv_caches[0][0]
        c_backend.decode_layers(
            h,
            self.layer_table(kv_caches, h.dtype),
            positions,
            meta.slot_mapping,
            cos,
            sin,
            meta.decode_block_tables,
            meta.decode_context_lens,
            num_blocks=k_cache.shape[0],
            block_size=k_cache.shape[2],
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            intermediate=c.intermediate_size,
            eps=c.rms_norm_eps,
            scale=self.scale,
            windows=self.windows,
            local=local,
            gelu=c.activation == "gelu_pytorch_tanh",
            moe=(c.num_experts, c.experts_per_token, c.expert_size, c.norm_topk_prob)
            if c.moe
            else (0, 0, 0, False),
            gpt_oss=(c.swiglu_alpha, c.swiglu_limit) if c.gpt_oss else None,
        )

    def layer_table(self, kv_caches: KVCaches, dtype: torch.dtype) -> object:
        """The C step's layers (weights and KV caches), rebuilt (and the caches checked) when a
        cache changes. The caches: all of one dtype, the activations' (dtype), or bfloat16 or
        float16 under float32 activations (the C step rounds each key to them as stored), or
        q8_0 rows (quantized as stored)."""
        caches = [t for pair in kv_caches for t in pair]
        if len(caches) == len(self._caches) and all(
            a is b for a, b in zip(caches, self._caches, strict=True)
        ):
            return self._table
        if len(kv_caches) != len(self.weights):
            raise ValueError(f"{len(kv_caches)} KV cache pairs for {len(self.weights)} layers")
        c = self.config
        cache_dtype = caches[0].dtype
        width = cache_row_width(c.head_dim, cache_dtype)
        shape = (caches[0].shape[0], c.num_kv_heads, caches[0].shape[2], width)
        sixteen_bit = (torch.bfloat16, torch.float16)
        if cache_dtype not in (dtype, KV_Q8_0) and not (
            dtype == torch.float32 and cache_dtype in sixteen_bit
        ):
            raise ValueError(
                f"KV caches must be of the activations' dtype ({dtype}), q8_0, or bfloat16 or "
                f"float16 under float32 activations; got {cache_dtype}"
            )
        for t in caches:
            if t.shape != shape or t.dtype != cache_dtype or not t.is_cpu or not t.is_contiguous():
                raise ValueError(
                    f"KV caches must be contiguous CPU tensors of one dtype ({cache_dtype}) "
                    f"shaped {shape}, got {tuple(t.shape)} {t.dtype} on {t.device}"
                )
        layers = [
            {**w, "k_cache": (k.data_ptr(), 0), "v_cache": (v.data_ptr(), 0)}
            for w, (k, v) in zip(self.weights, kv_caches, strict=True)
        ]
        self._caches, self._table = caches, c_backend.layer_table(layers, cache_dtype)
        return self._table


def _all_matrices(layer: LayerWeights) -> list[Matrix | Experts]:
    """A layer's matrices and its experts' (a projection's experts each)."""
    experts = (layer.experts_gate, layer.experts_up, layer.experts_down)
    return [*matrices(layer), *(e for e in experts if e is not None)]


def _stored(w: torch.Tensor | Matrix | Experts | None) -> object:
    """(data pointer, format) of a weight: format 0 for floats, else its GGML type id; (0, 0)
    for an option the model does not have. A matrix of parts in different formats: a list of
    ((pointer, format), rows), a part each. Experts: their one tensor of every expert's matrix."""
    if w is None:
        return 0, 0
    t = w if isinstance(w, torch.Tensor) else w.weight
    if isinstance(t, QuantizedParts):
        return [(_in_blocks(p), p.shape[0]) for p in t.parts]
    if isinstance(t, QuantizedWeight):
        return _in_blocks(t)
    return t.data_ptr(), 0


def _in_blocks(w: QuantizedWeight) -> tuple[int, int]:
    return w.data.data_ptr(), c_backend.QTYPE_CODES[w.kernel_qtype]


def not_in_c(layers: list[LayerWeights]) -> str | None:
    """Why the C step cannot take these layers where it is their norms' dtype; None: it can."""
    if not layers:
        return None
    dtype = layers[0].input_norm.dtype  # GGUF blocks' activations: float32, as their norms
    if isinstance(layers[0].qkv.weight, torch.Tensor):
        dtype = layers[0].qkv.weight.dtype
    if layers[0].router is not None and dtype != torch.float32:
        return f"mixture-of-experts layers in {str(dtype).removeprefix('torch.')} (float32 only)"
    norms = [getattr(x, name) for x in layers for name, t in LAYER if t.kind == "norm"]
    if any(n is not None and n.dtype != dtype for n in norms):
        return f"float32 norm weights in a {str(dtype).removeprefix('torch.')} model"
    vectors = [getattr(x, name) for x in layers for name, t in LAYER if "bias" in t.kind]
    experts = [e.weight for x in layers for e in (x.experts_gate, x.experts_up, x.experts_down)
               if e is not None and isinstance(e.weight, torch.Tensor)]  # fmt: skip
    if any(v is not None and not v.is_contiguous() for v in [*norms, *vectors, *experts]):
        return "a norm, bias or experts tensor that is not contiguous"
    return None
