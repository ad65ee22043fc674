"""Every decoder layer of a CPU decode step of up to 4 sequences in one C call.

Llama.forward makes about 25 Python calls per layer; at batch 1 on the 25M benchmark model they
cost more than half a millisecond a step beside ~3 ms of weight reading. The C step
(kernels/csrc/decode_step.c) runs the same kernels (RMSNorm, GEMV, RoPE, KV store, paged
attention) back to back, so a decode step returns to Python once. Prefill chunks, larger batches,
other devices and dtypes take the layer-by-layer path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention import AttentionMetadata
from nanoserve.kernels import c_backend
from nanoserve.model.linear import GEMV_ROWS

if TYPE_CHECKING:
    from nanoserve.model.llama import Llama

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class CpuDecodeStep:
    def __init__(self, model: Llama) -> None:
        self.model = model
        # One row of pointers per layer; the cache pointers are filled in on first use.
        self.weights = [
            [
                t.data_ptr()
                for t in (
                    layer.input_norm,
                    layer.qkv.weight,
                    layer.o.weight,
                    layer.post_norm,
                    layer.gate_up.weight,
                    layer.down.weight,
                )
            ]
            for layer in model.layers
        ]
        self._table: tuple[KVCaches, torch.Tensor] | None = None

    @staticmethod
    def supported(model: Llama) -> bool:
        linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o)]
        linears += [lin for layer in model.layers for lin in (layer.gate_up, layer.down)]
        return c_backend.AVAILABLE and all(lin.gemv for lin in linears)

    def applies(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        decode_only = meta.num_decode == num_tokens and not meta.prefills
        return num_tokens <= GEMV_ROWS and decode_only and meta.backend in ("auto", "c")

    def __call__(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata
    ) -> None:
        """Runs every layer on h ([num_tokens, hidden], updated in place)."""
        c, k_cache = self.model.config, kv_caches[0][0]
        c_backend.decode_layers(
            h,
            self._pointers(kv_caches),
            positions,
            meta.slot_mapping,
            self.model.cos,
            self.model.sin,
            meta.decode_block_tables,
            meta.decode_context_lens,
            num_blocks=k_cache.shape[0],
            block_size=k_cache.shape[2],
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            intermediate=c.intermediate_size,
            eps=c.rms_norm_eps,
            scale=self.model.scale,
        )

    def _pointers(self, kv_caches: KVCaches) -> torch.Tensor:
        if self._table is None or self._table[0] is not kv_caches:
            rows = [
                w + [k.data_ptr(), v.data_ptr()]
                for w, (k, v) in zip(self.weights, kv_caches, strict=True)
            ]
            self._table = (kv_caches, torch.tensor(rows, dtype=torch.uint64))
        return self._table[1]
