"""Structured outputs: a JSON schema, a regex, a list of choices or a Lark grammar that the output
must match, guaranteed by masking the logits. llguidance compiles the grammar against the
tokenizer's vocabulary; each constrained request holds one matcher, advanced with every token it
samples (its state depends on the output tokens alone, which survive a preemption), and each step
the mask of every constrained row is filled in one parallel call and applied before sampling.

Owns the llguidance tokenizer (built on first use), the checker of new constraints (its child
processes: nanoserve.grammar) and a cache of checked grammars, behind a lock: handlers compile
in worker threads while the engine takes matchers from the cache.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nanoserve.grammar.checker import BUILD_STACK, GrammarChecker
from nanoserve.grammar.compile import closed_schema, grammar_text, on_stack, public_message
from nanoserve.grammar.limits import MAX_SCHEMA_DEPTH, GrammarError, check_sizes

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputsParams", "closed_schema"]

if TYPE_CHECKING:  # llguidance is imported on first use: a server without constraints needs none
    import llguidance

    from nanoserve.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: exactly one of `json` (a JSON schema), `regex`, `choice`,
    `grammar` (Lark, or llama.cpp's GBNF) or `json_object`; `whitespace_pattern` replaces the
    whitespace a JSON output may have between its tokens. `param` is the request field the
    constraint came from, named in errors."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise GrammarError(
                f"{self.param} needs exactly one of json, regex, choice, grammar or json_object "
                f"(got {', '.join(given) or 'none'})",
                self.param,
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise GrammarError(f"{self.param}.choice must be non-empty strings", self.param)

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @property
    def value(self) -> Any:
        """The schema, regex, choices or grammar (None for json_object)."""
        return getattr(self, self.kind, None)

    def key(self) -> str:
        """The cache key: the constraint in canonical JSON."""
        try:
            return json.dumps([self.kind, self.value, self.whitespace_pattern], sort_keys=True)
        except RecursionError:  # its sizes are checked after the cache is asked
            where = f"{self.param}.{self.kind}"
            message = f"{where}: nested at most {MAX_SCHEMA_DEPTH} deep"
            raise GrammarError(message, self.param) from None

    def to_grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        return grammar_text(self.kind, self.value, self.whitespace_pattern)


@dataclass
class CompiledGrammar:
    """A checked grammar and a fresh matcher of it, copied for each request."""

    grammar: str
    matcher: llguidance.LLMatcher


class GrammarCompiler:
    """Compiles constraints against one tokenizer, caching the result by constraint.
    Thread-safe; `compile` may take milliseconds (and the first call a second or two, to start
    the checking process), so servers call it off the event loop. A constraint the cache does
    not hold is checked by size, then in a child process (nanoserve.grammar), then built here.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int], seconds: float = 0.8
    ):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self.checker = GrammarChecker(self._child_setup, seconds)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A new matcher at the start of the constraint."""
        return self.compile(spec).matcher.deep_copy()

    def close(self) -> None:
        """Stop the checking processes (a later compile starts one again)."""
        self.checker.close()

    @property
    def executor(self) -> llguidance.LLExecutor:
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        if spec.kind != "json_object":
            check_sizes(spec.kind, spec.value, spec.param)
        self.checker.check(spec.kind, spec.value, spec.whitespace_pattern, spec.param)
        return on_stack(BUILD_STACK, "grammar-build", lambda: self._build(spec))

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """What the child checked, compiled for this process (on a deeper stack than its)."""
        import llguidance

        where = f"{spec.param}.{spec.kind}"
        try:
            grammar = spec.to_grammar()
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{where}: {public_message(str(e))}", spec.param) from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{where}: {public_message(matcher.get_error())}", spec.param)
        return CompiledGrammar(grammar, matcher)

    def _child_setup(self) -> dict[str, Any]:
        return {
            "tokenizer": self._tokenizer.backend_json(),
            "n_vocab": self._vocab_size,
            "eos": self._eos,
        }

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll


def mask_logits(
    logits: torch.Tensor,
    matchers: list[llguidance.LLMatcher | None],
    compiler: GrammarCompiler,
    also: list[int | None] | None = None,
) -> torch.Tensor:
    """Logits [rows, vocab] with every token the row's matcher forbids set to -inf (rows without
    a matcher unchanged), but the row's token in `also`, if any (a thinking's start tag, allowed
    beside a grammar deferred to the answer). The masks are computed in one parallel call."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[1]
    if not rows:
        return logits
    words = -(-vocab // 32)
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    pairs = [(m, j) for j, m in enumerate(m for m in matchers if m is not None)]
    compiler.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(bits.view(np.bool_))
    for j, i in enumerate(rows):
        token = also[i] if also is not None else None
        if token is not None and token < vocab:
            allowed[j, token] = True
    forbidden = ~allowed.to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: one pass
        return logits.masked_fill(forbidden, float("-inf"))
    logits = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return logits
