"""Structured outputs: a JSON schema, a regex, a list of choices or a Lark grammar that the output
must match, guaranteed by masking the logits. llguidance compiles the grammar against the
tokenizer's vocabulary; each constrained request holds one matcher, advanced with every token it
samples (its state depends on the output tokens alone, which survive a preemption), and each step
the mask of every constrained row is filled in one parallel call and applied before sampling.

Owns the llguidance tokenizer (built on first use) and a cache of checked grammars, behind a lock:
handlers compile in worker threads while the engine takes matchers from the cache.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # llguidance is imported on first use: a server without constraints needs none
    import llguidance

    from nanoserve.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
MAX_GRAMMAR_CHARS = 1 << 20  # the longest schema, regex or grammar a request may give
# Whitespace a JSON output may put between two tokens, unless the request says otherwise: enough
# for an indented document, bounded so that a small model cannot spend its tokens on blanks.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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

    def key(self) -> str:
        """The cache key: the constraint in canonical JSON."""
        return json.dumps([self.kind, getattr(self, self.kind), self.whitespace_pattern],
                          sort_keys=True)  # fmt: skip

    def to_grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        import llguidance

        options: Any = {"whitespace_pattern": JSON_WHITESPACE}
        if self.whitespace_pattern == "":
            options = {"whitespace_flexible": False}
        elif self.whitespace_pattern is not None:
            options = {"whitespace_pattern": self.whitespace_pattern}
        m = llguidance.LLMatcher
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return m.grammar_from_json_schema(closed_schema(schema), defaults=options)
        if self.json_object:
            return m.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:
            return m.grammar_from_lark("start: " + " | ".join(map(json.dumps, self.choice)))
        assert self.grammar is not None
        text = self.grammar
        if "::=" in text:  # GBNF, as llama.cpp's server takes it
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # its parser raises plain exceptions
                raise GrammarError(f"{self.param}.grammar: {e}", self.param) from None
        return m.grammar_from_lark(text)


_VALUES = frozenset(["const", "enum", "default", "examples"])  # JSON values, not schemas


def closed_schema(schema: Any) -> Any:
    """The schema with every object that does not say otherwise taking no keys beyond its
    properties (`additionalProperties: false`), as vLLM's default backend reads schemas: left
    open, a small model may add keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else closed_schema(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass
class CompiledGrammar:
    """A checked grammar and a fresh matcher of it, copied for each request."""

    grammar: str
    matcher: llguidance.LLMatcher


class GrammarCompiler:
    """Compiles constraints against one tokenizer, caching the result by constraint.
    Thread-safe; `compile` may take milliseconds (and the first call a second or two, to build
    llguidance's view of the vocabulary), so servers call it off the event loop."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

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

    @property
    def executor(self) -> llguidance.LLExecutor:
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        source = spec.json if spec.json is not None else spec.regex or spec.grammar or ""
        size = len(source if isinstance(source, str) else json.dumps(source))
        if size > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"{spec.param}: {size} characters, more than the {MAX_GRAMMAR_CHARS} allowed",
                spec.param,
            )
        try:
            grammar = spec.to_grammar()
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{spec.param}.{spec.kind}: {e}", spec.param) from None
        tokenizer = self._llg_tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise GrammarError(f"{spec.param}.{spec.kind}: {_first_line(messages)}", spec.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.param}.{spec.kind}: {matcher.get_error()}", spec.param)
        return CompiledGrammar(grammar, matcher)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll


def _first_line(messages: list[str]) -> str:
    text = "; ".join(messages) or "invalid"
    return text.strip().splitlines()[0] if text.strip() else "invalid"


def mask_logits(
    logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None], compiler: GrammarCompiler
) -> torch.Tensor:
    """Logits [rows, vocab] with every token the row's matcher forbids set to -inf (rows without
    a matcher unchanged). The masks are computed in one parallel call."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[1]
    if not rows:
        return logits
    words = -(-vocab // 32)
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    pairs = [(m, j) for j, m in enumerate(m for m in matchers if m is not None)]
    compiler.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = ~torch.from_numpy(bits.view(np.bool_)).to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: one pass
        return logits.masked_fill(forbidden, float("-inf"))
    logits = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return logits
