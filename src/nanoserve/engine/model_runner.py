"""Runs the model for the engine: owns the weights on their device, the KV cache tensors and the
CUDA graphs of decode steps. Chooses where the weights live (CPU: one huge-page mapping) and the
fast path (CPU: the one-call C decode step), packs each scheduled batch into tensors (engine/
inputs.py) and returns the logits of the rows that sample. On CUDA the pool is sized from free
memory after a warm-up forward through the same path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.cuda_graphs import DecodeGraphs
from nanoserve.engine.inputs import Chunk, PromptScoring, StepInputs, pack
from nanoserve.engine.kv_cache import allocate_cache, block_bytes, cdiv
from nanoserve.engine.sampling import Logprob, token_logprobs
from nanoserve.model import hugepages
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.cpu_step import CpuDecodeStep
from nanoserve.model.llama import KVCaches, Llama
from nanoserve.model.loader import load_weights

TokenLogprobs = dict[int, Logprob]
SCORING_ROWS = 256  # prompt positions scored at a time (each makes a row of vocabulary logits)


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        mc = checkpoint.config
        self._baseline = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        positions = config.max_model_len or mc.max_position_embeddings
        on_cpu = self.device.type == "cpu"
        raw = checkpoint.read_tensors(config.torch_dtype, self.device)
        weights = load_weights(raw, mc, hugepages.pack if on_cpu else None)
        self.model = Llama(mc, weights, positions)
        if on_cpu and CpuDecodeStep.supported(weights.layers):
            self.model.fast_decode = CpuDecodeStep(weights.layers, mc)
        self.block_bytes = block_bytes(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, config.torch_dtype
        )
        self.num_blocks = config.num_kv_blocks or self._pool_size()
        self.kv_caches = self._cache(self.num_blocks)
        self.max_model_len = config.max_model_len or min(
            positions, self.num_blocks * config.block_size
        )
        # On CUDA every decode step takes the padded path, replayed from graphs when captured.
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda":
            self.graphs = DecodeGraphs(self._forward, config, self.max_model_len, self.device)
            if config.cuda_graphs:
                self.graphs.capture()

    @torch.inference_mode()
    def forward(
        self, batch: Sequence[Chunk]
    ) -> tuple[torch.Tensor, dict[int, list[TokenLogprobs]]]:
        """Logits [rows that sample, vocab] (float32) for a batch ordered decodes first, and the
        prompt logprobs of the chunks that score their prompt (by index in the batch)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch), {}
        inputs = self._pack(batch)
        if inputs.scoring is None:
            return self._forward(inputs), {}
        rows = torch.cat([inputs.logits_rows, inputs.scoring.rows])
        h = self.model.hidden(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, rows)
        n = inputs.logits_rows.shape[0]
        return self.model.logits(h[:n]), self._score(h[n:], inputs.scoring)

    def _score(self, h: torch.Tensor, scoring: PromptScoring) -> dict[int, list[TokenLogprobs]]:
        """Prompt logprobs, made from SCORING_ROWS rows of vocabulary-wide logits at a time so
        that a long prompt never holds [prompt length, vocab] floats at once."""
        targets = [t for _, _, chunk_targets, _ in scoring.chunks for t in chunk_targets]
        top_n = [n for _, _, chunk_targets, n in scoring.chunks for _ in chunk_targets]
        entries: list[TokenLogprobs] = []
        for a in range(0, len(targets), SCORING_ROWS):
            tokens = torch.tensor(targets[a : a + SCORING_ROWS], device=h.device)
            logits = self.model.logits(h[a : a + SCORING_ROWS])
            entries += token_logprobs(logits, tokens, top_n[a : a + SCORING_ROWS])
        return {
            index: entries[first : first + len(chunk_targets)]
            for index, first, chunk_targets, _ in scoring.chunks
        }

    def _pack(self, batch: Sequence[Chunk]) -> StepInputs:
        return pack(batch, self.config.block_size, self.device, self.config.attention_backend)

    def _forward(self, inputs: StepInputs, kv_caches: KVCaches | None = None) -> torch.Tensor:
        return self.model.forward(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches if kv_caches is None else kv_caches,
            inputs.meta,
            inputs.logits_rows,
        )

    def _cache(self, num_blocks: int) -> KVCaches:
        mc, c = self.model.config, self.config
        return allocate_cache(
            mc.num_layers, num_blocks, mc.num_kv_heads, c.block_size, mc.head_dim,
            c.torch_dtype, self.device,
        )  # fmt: skip

    def _pool_size(self) -> int:
        if self.device.type != "cuda":
            return int(self.config.kv_cache_memory_gb * 2**30 // self.block_bytes)
        return self._profile_cuda()

    @torch.inference_mode()
    def _profile_cuda(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the device after the weights and the
        activations of the largest step, measured by running that step: one prefill of
        max_num_batched_tokens tokens into a cache of just the blocks it needs."""
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens, bs = self.config.max_num_batched_tokens, self.config.block_size
        dummy = _Prefill([0] * tokens, list(range(cdiv(tokens, bs))))
        caches = self._cache(len(dummy.block_table))
        self._forward(self._pack([dummy]), caches)
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


@dataclass
class _Prefill:
    """A whole prompt of dummy tokens, as the packer sees a scheduled request."""

    token_ids: list[int]
    block_table: list[int]
    start: int = 0
    samples: bool = True
    prompt_logprob_positions: range = range(0)
    prompt_logprobs: int = 0
    num_new_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_new_tokens = len(self.token_ids)
