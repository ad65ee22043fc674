"""Runs the model for the engine: owns the weights on their device, the KV cache tensors, and the
CUDA graphs of decode steps. Turns a scheduled batch into packed input tensors and returns the
logits of the rows that sample. On CUDA the pool is sized from free memory after a warm-up forward.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.attention import AttentionMetadata, PrefillChunk
from nanoserve.config import EngineConfig, ModelConfig
from nanoserve.cuda_graphs import DecodeGraphs
from nanoserve.kv_cache import allocate_cache, block_bytes
from nanoserve.loader import load_weights
from nanoserve.model.llama import Llama
from nanoserve.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, model_dir: str | Path, model_config: ModelConfig, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        mc = model_config
        self._baseline = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        positions = config.max_model_len or mc.max_position_embeddings
        weights = load_weights(model_dir, config.torch_dtype, self.device)
        self.model = Llama(mc, weights, positions)
        self.block_bytes = block_bytes(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, config.torch_dtype
        )
        self.num_blocks = config.num_kv_blocks or self._pool_size()
        self.kv_caches = allocate_cache(
            mc.num_layers,
            self.num_blocks,
            mc.num_kv_heads,
            config.block_size,
            mc.head_dim,
            config.torch_dtype,
            self.device,
        )
        pool_tokens = self.num_blocks * config.block_size
        self.max_model_len = config.max_model_len or min(positions, pool_tokens)
        # On CUDA every decode step takes the padded path, replayed from graphs when captured.
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config, self.max_model_len)
            if config.cuda_graphs:
                self.graphs.capture()

    def _pool_size(self) -> int:
        if self.device.type != "cuda":
            return int(self.config.kv_cache_memory_gb * 2**30 // self.block_bytes)
        return self._profile_cuda()

    def _profile_cuda(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the device after the weights and the
        activations of the largest step (measured with a warm-up forward)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.config.max_num_batched_tokens
        bs = self.config.block_size
        mc = self.model.config
        caches = allocate_cache(
            mc.num_layers,
            -(-tokens // bs),
            mc.num_kv_heads,
            bs,
            mc.head_dim,
            self.config.torch_dtype,
            self.device,
        )
        table = torch.arange(-(-tokens // bs), dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, device=self.device),
            num_decode=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=self.device),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=self.device),
            prefills=(PrefillChunk(0, tokens, tokens, table),),
            backend=self.config.attention_backend,
        )
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        rows = torch.tensor([tokens - 1], device=self.device)
        with torch.inference_mode():
            self.model.forward(ids, torch.arange(tokens, device=self.device), caches, meta, rows)
        torch.cuda.synchronize()
        # This engine's weights and activations, without the warm-up cache or other engines.
        peak = torch.cuda.max_memory_allocated(self.device) - self._baseline
        peak -= sum(k.numel() * k.element_size() * 2 for k, _ in caches)
        del caches
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = min(total * self.config.gpu_memory_utilization - peak, free * 0.95)
        if budget < self.block_bytes:
            raise ValueError(
                f"no room for the KV cache: {peak / 2**30:.1f} GiB used by weights and activations "
                f"of {total / 2**30:.1f} GiB (gpu_memory_utilization "
                f"{self.config.gpu_memory_utilization})"
            )
        return int(budget // self.block_bytes)

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Logits [rows that sample, vocab] (float32) for a batch ordered decodes first."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        return self._eager(batch)

    def _eager(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for item in batch:
            r, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
            row = len(input_ids)
            input_ids += r.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [r.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if start + n == r.num_tokens:
                logits_rows.append(row + n - 1)
            if n == 1:
                decode_tables.append(r.block_table)
                decode_lens.append(start + 1)
            else:
                table = self._tensor(r.block_table, torch.int32)
                prefills.append(PrefillChunk(row, n, start + n, table))
        width = max((len(t) for t in decode_tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in decode_tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode=len(decode_tables),
            decode_block_tables=self._tensor(tables, torch.int32).reshape(len(tables), width),
            decode_context_lens=self._tensor(decode_lens, torch.int32),
            prefills=tuple(prefills),
            backend=self.config.attention_backend,
        )
        return self.model.forward(
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            self.kv_caches,
            meta,
            self._tensor(logits_rows, torch.int64),
        )

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
