"""Admission: the one place a request is checked before it is queued.

`Admission.admit` turns a prompt and its parameters into an `Admitted` request, or refuses it
with `RequestRejected`, naming the field: the prompt's token ids in the vocabulary and within the
context, the effective max_tokens (the config's default where none was given, or what the
context leaves), a pool large enough for the whole request, whole-vocabulary logprobs within
their bound, the constraint compiled. The engine's `add_request` takes an `Admitted` as it is
and checks nothing again; given a raw prompt (the offline API), it admits it first. Reads fixed
settings only, so any thread may admit: a server admits in its handlers, off the engine's
thread, and compiles a constraint in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.config import EngineConfig
from nanoserve.engine.kv_cache import cdiv
from nanoserve.engine.sampling import WHOLE_VOCAB, SamplingParams
from nanoserve.engine.structured import CompiledGrammar, GrammarCompiler, GrammarError
from nanoserve.tokenizer import Tokenizer

# Whole-vocabulary logprobs (logprobs -1) hold an entry per token of the vocabulary at every
# position: about 230 bytes of memory and 1.5 us of the engine's step each (SmolLM2's 49,152
# tokens: 11 MB and 75 ms a position), then 30 (completions) to 85 (chat) bytes of the body,
# built in 0.2-0.7 s a position off the event loop. Served for vocabularies of at most
# MAX_WHOLE_VOCAB tokens (Gemma 3's, the largest of the families served), and for at most
# WHOLE_VOCAB_ENTRIES entries a request (n x max_tokens x vocabulary).
MAX_WHOLE_VOCAB = 262_144
WHOLE_VOCAB_ENTRIES = 1 << 20


class RequestRejected(ValueError):
    """A request the engine cannot take; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Admitted:
    """A checked request: its prompt's token ids, its parameters, the most tokens it may
    generate (`output_limit`: params.max_tokens, or the default it was given), and its compiled
    constraint (None without one)."""

    token_ids: list[int]
    params: SamplingParams
    output_limit: int
    grammar: CompiledGrammar | None


@dataclass(frozen=True)
class Admission:
    """The engine's fixed facts a request is checked against."""

    config: EngineConfig
    tokenizer: Tokenizer
    grammars: GrammarCompiler
    vocab_size: int
    max_model_len: int
    num_blocks: int

    def admit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        grammar: CompiledGrammar | None = None,
    ) -> Admitted:
        """The request checked, or RequestRejected. `grammar`: the constraint already compiled
        (a server compiles it once for all the prompts of one HTTP request)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_tokens(token_ids, params)
        limit = self._output_limit(len(token_ids), params)
        if params.logprobs == WHOLE_VOCAB:
            self._check_whole_vocab(params.n, limit)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile(params)
        return Admitted(token_ids, params, limit, grammar)

    def compile(self, params: SamplingParams) -> CompiledGrammar:
        """The request's constraint, compiled (cached by constraint; milliseconds, the first a
        second or two: a server calls this in a worker thread)."""
        assert params.structured_outputs is not None
        try:
            return self.grammars.compile(params.structured_outputs)
        except GrammarError as e:
            raise RequestRejected(str(e), e.param) from None

    def _check_tokens(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        if not token_ids:
            raise RequestRejected("prompt is empty", "prompt")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt"
            )
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            (
                "thinking",
                (params.thinking.start_ids + params.thinking.end_ids) if params.thinking else (),
            ),
        ):
            if any(t >= vocab for t in ids):
                raise RequestRejected(f"{name} must be token ids below the vocabulary size "
                                      f"{vocab}", name)  # fmt: skip

    def _check_whole_vocab(self, n: int, limit: int) -> None:
        vocab = self.vocab_size
        if vocab > MAX_WHOLE_VOCAB:
            raise RequestRejected(
                f"logprobs -1 (the whole vocabulary) is served for vocabularies of at most "
                f"{MAX_WHOLE_VOCAB} tokens; this model's has {vocab}",
                "logprobs",
            )
        most = WHOLE_VOCAB_ENTRIES // vocab  # positions: sequences x tokens
        if n * limit > most:
            raise RequestRejected(
                f"logprobs -1 (the whole vocabulary, {vocab} tokens) is served for at most "
                f"{most} positions a request ({WHOLE_VOCAB_ENTRIES} entries): n ({n}) x "
                f"max_tokens ({limit}) is {n * limit}: ask for fewer",
                "logprobs",
            )

    def _output_limit(self, n: int, params: SamplingParams) -> int:
        """The most tokens the request may generate, checked against the context and the pool."""
        limit = self.max_model_len
        if n > limit or (n == limit and params.max_tokens != 0):
            raise RequestRejected(
                f"prompt has {n} tokens; this model's context is {limit} tokens "
                "(max_model_len), which leaves no room to generate",
                "prompt",
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, limit - n)
            if params.min_tokens > max_tokens:
                raise RequestRejected(
                    f"min_tokens must be <= max_tokens, got {params.min_tokens}; a request "
                    f"without max_tokens generates at most {max_tokens} tokens here "
                    f"(--default-max-tokens {self.config.default_max_tokens}, or what the "
                    f"{limit}-token context leaves after the {n}-token prompt)",
                    "min_tokens",
                )
        if n + max_tokens > limit:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens, more "
                f"than the context of {limit} tokens (max_model_len)",
                "max_tokens",
            )
        bs = self.config.block_size
        needed = cdiv(n + max_tokens, bs)
        if needed > self.num_blocks:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks of "
                f"{bs} tokens; the whole pool has {self.num_blocks}",
                "max_tokens",
            )
        return max_tokens
