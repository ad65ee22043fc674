"""The engine. Its whole surface: `admit`, `add_request`, `abort`, `abort_all`, `step`,
`has_unfinished`, `stats()`, `check_health`, `close`, and the fixed facts `tokenizer`,
`max_model_len`, `num_blocks`. Each step schedules a batch, runs one forward over the packed
tokens, samples, detokenizes and checks stop conditions. Single-threaded and lock-free: whoever
owns an Engine calls it from one place at a time (the offline loop, or the serving task); it owns
the scheduler, the KV cache manager, every request and the executor (parallel/executor.py), which
runs the model on one rank or on every rank of a tensor-parallel group: one KV cache manager
decides every rank's block tables. With speculative decoding (spec/ngram.py; a draft
model, engine/spec/draft_model.py, runs as the scheduler plans, in the step) a step may verify a
decode's draft: every position is sampled as if its draft prefix had been accepted, and the
samples are appended one by one, through the same checks, until one differs from the draft or
the request finishes.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.config import EngineConfig, chat_template_source
from nanoserve.engine.admission import Admission, Admitted, RequestRejected
from nanoserve.engine.kv_manager import KVCacheManager
from nanoserve.engine.memory import Pools, check_fits, gib, headroom, working_margin
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.outputs import RequestOutput, output_of
from nanoserve.engine.parallel.executor import start_executor
from nanoserve.engine.request import Request, Status
from nanoserve.engine.sampling import SampleRow, SamplingParams, mix_seed, sample
from nanoserve.engine.scheduler import Proposer, ScheduledRequest, Scheduler
from nanoserve.engine.spec.draft_model import DraftModelProposer
from nanoserve.engine.spec.ngram import NgramProposer, SpecStats
from nanoserve.engine.structured import CompiledGrammar, GrammarCompiler, mask_logits
from nanoserve.engine.thinking import thinking_of
from nanoserve.model import Checkpoint, open_checkpoint, resolve_dtype
from nanoserve.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


class SchedulerStalled(RuntimeError):
    """Requests are waiting but none can be scheduled: the engine would spin forever."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters since it started."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    num_preemptions: int
    num_recomputed_tokens: int  # positions computed again after a preemption
    num_prefix_hit_tokens: int  # prompt positions found in the prefix cache
    peak_running: int
    generation_tokens: int
    computed_tokens: int  # all positions run through the model, recomputes too
    mask_seconds: float  # spent filling and applying structured outputs' token masks
    spec_decode: SpecStats  # speculative drafts verified, their tokens, the tokens kept


