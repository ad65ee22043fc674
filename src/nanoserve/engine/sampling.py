"""Sampling: `SamplingParams` (validated, every error names its field) and `sample`, which turns
one step's logits into one token per row.

A row's token depends only on its own logits, parameters, seed and output position: random draws
come from a generator seeded with (seed, position), so a request samples the same tokens alone,
in any batch, and after being preempted and recomputed. Owns nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from nanoserve import kernels
from nanoserve.engine.structured import StructuredOutputsParams
from nanoserve.engine.thinking import ThinkingParams

_MASK64 = (1 << 63) - 1
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_LOGPROBS = 20  # top alternatives one position may report
WHOLE_VOCAB = -1  # logprobs: every token of the vocabulary at each position (vLLM's -1)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length; 0: score the prompt
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives besides the chosen token; -1: all of them
    prompt_logprobs: int | None = None  # each prompt token's logprob, and top-N alternatives
    skip_special_tokens: bool = True
    # The output must match this constraint (engine/structured.py): the logits are masked
    # before the penalties, temperature, filters and logprobs see them.
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids before the temperature and the filters (OpenAI's
    # logit_bias); only these token ids may be sampled (vLLM's allowed_token_ids). Neither
    # changes the logprobs, which are the model's own distribution.
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    # A reasoning model's thinking (engine/thinking.py): a budget of tokens, after which its end
    # tag is forced, and the constraint above deferred until the thinking has ended.
    thinking: ThinkingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        allowed = self.allowed_token_ids
        mt = self.max_tokens
        checks = [
            ("n", _int(self.n) and self.n >= 1, "an integer >= 1"),
            ("temperature", _num(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_p", _num(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", _int(self.top_k) and self.top_k >= -1, "-1 or 0 (off), or an integer > 0"),
            ("min_p", _num(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", _in(self.presence_penalty, -2, 2), "in [-2, 2]"),
            ("frequency_penalty", _in(self.frequency_penalty, -2, 2), "in [-2, 2]"),
            (
                "repetition_penalty",
                _in(self.repetition_penalty, 0, 10) and self.repetition_penalty > 0,
                "in (0, 10]",
            ),
            ("seed", self.seed is None or _int(self.seed), "an integer"),
            ("max_tokens", mt is None or (_int(mt) and mt >= 0), "an integer >= 0"),
            (
                "min_tokens",
                _int(self.min_tokens)
                and 0 <= self.min_tokens <= (mt if mt is not None else 1 << 62),
                "an integer >= 0 and <= max_tokens",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(_int(t) and t >= 0 for t in self.stop_token_ids), "token ids"),
            ("logprobs", _top_n(self.logprobs, WHOLE_VOCAB), "an integer in [0, 20], or -1 (all)"),
            ("prompt_logprobs", _top_n(self.prompt_logprobs), "an integer in [0, 20]"),
            (
                "logit_bias",
                len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(
                    _int(t) and t >= 0 and _in(b, -BIAS_LIMIT, BIAS_LIMIT)
                    for t, b in self.logit_bias.items()
                ),  # fmt: skip
                f"at most {MAX_LOGIT_BIAS} token ids, each with a bias in [-100, 100]",
            ),
            (
                "allowed_token_ids",
                allowed is None or (len(allowed) > 0 and all(_int(t) and t >= 0 for t in allowed)),
                "a non-empty list of token ids",
            ),
            (
                "thinking",
                self.thinking is None
                or (isinstance(self.thinking, ThinkingParams) and self.thinking.valid()),
                "ThinkingParams with token ids for its tags and a budget >= 0",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        # Below this, dividing float32 logits by the temperature overflows: argmax is the answer.
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logit_bias's ids and values, and allowed_token_ids's distinct ids, as tensors built
        once per request rather than each step (a list of 2**18 ids takes tens of
        milliseconds)."""
        allowed = self.allowed_token_ids
        return (
            torch.tensor(list(self.logit_bias), dtype=torch.long),
            torch.tensor(list(self.logit_bias.values()), dtype=torch.float32),
            None if allowed is None else torch.tensor(sorted(set(allowed)), dtype=torch.long),
        )


def _top_n(x: object, lowest: int = 0) -> bool:
    return x is None or (_int(x) and lowest <= x <= MAX_LOGPROBS)  # type: ignore[operator]


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _in(x: object, low: float, high: float) -> bool:
    return _num(x) and low <= x <= high  # type: ignore[operator]


