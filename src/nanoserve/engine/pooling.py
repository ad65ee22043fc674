"""The pooling engine: embedding models, cross-encoders and decoder rerankers (vLLM's pooling
runner). The same surface as the Engine's where the serving task drives it (`add_request`,
`abort`, `abort_all`, `step`, `has_unfinished`, `stats()`, `check_health`, `close`), with its own
admission (`admit`: token ids; `admit_text`: a text with its sentence-transformers prompt;
`admit_pair`: a cross-encoder's pair) and outputs (`PoolingOutput`: a vector, or a classifier's
scores). Each step runs every waiting input that fits the token budget (max_num_batched_tokens,
max_num_seqs rows) through one forward over the packed sequences and finishes them all: nothing
is kept after a step. A BERT encoder needs no KV cache at all; a decoder (`--convert embed`, a
reranker) runs its prefill path over a scratch cache made for the step and dropped with it,
never the paged pool. Single-threaded like the Engine: its owner calls it from one place at a
time. Owns the model and the waiting inputs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanoserve.config import EngineConfig, SettingError
from nanoserve.engine.admission import RequestRejected
from nanoserve.engine.engine import EngineStats
from nanoserve.engine.inputs import Chunk, pack
from nanoserve.engine.kv_cache import allocate_cache, cdiv
from nanoserve.engine.spec.ngram import SpecStats
from nanoserve.model import (
    GGUF_RANK,
    SINGLE,
    Bert,
    DecoderEmbeddingCheckpoint,
    GGUFBert,
    GGUFCheckpoint,
    Llama,
    classifier_head,
    gguf_classifier_head,
    gguf_kind,
    gguf_pooling,
    is_encoder,
    is_sequence_classifier,
    load_model,
    pool,
    read_pooling,
    resolve_dtype,
)
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolingInput:
    """An admitted input: its token ids and, for a cross-encoder's pair, its token types."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class PoolingOutput:
    """A finished input: its vector (normalized where the checkpoint says so), or a
    cross-encoder's scores (one per label, after its activation)."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[float]
    arrival_time: float
    finished_time: float
    finished: bool = True


@dataclass
class _Waiting:
    request_id: str
    input: PoolingInput
    arrival_time: float


def runs_pooling(model: str | Path, config: EngineConfig) -> bool:
    """Whether `model` is served by the pooling engine: an encoder or a classifier (a decoder
    with a classification head, or the original Qwen3-Reranker under hf_overrides), unless
    --runner generate (refused); a GGUF whose metadata names its pooling (unless --runner
    generate: a decoder can generate too); or any model under --runner pooling or --convert
    embed."""
    file, is_dir = Path(model).is_file(), Path(model).is_dir()
    arch, pooling_type = gguf_kind(model) if file else (None, None)  # a GGUF's header read once
    encoder = arch == "bert" or (is_dir and (is_encoder(model) or is_sequence_classifier(model)))
    encoder = encoder or pooling_type == GGUF_RANK  # a reranker's file, whose LM head is gone
    if config.hf_overrides is not None:
        encoder = True
    pools = pooling_type is not None
    if encoder and config.runner == "generate":
        raise SettingError("runner", "generate", "auto or pooling for an encoder (BERT) or "
                           "a classifier (a reranker)")  # fmt: skip
    if config.convert == "embed" and config.runner == "generate":
        raise SettingError("convert", "embed", "none or auto with --runner generate")
    if not (encoder or pools) and config.runner == "pooling" and config.convert == "none":
        raise SettingError("convert", "none", "auto or embed for a decoder under --runner "
                           "pooling (its hidden states become the embeddings)")  # fmt: skip
    declared = pools and config.runner != "generate"
    return encoder or declared or config.runner == "pooling" or config.convert == "embed"


class PoolingEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        """`model`: a Hugging Face directory or a GGUF file: a BERT encoder, or a decoder used
        for its hidden states (last-token pooling by default)."""
        config = config or EngineConfig()
        if config.tensor_parallel_size != 1 or config.device != "cpu":
            raise SettingError("runner", "pooling", "served on a CPU in one process")
        if config.speculative_config is not None:
            raise SettingError("speculative_config", config.speculative_config,
                               "off for a pooling model (it generates nothing)")  # fmt: skip
        path = Path(model)
        if not path.exists():
            raise ValueError(f"{model}: the pooling runner takes Hugging Face directories and "
                             "GGUF files, and there is neither")  # fmt: skip
        self.encoder: Bert | None = None
        self.decoder: Llama | None = None
        self.head: torch.Tensor | None = None  # a decoder's classification head, if any
        self.tokenizer: Tokenizer
        positions = (
            self._load_encoder(path, config)
            if is_encoder(path)
            else self._load_decoder(path, config)
        )
        limits = [positions, config.max_model_len, self.pooling.max_seq_length]
        self.max_model_len = min(n for n in limits if n)
        self.num_blocks = 0  # no KV pool
        self.kv_cache_bytes = 0
        self._waiting: deque[_Waiting] = deque()
        self._computed = 0
        self._peak = 0

    def _load_encoder(self, path: Path, config: EngineConfig) -> int:
        """A BERT encoder (float32 for dtype auto); its positions."""
        if config.hf_overrides is not None:
            raise SettingError("hf_overrides", config.hf_overrides,
                               "absent for an encoder (BERT)")  # fmt: skip
        if config.quantization not in ("auto", "none"):
            raise SettingError("quantization", config.quantization,
                               "auto or none for an encoder (floats only)")  # fmt: skip
        dtype = "float32" if config.dtype == "auto" else config.dtype
        self.config = replace(config, dtype=dtype, kv_cache_dtype=dtype)
        if path.is_file():
            gguf = GGUFBert(path)
            weights = gguf.read_tensors(self.config.torch_dtype)
            self.encoder = encoder = Bert(gguf.config, weights, path.name)
            self.tokenizer = gguf.tokenizer()
            self.pooling = gguf_pooling(gguf.meta, "cls", path.name)
        else:
            self.encoder = encoder = Bert.from_dir(path, self.config.torch_dtype)
            self.tokenizer = Tokenizer.from_dir(path)
            self.pooling = read_pooling(path, "cls")
        self.vocab_size = encoder.config.vocab_size
        self.classifies = encoder.classifier is not None
        self.num_labels = encoder.config.num_labels
        self.dimension = encoder.config.hidden_size
        return encoder.config.max_position_embeddings

    def _load_decoder(self, path: Path, config: EngineConfig) -> int:
        """A decoder for its hidden states, or with a classification head (a directory's), dtype
        auto as for generation; its positions."""
        checkpoint: GGUFCheckpoint | DecoderEmbeddingCheckpoint
        if path.is_file():
            if config.hf_overrides is not None:
                raise SettingError("hf_overrides", config.hf_overrides,
                                   "absent for a GGUF file")  # fmt: skip
            checkpoint = GGUFCheckpoint(path)
            self.pooling = gguf_pooling(checkpoint.meta, "lasttoken", path.name, ranks=True)
            self.head = gguf_classifier_head(checkpoint)
        else:
            checkpoint = DecoderEmbeddingCheckpoint(path)
            self.pooling = read_pooling(path, "lasttoken")
        self.tokenizer = checkpoint.tokenizer()
        if not path.is_file():
            self.head = classifier_head(path, config.hf_overrides, self.tokenizer)
        self.config = resolve_dtype(config, checkpoint)
        positions = config.max_model_len or checkpoint.config.max_position_embeddings
        self.decoder = load_model(checkpoint, self.config, torch.device("cpu"), SINGLE, positions)
        self.vocab_size = checkpoint.config.vocab_size
        self.classifies = self.head is not None
        self.num_labels = 0 if self.head is None else self.head.shape[0]
        self.dimension = checkpoint.config.hidden_size
        return positions

    # -- requests -----------------------------------------------------------------------------

    def admit(self, token_ids: list[int], field: str, truncate: int | None = None) -> PoolingInput:
        """An input's token ids checked (RequestRejected naming `field`): not empty, in the
        vocabulary, within the context; `truncate` keeps its last tokens instead (vLLM's
        truncate_prompt_tokens; -1: the context)."""
        keep = self._keep(truncate)
        if keep is not None:
            token_ids = token_ids[-keep:]
        self._check(token_ids, field)
        return PoolingInput(token_ids)

    def admit_text(
        self, text: str, field: str, truncate: int | None = None, prompt_name: str | None = None,
        add_special_tokens: bool = True,
    ) -> PoolingInput:  # fmt: skip
        """A text encoded as sentence-transformers encodes it (`prompt_name`'s prompt, else the
        default one, first; lower-cased where the checkpoint says), then admitted."""
        text = self._prompt(prompt_name) + text
        text = text.lower() if self.pooling.lower_case else text
        return self.admit(self.tokenizer.encode(text, add_special_tokens), field, truncate)

    def _prompt(self, name: str | None) -> str:
        if name is None:
            return self.pooling.default_prompt
        if name not in self.pooling.prompts:
            known = ", ".join(self.pooling.prompts) or "none"
            raise RequestRejected(f"prompt_name {name!r} is not one of this model's prompts "
                                  f"({known})", "prompt_name")  # fmt: skip
        return self.pooling.prompts[name]

    def _keep(self, truncate: int | None) -> int | None:
        """The tokens truncate_prompt_tokens keeps (-1: the context), or None."""
        if truncate is None:
            return None
        return self.max_model_len if truncate == -1 else min(truncate, self.max_model_len)

    def admit_pair(
        self, first: str, second: str, field: str, truncate: int | None = None
    ) -> PoolingInput:
        """A cross-encoder's pair, encoded as the tokenizer encodes pairs (token types 0, 1; a
        decoder's: one after the other), the default prompt first, lower-cased where the
        checkpoint says; `truncate` keeps the first tokens (the query and what fits of the
        document, then the final token: transformers' longest_first truncation of a short
        query)."""
        first = self.pooling.default_prompt + first
        if self.pooling.lower_case:
            first, second = first.lower(), second.lower()
        ids, types = self.tokenizer.encode_pair(first, second)
        keep = self._keep(truncate)
        if keep is not None and len(ids) > keep:
            ids, types = ids[: keep - 1] + ids[-1:], types[: keep - 1] + types[-1:]
        self._check(ids, field)
        if self.encoder is not None and max(types) >= self.encoder.config.type_vocab_size:
            raise RequestRejected(f"{field}: this model has {self.encoder.config.type_vocab_size}"
                                  " token type(s); a pair needs 2", field)  # fmt: skip
        return PoolingInput(ids, types)

    def _check(self, token_ids: list[int], field: str) -> None:
        if not token_ids:
            raise RequestRejected(f"{field} is empty", field)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"{field}: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", field)  # fmt: skip
        if len(token_ids) > self.max_model_len:
            raise RequestRejected(
                f"{field} has {len(token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens (max_model_len); truncate_prompt_tokens truncates",
                field,
            )

    def add_request(
        self, request_id: str, prompt: PoolingInput, arrival_time: float | None = None
    ) -> None:
        arrived = arrival_time if arrival_time is not None else time.monotonic()
        self._waiting.append(_Waiting(request_id, prompt, arrived))

    def abort(self, request_id: str) -> PoolingInput | None:
        """Drop a waiting input (every step finishes what it ran, so only waiting ones are)."""
        for waiting in self._waiting:
            if waiting.request_id == request_id:
                self._waiting.remove(waiting)
                return waiting.input
        return None

    def abort_all(self) -> None:
        self._waiting.clear()

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def check_health(self) -> None:
        """One process, nothing to lose: always healthy."""

    def close(self) -> None:
        """Nothing to stop."""

    def stats(self) -> EngineStats:
        return EngineStats(
            running=0, waiting=len(self._waiting), free_blocks=0, total_blocks=0,
            num_preemptions=0, num_recomputed_tokens=0, num_prefix_hit_tokens=0,
            peak_running=self._peak, generation_tokens=0, computed_tokens=self._computed,
            mask_seconds=0.0, spec_decode=SpecStats(),
        )  # fmt: skip

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[PoolingOutput]:
        """Pool the waiting inputs that fit the step's budget, oldest first (at least one)."""
        batch = self._schedule()
        if not batch:
            return []
        inputs = [w.input for w in batch]
        vectors = self._forward(inputs)
        now = time.monotonic()
        self._computed += sum(len(i.token_ids) for i in inputs)
        self._peak = max(self._peak, len(batch))
        return [
            PoolingOutput(w.request_id, list(w.input.token_ids), v, w.arrival_time, now)
            for w, v in zip(batch, vectors.tolist(), strict=True)
        ]

    def _schedule(self) -> list[_Waiting]:
        c, batch, tokens = self.config, list[_Waiting](), 0
        while self._waiting and len(batch) < c.max_num_seqs:
            n = len(self._waiting[0].input.token_ids)
            if batch and tokens + n > c.max_num_batched_tokens:
                break
            batch.append(self._waiting.popleft())
            tokens += n
        return batch

    def _forward(self, inputs: list[PoolingInput]) -> torch.Tensor:
        """[len(inputs), dim] float32: the pooled vectors, or the classifier's scores."""
        lengths = [len(i.token_ids) for i in inputs]
        if self.encoder is not None:
            ids = torch.tensor([t for i in inputs for t in i.token_ids])
            types = torch.tensor(
                [t for i in inputs for t in i.token_type_ids or [0] * len(i.token_ids)]
            )
            h = self.encoder.forward(ids, types, lengths)
            if self.classifies:
                starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
                return self._activate(self.encoder.classify(h[starts]))
        else:
            h = self._decoder_hidden(inputs)
            if self.head is not None:  # the last token's state, as transformers' classifier
                ends = torch.tensor(lengths).cumsum(0) - 1
                return self._activate(h[ends].float() @ self.head.T)
        return pool(h, lengths, self.pooling)

    def _activate(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits) if self.pooling.activation == "sigmoid" else logits

    def _decoder_hidden(self, inputs: list[PoolingInput]) -> torch.Tensor:
        """The decoder's final (normed) hidden states of the packed inputs, through its prefill
        path over a scratch cache of just the blocks this step fills, dropped after it. One-token
        inputs are packed as decodes, which the packer puts first: rows come back in order."""
        assert self.decoder is not None
        m, c, bs = self.decoder, self.config, self.config.block_size
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].token_ids) > 1)
        chunks, blocks = [], 0
        for i in order:
            ids = inputs[i].token_ids
            used = cdiv(len(ids), bs)
            chunks.append(Chunk(ids, 0, len(ids), list(range(blocks, blocks + used))))
            blocks += used
        step = pack(chunks, bs, torch.device("cpu"), c.attention_backend)
        caches = allocate_cache(m.config.num_layers, blocks, m.num_kv_heads, bs,
                                m.config.head_dim, c.kv_torch_dtype, "cpu")  # fmt: skip
        h = m.norm(m.layers(m.embed(step.input_ids), step.positions, caches, step.meta))
        rows, start = {}, 0
        for i in order:
            n = len(inputs[i].token_ids)
            rows[i] = h[start : start + n]
            start += n
        return torch.cat([rows[i] for i in range(len(inputs))])