class Engine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        """`model`: a Hugging Face checkpoint directory or a GGUF file."""
        checkpoint = open_checkpoint(model)
        self.config = config = resolve_dtype(config or EngineConfig(), checkpoint)
        self.model_config = checkpoint.config
        self.executor = start_executor(model, checkpoint, config)
        try:
            self._start(checkpoint)
        except BaseException:
            self.executor.close()  # no tensor-parallel worker outlives a failed start
            raise

    def _start(self, checkpoint: Checkpoint) -> None:
        """What the engine builds once its executor runs: the KV cache's manager, the proposer of
        speculative drafts, the tokenizer, the grammars and the scheduler. The KV pool is written
        meanwhile (_take_pools): a load's longest part, and one that holds no GIL."""
        config = self.config
        self.runner = self.executor.runner  # rank 0's: prepares each step, knows the pool
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, config.block_size, config.enable_prefix_caching, config.watermark
        )
        spec = config.speculative_config
        drafted = spec is not None and spec.model is not None
        if drafted:
            self._use_tokenizer(checkpoint)  # the draft's is checked against it
        self.proposer = self._proposer(checkpoint)
        draft = self.proposer.runner if isinstance(self.proposer, DraftModelProposer) else None
        self._check_pools(draft)
        # The one thread beside the engine's: it writes the KV pools (and alone calls the
        # executor) while this one builds what needs the tokenizer; both end in this block.
        # torch's inference mode is per thread: the pools were made in the caller's.
        inference = torch.is_inference_mode_enabled()
        with ThreadPoolExecutor(1, thread_name_prefix="nanoserve-take-kv") as pool:
            taken = pool.submit(self._take_pools, draft, inference)
            if not drafted:
                self._use_tokenizer(checkpoint)
            self._admission = Admission(config, self.tokenizer, self.grammars,
                                        self.model_config.vocab_size, self.max_model_len,
                                        self.num_blocks)  # fmt: skip
            taken.result()
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            proposer=self.proposer,
            max_decode_rows=self.runner.verify_rows,
        )
        self._spec = SpecStats()
        self._groups: dict[str, list[Request]] = {}
        self._seeds = random.Random(0)
        self._generated = 0
        self._computed = 0
        self._mask_s = 0.0

    def _proposer(self, checkpoint: Checkpoint) -> Proposer | None:
        """The proposer of speculative drafts, if any: a draft model, or n-grams of the text."""
        spec = self.config.speculative_config
        if spec is not None and spec.model is not None:
            return DraftModelProposer(spec.model, checkpoint, self.tokenizer, self.config,
                                      self.num_blocks, self.max_model_len)  # fmt: skip
        return NgramProposer(spec, self.max_model_len) if spec is not None else None

    def _use_tokenizer(self, checkpoint: Checkpoint) -> None:
        """The checkpoint's tokenizer (or the configured chat template over it), its end ids
        and the grammars compiled against its vocabulary, cached by constraint."""
        config, mc = self.config, self.model_config
        self.tokenizer = checkpoint.tokenizer()
        if config.chat_template is not None:  # instead of the model's own
            self.tokenizer.use_chat_template(chat_template_source(config.chat_template))
        self.eos_token_ids = set(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        self.grammars = GrammarCompiler(
            self.tokenizer, mc.vocab_size, self.eos_token_ids, config.grammar_compile_seconds
        )

    def _check_pools(self, draft: ModelRunner | None) -> None:
        """On a CPU, check that the KV pools about to be written (each rank's, a draft model's)
        and a working margin fit in what this host has left (engine/memory.py). On CUDA the pool
        was sized from the device's free memory, and its allocation is already memory."""
        if self.runner.device.type != "cpu":
            return
        pools, room = self._pools(draft), headroom()
        check_fits(self.config, pools, room)
        log.info(
            "memory: KV cache %s, weights %s, working margin %s; %s may be taken (%s)",
            *map(gib, (pools.pool, pools.weights, pools.margin, room.bytes)), room.source,
        )  # fmt: skip

    def _take_pools(self, draft: ModelRunner | None, inference: bool) -> None:
        """Write every KV pool this engine allocated, so that its memory is held from the start."""
        start = time.monotonic()
        with torch.inference_mode(inference):
            self.executor.call("take_kv_cache")
            if draft is not None:
                draft.take_kv_cache()
        log.info("KV cache written in %.1f s", time.monotonic() - start)

    def _pools(self, draft: ModelRunner | None) -> Pools:
        """The pools about to be written on this host: rank 0's and the spawned ranks' (each a
        share of the same blocks), and a draft model's, with what their weights hold."""
        ranks = 1 + len(self.executor.pids)  # ranks started by hand may be on other machines
        runner, mc = self.runner, self.model_config
        block, weights = runner.block_bytes * ranks, runner.model_bytes * ranks
        if draft is not None:
            block, weights = block + draft.block_bytes, weights + draft.model_bytes
        return Pools(
            blocks=self.num_blocks,
            block_bytes=block,
            setting_block_bytes=runner.block_bytes * self.config.tensor_parallel_size,
            margin_at=lambda context: working_margin(mc, self.config, context) * ranks,
            context=self.max_model_len,
            weights=weights,
            dtype=self.config.kv_cache_dtype,
            draft=draft is not None,
        )

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pools this engine holds on this host: every local rank's share, and a
        draft model's."""
        draft = self.proposer.runner if isinstance(self.proposer, DraftModelProposer) else None
        own = self.runner.kv_cache_bytes * (1 + len(self.executor.pids))
        return own + (draft.kv_cache_bytes if draft is not None else 0)

    def check_health(self) -> None:
        """Raise (WorkerFailed) if the engine can no longer step: a tensor-parallel worker died.
        Cheap; for an owner that idles (a step checks it anyway)."""
        self.executor.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (a stop message, then a bounded wait, then
        a kill), and the grammar checker's process. Idempotent; the engine cannot step
        afterwards."""
        self.executor.close()
        if hasattr(self, "grammars"):
            self.grammars.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the tensor-parallel workers this engine spawned (rank 1 first)."""
        return self.executor.pids

    # -- requests -----------------------------------------------------------------------------

    def admit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        grammar: CompiledGrammar | None = None,
    ) -> Admitted:
        """The request checked against the engine's fixed limits, its constraint compiled (unless
        `grammar` is), or RequestRejected naming the field. Reads fixed settings only: any thread
        may call it."""
        return self._admission.admit(prompt, params, grammar)

    def compile_constraint(self, params: SamplingParams) -> CompiledGrammar:
        """The request's constraint compiled (thread-safe, cached), or RequestRejected."""
        return self._admission.compile(params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Admitted,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request: an `Admitted` one (`admit`) as it is, or a prompt and its parameters,
        admitted first; raises RequestRejected (naming the field) if it could never run.
        `arrival_time` (time.monotonic) defaults to now; a server passes when the client asked."""
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, Admitted):
            admitted = prompt
        else:
            admitted = self.admit(prompt, params or SamplingParams())
        params, token_ids = admitted.params, admitted.token_ids
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        arrived = arrival_time if arrival_time is not None else time.monotonic()
        group = []
        for index in range(params.n):
            seed = base_seed if index == 0 else mix_seed(base_seed, -index)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.skip_special_tokens, params.stop
            )
            rid = request_id if params.n == 1 else f"{request_id}-{index}"
            request = Request(
                rid, request_id, index, token_ids, params, seed, admitted.output_limit,
                detokenizer,
            )  # fmt: skip
            request.arrival_time = arrived
            if admitted.grammar is not None:
                request.matcher = admitted.grammar.matcher.deep_copy()
            request.thinking = thinking_of(params.thinking, admitted.grammar is not None)
            group.append(request)
        self._groups[request_id] = group
        for request in group:
            self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is (waiting or running) and free its blocks."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for request in group:
            if not request.is_finished:
                self.scheduler.remove(request)
                request.finish("abort")
        return output_of(group)

    def abort_all(self) -> None:
        """Abort every request (their blocks come back)."""
        for request_id in list(self._groups):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            free_blocks=self.kv_cache_manager.num_free_blocks,
            total_blocks=self.num_blocks,
            num_preemptions=s.stats.num_preemptions,
            num_recomputed_tokens=s.stats.num_recomputed_tokens,
            num_prefix_hit_tokens=s.stats.num_prefix_hit_tokens,
            peak_running=s.stats.peak_running,
            generation_tokens=self._generated,
            computed_tokens=self._computed,
            mask_seconds=self._mask_s,
            spec_decode=SpecStats(**vars(self._spec)),
        )

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one forward for the scheduled batch; outputs of every request that moved."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise SchedulerStalled(
                    f"{len(self.scheduler.waiting)} requests wait, none can be scheduled "
                    f"({self.kv_cache_manager.num_free_blocks} of {self.num_blocks} KV blocks free)"
                )
            return []
        logits, scored = self.executor.call(
            "execute", self.runner.prepare([s.chunk() for s in batch])
        )
        for index, entries in scored.items():
            prompt_logprobs = batch[index].request.prompt_logprobs
            assert prompt_logprobs is not None
            prompt_logprobs.extend(entries)
        self.scheduler.after_step(batch)
        ready = [item for item in batch if item.samples]
        # A row per sampled position: a verification's rows come with their draft prefixes.
        rows = [
            (item.request, item.draft[:j]) for item in ready for j in range(len(item.draft) + 1)
        ]
        if any(r.matcher is not None for r, _ in rows):  # never drafted: one row each
            start = time.perf_counter()
            masks = [r.thinking.grammar(r.matcher) if r.thinking else (r.matcher, None)
                     for r, _ in rows]  # fmt: skip
            matchers, also = [m for m, _ in masks], [a for _, a in masks]
            logits = mask_logits(logits, matchers, self.grammars, also)
            self._mask_s += time.perf_counter() - start
        samples = sample(logits, [self._sample_row(r, prefix) for r, prefix in rows])
        now = time.monotonic()
        touched: dict[str, list[Request]] = {}
        first = 0
        for item in ready:
            request = item.request
            touched[request.group_id] = self._groups[request.group_id]
            item_samples = samples[first : first + len(item.draft) + 1]
            first += len(item_samples)
            if request.output_limit == 0:  # scoring only: the prompt is computed, nothing more
                request.finish("length")
            elif item.verifies:
                self._verify(item, [s.token_id for s in item_samples], item_samples, now)
            else:
                self._append(request, item_samples[0].token_id, now, item_samples[0].logprobs)
        for item in batch:
            self._computed += item.num_new_tokens
            if item.request.is_finished:
                self.scheduler.remove(item.request)
        outputs = [output_of(group) for group in touched.values()]
        for out in outputs:
            if out.finished:
                del self._groups[out.request_id]
        return outputs

    def _verify(self, item: ScheduledRequest, tokens: list[int], samples: list, now: float) -> None:
        """Append a verification's samples while the draft agrees (and the request runs): the
        first that differs from the draft, or the one after the whole draft, is the last."""
        request, draft = item.request, item.draft
        kept = 0
        for j, token in enumerate(tokens):
            self._append(request, token, now, samples[j].logprobs)
            kept += 1
            if request.is_finished or j == len(draft) or token != draft[j]:
                break
        self._spec.num_drafts += 1
        self._spec.num_draft_tokens += len(draft)
        self._spec.num_accepted_tokens += sum(
            1 for j in range(kept) if j < len(draft) and tokens[j] == draft[j]
        )
        self.scheduler.after_verify(item, kept)

    def _sample_row(self, request: Request, draft: tuple[int, ...] = ()) -> SampleRow:
        """The row of the request's next token, or of the one after `draft` were it accepted."""
        p = request.params
        position = request.num_output_tokens + len(draft)
        banned: list[int] = []
        # A constrained output ends where its grammar does: min_tokens bans nothing there.
        if position < p.min_tokens and request.matcher is None:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        output = request.output_token_ids + list(draft) if draft else request.output_token_ids
        forced = request.thinking.forced_token if request.thinking else None  # a tag's next
        return SampleRow(p, request.seed, position, request.prompt_token_ids, output, banned,
                         forced)  # fmt: skip

    def _append(
        self, request: Request, token: int, now: float, logprobs: dict | None = None
    ) -> None:
        p = request.params
        if logprobs is not None:
            request.logprobs.append(logprobs)
        request.token_ids.append(token)
        self._generated += 1
        if request.first_token_time is None:
            request.first_token_time = now
        # A deferred grammar's matcher starts after the thinking (engine/thinking.py).
        answer = request.thinking is None or request.thinking.append(token)
        if request.matcher is not None and answer:
            request.matcher.consume_token(token)  # the mask allowed it
        if token in request.stop_token_ids:
            request.finish("stop", token)
        elif token in self.eos_token_ids and not p.ignore_eos:
            request.finish("stop")
        else:
            check_stop = request.num_output_tokens >= p.min_tokens
            stop = request.detokenizer.append(token, check_stop)
            if stop is not None:
                request.finish("stop", stop)
        if request.is_finished:
            return
        if request.matcher is not None and request.matcher.is_stopped():
            request.finish("stop")  # the grammar is complete: nothing may follow
        elif (
            request.num_output_tokens >= request.output_limit
            or request.num_tokens >= self.max_model_len
        ):
            request.finish("length")

    # -- checks -------------------------------------------------------------------------------

    def audit(self) -> None:
        """Raise if the block ledger disagrees with the live requests' block tables, or if a
        rank's cache does not have the blocks the ledger hands out (tensor parallelism: the one
        KV cache manager decides every rank's tables)."""
        live = [r for group in self._groups.values() for r in group if r.status is Status.RUNNING]
        self.kv_cache_manager.audit(live)
        blocks = self.cache_blocks()
        if any(b != self.num_blocks for b in blocks):
            raise AssertionError(
                f"KV blocks per rank {blocks}; the KV cache manager has {self.num_blocks}"
            )

    def cache_blocks(self) -> list[int]:
        """KV blocks in each rank's cache, rank 0 first (-1: a rank whose layers disagree).
        Under tensor parallelism a collective with every worker: call it between steps."""
        return self.executor.gather("cache_blocks")
