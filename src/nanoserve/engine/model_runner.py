"""Runs the model for the engine: owns the model (loaded by nanoserve.model, which decides where
the weights live and in what format), the KV cache tensors and the CUDA graphs of decode steps.
Packs each scheduled batch into tensors (`prepare`, engine/inputs.py) and runs them (`execute`),
which composes the model's pieces and takes a fast path by a plain `if`: a CPU decode step of up
to 4 rows in one C call, a CUDA decode step replayed from its graph. Returns the logits of the
rows that sample. On CUDA the pool is sized from free memory after a warm-up forward through the
same path; on a CPU from kv_cache_memory_gb, allocated unwritten, then written (`take_kv_cache`)
once the engine has checked that it fits (engine/memory.py).
Under tensor parallelism every rank has a runner holding its slices and its heads' cache, and runs
the same `execute` on the inputs rank 0 prepared (parallel/executor.py); only rank 0's results mean
anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from nanoserve.config import DEFAULT_KV_CACHE_GB, EngineConfig
from nanoserve.engine.cuda_graphs import DecodeGraphs
from nanoserve.engine.inputs import Chunk, PromptScoring, StepInputs, pack
from nanoserve.engine.kv_cache import allocate_cache, block_bytes, cdiv, take_cache
from nanoserve.engine.memory import (
    check_weights_fit,
    headroom,
    keep_freed_memory,
    working_margin,
)
from nanoserve.engine.sampling import Logprob, token_logprobs
from nanoserve.model import (
    SINGLE,
    Checkpoint,
    CpuDecodeStep,
    KVCaches,
    Parallel,
    decode_step,
    held_bytes,
    invariant_rows,
    load_model,
    weight_bytes,
)

log = logging.getLogger(__name__)
TokenLogprobs = dict[int, Logprob]
StepOutput = tuple[torch.Tensor, dict[int, list[TokenLogprobs]]]  # logits, prompt logprobs
SCORING_ROWS = 256  # prompt positions scored at a time (each makes a row of vocabulary logits)


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        config: EngineConfig,
        parallel: Parallel = SINGLE,
        device: torch.device | None = None,
    ):
        """`parallel`: this process's rank in a tensor-parallel group, whose every rank builds its
        runner at the same time (the pool size is agreed on by a collective); `device`: this
        rank's (default: config.device)."""
        self.config = config
        self.parallel = parallel
        self.device = device or torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        mc = checkpoint.config
        on_cuda = self.device.type == "cuda"
        self._baseline = torch.cuda.memory_allocated(self.device) if on_cuda else 0
        positions = config.max_model_len or mc.max_position_embeddings
        if self.device.type == "cpu":  # host memory: refused before a byte is read
            check_weights_fit(checkpoint.path, weight_bytes(checkpoint, config, parallel),
                              headroom())  # fmt: skip
        self.model = load_model(checkpoint, config, self.device, parallel, positions)
        self.model_bytes = held_bytes(self.model)  # weights, packed copies, RoPE tables
        self._positions = positions
        self.cpu_step: CpuDecodeStep | None = decode_step(self.model, self.device, parallel)
        self.block_bytes = block_bytes(
            mc.num_layers, self.model.num_kv_heads, mc.head_dim, config.block_size,
            config.kv_torch_dtype,
        )  # fmt: skip
        self.num_blocks = parallel.min(config.num_kv_blocks or self._pool_size(), self.device)
        self.kv_caches = self._cache(self.num_blocks)
        self.max_model_len = config.max_model_len or min(
            positions, self.num_blocks * config.block_size
        )
        if self.device.type == "cpu":  # a step's activations reused, not faulted in again
            keep_freed_memory(working_margin(mc, config, self.max_model_len))
        # On CUDA every decode step takes the padded path, replayed from graphs when captured;
        # not under tensor parallelism (a graph would have to capture the collectives on every
        # rank at once), where each step runs eagerly.
        self.graphs: DecodeGraphs | None = None
        if on_cuda and parallel.size == 1:
            self.graphs = DecodeGraphs(config, self.max_model_len, self.device)
            if config.cuda_graphs and mc.moe:  # its grouping by expert reads counts on the host
                log.info("cuda_graphs: off for a mixture of experts (decode steps run eagerly)")
            elif config.cuda_graphs:
                self._capture(self.graphs)

    def prepare(self, batch: Sequence[Chunk]) -> StepInputs:
        """The tensors of a scheduled batch's forward pass; a decode batch that CUDA graphs take
        comes padded to the next captured size. Rank 0 prepares each step (the other ranks of a
        tensor-parallel group receive what it prepared)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.pack(batch)
        return self._pack(batch)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepOutput:
        """One forward pass of packed inputs: what every rank of a tensor-parallel group runs.
        Logits [rows that sample, vocab] (float32; padding rows dropped) and the prompt logprobs
        of the chunks that score their prompt (by index in the batch). Only rank 0's results
        mean anything (whole logits, prompt logprobs)."""
        n = inputs.logits_rows.shape[0]
        if inputs.scoring is not None:
            rows = torch.cat([inputs.logits_rows, inputs.scoring.rows])
            h = self._hidden(inputs, rows, self.kv_caches)
            logits, scored = self.model.logits(h[:n]), self._score(h[n:], inputs.scoring)
        elif self.graphs is not None and self.graphs.has(inputs):
            logits, scored = self.graphs.replay(inputs), {}
        else:
            logits, scored = self._forward(inputs), {}
        return logits[: n - inputs.padding], scored

    def _score(self, h: torch.Tensor, scoring: PromptScoring) -> dict[int, list[TokenLogprobs]]:
        """Prompt logprobs, made from SCORING_ROWS rows of vocabulary-wide logits at a time so
        that a long prompt never holds [prompt length, vocab] floats at once. Ranks other than 0
        take part in each chunk's logits and keep nothing (they have no targets)."""
        targets = [t for _, _, chunk_targets, _ in scoring.chunks for t in chunk_targets]
        top_n = [n for _, _, chunk_targets, n in scoring.chunks for _ in chunk_targets]
        entries: list[TokenLogprobs] = []
        for a in range(0, h.shape[0], SCORING_ROWS):
            logits = self.model.logits(h[a : a + SCORING_ROWS])
            if self.parallel.first:
                tokens = torch.tensor(targets[a : a + SCORING_ROWS], device=h.device)
                entries += token_logprobs(logits, tokens, top_n[a : a + SCORING_ROWS])
        return {
            index: entries[first : first + len(chunk_targets)]
            for index, first, chunk_targets, _ in scoring.chunks
        }

    @property
    def invariant_rows(self) -> int | None:
        """The most decode rows of a step whose each row's logits do not depend on the others',
        so that a speculative verification's rows are bitwise one-token decode steps (the
        one-call C step and the layer-by-layer path agree bitwise, so the path does not matter
        either): the model's (nanoserve.model.invariant_rows)."""
        return invariant_rows(self.model, self.device)

    @property
    def verify_rows(self) -> int | None:
        """The most decode rows of a step that verifies drafts: the invariant rows, and no more
        than the one-call C step takes where it runs (past it, the layer-by-layer path costs
        more than drafts save, and every decode of a large batch would be given one)."""
        rows = self.invariant_rows
        if self.cpu_step is not None:
            rows = min(rows or self.cpu_step.max_rows, self.cpu_step.max_rows)
        return rows

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache tensors."""
        return sum(t.nbytes for pair in self.kv_caches for t in pair)

    def take_kv_cache(self) -> None:
        """Write every page of the KV cache, so that it is held from now on (engine/memory.py
        checked first that it fits)."""
        take_cache(self.kv_caches)

    def cache_blocks(self) -> int:
        """Blocks in this rank's KV cache (-1 if its layers' tensors disagree)."""
        counts = {t.shape[0] for pair in self.kv_caches for t in pair}
        return counts.pop() if len(counts) == 1 else -1

    def _pack(self, batch: Sequence[Chunk]) -> StepInputs:
        return pack(batch, self.config.block_size, self.device, self.config.attention_backend)

    def _forward(self, inputs: StepInputs, kv_caches: KVCaches | None = None) -> torch.Tensor:
        caches = self.kv_caches if kv_caches is None else kv_caches
        rows = inputs.logits_rows
        # Increasing rows, as many as the tokens: every row (a decode step's), in order.
        every = rows.shape[0] == inputs.input_ids.shape[0]
        return self.model.logits(self._hidden(inputs, None if every else rows, caches))

    def _hidden(
        self, inputs: StepInputs, rows: torch.Tensor | None, kv_caches: KVCaches
    ) -> torch.Tensor:
        """The final (normed) hidden states [len(rows), hidden] of the given packed rows (None:
        every row): every layer in one C call where the CPU step applies, else layer by layer."""
        m, positions, meta = self.model, inputs.positions, inputs.meta
        h = m.embed(inputs.input_ids)  # [num_tokens, hidden], a copy
        if self.cpu_step is not None and self.cpu_step.applies(positions, meta):
            self.cpu_step(h, positions, kv_caches, meta, m.cos, m.sin, m.local)  # h in place
        else:
            h = m.layers(h, positions, kv_caches, meta)
        return m.norm(h if rows is None else h[rows])

    def _capture(self, graphs: DecodeGraphs) -> None:
        """Record one graph of a padded decode step per batch size, largest first, sharing one
        memory pool; each replays this runner's forward pass on the graphs' static buffers."""
        pool = None
        for size in reversed(graphs.sizes):
            inputs = graphs.rows(size)
            self._forward(inputs)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(inputs)
            pool = graph.pool()
            graphs.add(size, graph, logits)

    def _cache(self, num_blocks: int) -> KVCaches:
        mc, c = self.model.config, self.config
        return allocate_cache(
            mc.num_layers, num_blocks, self.model.num_kv_heads, c.block_size, mc.head_dim,
            c.kv_torch_dtype, self.device,
        )  # fmt: skip

    def _pool_size(self) -> int:
        if self.device.type == "cuda":
            return self._profile_cuda()
        # kv_cache_memory_gb is the whole cache's, all ranks' (one host's memory): the same pool
        # as one process, each rank holding its heads' share of every block.
        whole_block = self.block_bytes * self.parallel.size
        if self.config.kv_cache_memory_gb is not None:
            return int(self.config.kv_cache_memory_gb * 2**30 // whole_block)
        full = self.config.max_num_seqs * cdiv(self._positions, self.config.block_size)
        return min(int(DEFAULT_KV_CACHE_GB * 2**30 // whole_block), full)

    @torch.inference_mode()
    def _profile_cuda(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the device after the weights and the
        activations of the largest step, measured by running that step: prefills of
        max_num_batched_tokens tokens in all into a cache of just the blocks they need, each no
        longer than the model's positions (its RoPE table)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        dummies = largest_step(
            self.config.max_num_batched_tokens, self._positions, self.config.block_size
        )
        caches = self._cache(dummies[-1].block_table[-1] + 1)
        self._forward(self._pack(dummies), caches)
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


def largest_step(tokens: int, positions: int, block_size: int) -> list[Chunk]:
    """Prompts of dummy tokens, `tokens` in all, none longer than `positions`, each in blocks of
    its own (numbered from 0): the largest prefill step an engine can be given."""
    longest = positions // block_size * block_size or positions
    dummies, used, blocks = [], 0, 0
    while used < tokens:
        n = min(longest, tokens - used)
        dummies.append(Chunk([0] * n, 0, n, list(range(blocks, blocks + cdiv(n, block_size)))))
        used, blocks = used + n, blocks + cdiv(n, block_size)
    return dummies
