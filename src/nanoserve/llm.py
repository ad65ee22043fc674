"""The offline API, in vLLM's shape: `LLM(model=DIR, ...).generate(prompts, sampling_params)`.
Owns one Engine and drives it until every prompt is answered; `close()` (or a `with` block) stops
the engine's tensor-parallel workers, if it has any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine, RequestOutput, SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    def __init__(
        self, model: str | None = None, *, engine: Engine | None = None, **engine_args: Any
    ):
        """`model`: a Hugging Face checkpoint directory or a GGUF file, with the engine's settings
        as keyword arguments (EngineConfig's fields, e.g. tensor_parallel_size=2); or an
        `engine` already built."""
        if engine is None:
            if model is None:
                raise TypeError("LLM needs a model (or an engine)")
            engine = Engine(model, EngineConfig(**engine_args))
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
            self.engine.add_request(ids[-1], _prompt(prompt), p)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
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


def _prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise TypeError("a prompt is a string or a dict with 'prompt_token_ids' or 'prompt'")