def _num(x: object) -> bool:
    return _int(x) or (isinstance(x, float) and x == x and abs(x) != float("inf"))


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    seed: int
    position: int  # index of the token being sampled within the output
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_ids: Sequence[int] = ()  # e.g. EOS while min_tokens is not reached
    forced: int | None = None  # the token this row takes, whatever its logits (a thinking's tag)


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprobs: dict[int, Logprob] | None  # chosen token and the top N, when asked for


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sample]:
    """One token per row of `logits` [len(rows), vocab] (float32, on any device). The tokens
    come back to the host once, together with the logprobs asked for."""
    raw = logits
    logits = _apply_penalties_and_bans(logits, rows)
    tokens = kernels.argmax(logits)  # the greedy rows' answer; sampled rows are overwritten
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy and r.forced is None]
    if sampled:
        probs = _filtered_probs(logits[sampled], [rows[i].params for i in sampled])
        for j, i in enumerate(sampled):
            noise = torch.empty_like(probs[j]).exponential_(generator=_generator(rows[i], probs))
            tokens[i] = (probs[j] / noise).argmax()
    for i, r in enumerate(rows):
        if r.forced is not None:
            tokens[i] = r.forced
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    by_row = {}
    if wanted:
        ks = [rows[i].params.logprobs or 0 for i in wanted]
        by_row = dict(zip(wanted, token_logprobs(raw[wanted], tokens[wanted], ks), strict=True))
    return [Sample(t, by_row.get(i)) for i, t in enumerate(tokens.tolist())]


def _apply_penalties_and_bans(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    touched = [
        i
        for i, r in enumerate(rows)
        if (r.params.penalized or r.params.biased or r.banned_ids) and r.forced is None
    ]
    if not touched:
        return logits
    logits = logits.clone()
    for i in touched:
        r, row = rows[i], logits[i]
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), device=row.device)
            values = row[seen]
            penalized = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
            row[seen] = penalized.clamp(max=torch.finfo(row.dtype).max)  # a tiny penalty: no inf
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            output = torch.tensor(r.output_ids, device=row.device)
            counts = torch.bincount(output, minlength=row.shape[0])
            row -= p.frequency_penalty * counts[: row.shape[0]]
            row -= p.presence_penalty * (counts[: row.shape[0]] > 0)
        if p.biased:
            _bias(row, *p.bias_tensors)
        if r.banned_ids:
            row[list(r.banned_ids)] = float("-inf")
    return logits


def _bias(
    row: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None
) -> None:
    """logit_bias added, then everything but allowed_token_ids (if given) set to -inf."""
    if len(ids):
        row[ids.to(row.device)] += values.to(row.device)
    if allowed is not None:
        banned = torch.ones_like(row, dtype=torch.bool)
        banned[allowed.to(row.device)] = False
        row.masked_fill_(banned, float("-inf"))


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as probabilities (filtered entries are 0)."""
    on = logits.device
    temps = torch.tensor([p.temperature for p in params], device=on).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    vocab = probs.shape[-1]
    if any(0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0 for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=on)
        top_p = torch.tensor([p.top_p for p in params], device=on)
        min_p = torch.tensor([p.min_p for p in params], device=on)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=on).unsqueeze(0)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k.unsqueeze(1)) | (mass_before >= top_p.unsqueeze(1))
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _generator(row: SampleRow, like: torch.Tensor) -> torch.Generator:
    g = torch.Generator(device=like.device)
    g.manual_seed(mix_seed(row.seed, row.position))
    return g


def mix_seed(seed: int, index: int) -> int:
    """A 63-bit seed for draw `index` of a stream seeded with `seed` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row of `logits` [rows, vocab]: the logprob and rank of `tokens[row]`, and the row's
    top `top_n[row]` tokens (-1: every token of the vocabulary), all of the model's own
    distribution (before temperature, penalties and filters). A rank counts the tokens more
    likely than this one, so tied tokens share it. Used for sampled tokens and for prompt
    tokens alike."""
    if not len(top_n):
        return []
    vocab = logits.shape[-1]
    counts = [vocab if n == WHOLE_VOCAB else n for n in top_n]
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(max(max(counts), 1), dim=-1)
    # Sorted, so the first of a run of equal values is where the greater ones end.
    top_ranks = torch.searchsorted(-top_values, -top_values, side="left") + 1
    host = [t.tolist() for t in (tokens, chosen[:, 0], ranks, top_values, top_ids, top_ranks)]
    result = []
    for n, row in zip(counts, zip(*host, strict=True), strict=True):
        token, value, rank, values, ids, places = row
        entry = {token: Logprob(value, rank)}
        for r in range(n):
            entry.setdefault(ids[r], Logprob(values[r], places[r]))
        result.append(entry)
    return result
