"""The offline API, in vLLM's shape: `LLM(model=DIR, ...).generate(prompts, sampling_params)`;
for a pooling model (an embedding model, a cross-encoder or reranker) `embed(texts)` and
`score(texts_1, texts_2)` with vLLM's return shapes, simplified. Owns one engine (an Engine, or a
PoolingEngine where the model is served by one) and drives it until every prompt is answered;
`close()` (or a `with` block) stops the engine's tensor-parallel workers, if it has any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine import (
    Engine,
    PoolingEngine,
    PoolingInput,
    RequestOutput,
    SamplingParams,
    runs_pooling,
)

Prompt = str | dict[str, Any]


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    """vLLM's: one input's vector (normalized where the checkpoint says so)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclass(frozen=True)
class ScoringRequestOutput:
    """vLLM's: one pair's score (a cross-encoder's, or the cosine of two embeddings)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        engine: Engine | PoolingEngine | None = None,
        **engine_args: Any,
    ):
        """`model`: a Hugging Face checkpoint directory or a GGUF file, with the engine's settings
        as keyword arguments (EngineConfig's fields, e.g. tensor_parallel_size=2, or runner=
        "pooling"); or an `engine` already built."""
        if engine is None:
            if model is None:
                raise TypeError("LLM needs a model (or an engine)")
            config = EngineConfig(**engine_args)
            pooling = runs_pooling(model, config)
            engine = PoolingEngine(model, config) if pooling else Engine(model, config)
        self.engine = engine
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or
        `{"prompt_token_ids": [...]}` dicts; one SamplingParams for all, or one per prompt."""
        engine = self._engine(Engine, "generate")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            ids.append(str(self._counter))
            self._counter += 1
            engine.add_request(ids[-1], _prompt(prompt), p)
        return self._run(ids, use_tqdm, "generate")

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        prompt_name: str | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in order (an embedding model's). Texts get the prompt of the
        checkpoint's sentence-transformers config named `prompt_name` (else its default one)."""
        engine = self._engine(PoolingEngine, "embed")
        if engine.classifies:
            raise ValueError("embed: this model is a cross-encoder or reranker: use score")
        truncate = truncate_prompt_tokens
        inputs = [
            engine.admit_text(p, "prompts", truncate, prompt_name)
            if isinstance(p, str) else engine.admit(_prompt_ids(p), "prompts", truncate)
            for p in ([prompts] if isinstance(prompts, str | dict) else prompts)
        ]  # fmt: skip
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.data))
            for o in self._pool(engine, inputs, use_tqdm, "embed")
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """One score per pair: data_1 against each of data_2 (one to one, one to many, or
        pairwise): a cross-encoder's (a reranker's), or the cosine of an embedding model's
        vectors. The texts go in as given: a Qwen3-Reranker's template is the caller's."""
        engine = self._engine(PoolingEngine, "score")
        pairs = _pairs(data_1, data_2)
        if engine.classifies:
            if engine.num_labels != 1:
                raise ValueError(f"score: this model has {engine.num_labels} labels; a "
                                 "relevance score needs one")  # fmt: skip
            inputs = [engine.admit_pair(a, b, "data_2", truncate_prompt_tokens) for a, b in pairs]
            outputs = self._pool(engine, inputs, use_tqdm, "score")
            return [
                ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.data[0]))
                for o in outputs
            ]
        texts = [t for pair in pairs for t in pair]
        vectors = self.embed(texts, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm)  # fmt: skip
        return [
            ScoringRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                 ScoringOutput(_cosine(a.outputs.embedding, b.outputs.embedding)))
            for a, b in zip(vectors[::2], vectors[1::2], strict=True)
        ]  # fmt: skip

    def _engine(self, kind: type, method: str) -> Any:
        if not isinstance(self.engine, kind):
            what = "a generative" if isinstance(self.engine, Engine) else "a pooling"
            raise ValueError(f"{method}: this LLM holds {what} model")
        return self.engine

    def _pool(
        self, engine: PoolingEngine, inputs: list[PoolingInput], use_tqdm: bool, desc: str
    ) -> list[Any]:
        ids = []
        for one in inputs:
            ids.append(str(self._counter))
            self._counter += 1
            engine.add_request(ids[-1], one)
        return self._run(ids, use_tqdm, desc)

    def _run(self, ids: list[str], use_tqdm: bool, desc: str) -> list[Any]:
        done: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:  # an exception left some behind: free their blocks
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in ids]


def _prompt_ids(prompt: Prompt) -> list[int]:
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    raise TypeError("an input is a string or a dict with 'prompt_token_ids'")


def _pairs(first: str | Sequence[str], second: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one data_1 against every data_2, or as many of each, pairwise."""
    texts_1 = [first] if isinstance(first, str) else list(first)
    texts_2 = [second] if isinstance(second, str) else list(second)
    if len(texts_1) == 1:
        texts_1 *= len(texts_2)
    if len(texts_1) != len(texts_2) or not texts_2:
        raise ValueError(f"data_1 has {len(texts_1)} texts and data_2 {len(texts_2)}: give one "
                         "data_1, or as many as data_2 (at least one)")  # fmt: skip
    return list(zip(texts_1, texts_2, strict=True))


def _cosine(a: list[float], b: list[float]) -> float:
    va, vb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.dot(va, vb)) / max(float(np.linalg.norm(va) * np.linalg.norm(vb)), 1e-12)


def _prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise TypeError("a prompt is a string or a dict with 'prompt_token_ids' or 'prompt'")
