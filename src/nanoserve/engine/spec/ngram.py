"""Speculative decoding by n-gram prompt lookup: the proposer and the acceptance counters.

Each step a decoding request may be given a draft: the tokens that followed the latest earlier
occurrence of its last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`). The
target model computes the request's last token and the draft in one step (one decode row per
position, engine/inputs.py), and the engine samples every position as it would have without the
draft, keeping the draft while it equals the samples (engine.py). A sample depends only on its
row's logits, seed and output position, and the kernels are batch invariant, so the output is
token for token the one without speculation, greedy or seeded; for a sampled row this is the
exact rejection rule for a one-token proposal: the draft token t is kept with probability p(t),
and otherwise the sample comes from p without t. Owns the counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.config import SpeculativeConfig
from nanoserve.engine.request import Request


@dataclass
class SpecStats:
    """Counters in vLLM's names: drafts verified, their tokens, and the tokens kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class NgramProposer:
    writes_cache = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.k = config.num_speculative_tokens
        self.lookup = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self.max_model_len = max_model_len

    def room(self, request: Request) -> int:
        return draft_room(request, self.k, self.max_model_len)

    def propose(self, request: Request, room: int) -> list[int]:
        """A draft of at most `room` tokens for a decoding request (empty: none)."""
        return ngram_draft(request.token_ids, self.lookup, room)


def draft_room(request: Request, k: int, max_model_len: int) -> int:
    """The most draft tokens a decoding request may take: `k`, and never more than it may still
    generate after the token its last position yields. A constrained request (a grammar) gets
    none: its matcher advances one sampled token at a time; nor does one whose thinking the
    engine follows (its tags may be forced)."""
    if request.matcher is not None or request.thinking is not None:
        return 0
    return min(
        k,
        request.output_limit - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )


def ngram_draft(tokens: Sequence[int], lookup: range, k: int) -> list[int]:
    """The up to `k` tokens after the latest earlier occurrence of the last n tokens, for the
    first n of `lookup` (longest first) that has one; empty when none has."""
    length = len(tokens)
    for n in lookup:
        if n >= length:
            continue
        suffix = list(tokens[length - n :])
        last = suffix[-1]
        # Latest first: an occurrence ending at `end` (exclusive) with tokens after it.
        for end in range(length - 1, n - 1, -1):
            if tokens[end - 1] == last and list(tokens[end - n : end]) == suffix:
                return list(tokens[end : end + k])
    return []
