"""Speculative decoding by a draft model: a smaller model with the target's tokenizer proposes
`num_speculative_tokens` tokens greedily, which the target verifies as it verifies n-gram drafts
(engine/engine.py), so the output is the same whatever the draft proposes.

The draft has its own KV cache tensors, shaped for its own layers and heads, but indexed by the
target's block ids and slot mapping (the same number of blocks, the same block size): a request's
block table serves both, so the block ledger, prefix caching, preemption and the trim of rejected
drafts need no second allocator. The draft writes only slots of its request's block table, below
the positions the scheduler reserved for the request's token and its draft (`writes_cache`).

Which of a request's positions hold the draft's keys and values is kept here, per request: the
tokens the draft last wrote, from where it started. What still matches the request's tokens (and
is below its computed tokens, whose blocks it still holds) is valid; the rest is written again.
A new request starts with none (a block found in the prefix cache may have been filled by a
request that never drafted), and so does one preempted since (its blocks were freed). Owned by
the engine, run in its step (the scheduler proposes while it plans).

Cost: per drafting request and step, one draft forward over the positions not yet in the draft's
cache (the last token; more after a fully accepted draft or at the first proposal, the prompt),
then `k - 1` one-token draft forwards. Requests are drafted one by one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanoserve.config import EngineConfig, SettingError
from nanoserve.engine.inputs import Chunk
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.request import Request
from nanoserve.engine.spec.ngram import draft_room
from nanoserve.model import Checkpoint, open_checkpoint
from nanoserve.tokenizer import Tokenizer

# Encoded by both tokenizers: a draft whose ids differ from the target's proposes nonsense.
_PROBE = 'The quick brown fox jumps over the lazy dog. 1234, (x) = "yes"!\n'


@dataclass
class _Written:
    """The draft's cache of a request: `tokens` at positions from `start` on, as of preemption
    count `preemptions`."""

    preemptions: int
    start: int
    tokens: list[int]


class DraftModelProposer:
    writes_cache = True

    def __init__(
        self,
        path: str | Path,
        target: Checkpoint,
        target_tokenizer: Tokenizer,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
    ):
        """Load the draft at `path` as the target was loaded (`config`: the target's, dtype and
        KV cache dtype resolved), its cache `num_blocks` blocks like the target's. Refuses,
        naming speculative_config.model, a draft whose vocabulary, tokenizer or context differs,
        or whose heads a q8_0 cache cannot hold."""
        spec = config.speculative_config
        assert spec is not None
        try:
            checkpoint = open_checkpoint(path)
        except FileNotFoundError as e:
            raise SettingError("speculative_config.model", str(path), f"a model ({e})") from None
        _check_compatible(str(path), checkpoint, target, target_tokenizer, max_model_len)
        if config.kv_cache_dtype == "q8_0" and checkpoint.config.head_dim % 32:
            raise SettingError(
                "speculative_config.model", str(path), "a model whose heads hold q8_0 blocks of "
                f"32 (kv_cache_dtype q8_0; the draft's head_dim is {checkpoint.config.head_dim})",
            )  # fmt: skip
        # Under tensor parallelism the draft runs whole in rank 0's process, the engine's.
        draft_config = replace(
            config, speculative_config=None, num_kv_blocks=num_blocks,
            max_model_len=max_model_len, cuda_graphs=False, tensor_parallel_size=1,
        )  # fmt: skip
        self.runner = ModelRunner(checkpoint, draft_config)
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self._written: weakref.WeakKeyDictionary[Request, _Written] = weakref.WeakKeyDictionary()

    def room(self, request: Request) -> int:
        return draft_room(request, self.k, self.max_model_len)

    def propose(self, request: Request, room: int) -> list[int]:
        """`room` greedy draft tokens for a decoding request whose slots for its last token and
        `room` more are reserved: the draft computes its positions from the first it does not
        hold to the last token, then `room - 1` one-token steps, writing positions up to the
        last token's + room - 1, all below the reserved ones' end."""
        tokens = request.token_ids
        start = self._valid(request)
        table = request.block_table
        assert len(table) * self.block_size >= len(tokens) + room
        draft: list[int] = []
        chunk = Chunk(tokens, start, len(tokens) - start, table)
        for _ in range(room):
            logits = self._step(chunk)
            draft.append(int(torch.argmax(logits[0])))
            chunk = Chunk(tokens + draft, len(tokens) + len(draft) - 1, 1, table)
        # Written: positions start .. len(tokens) + room - 2 (the last draft token never is).
        written = tokens[start:] + draft[:-1]
        self._written[request] = _Written(request.num_preemptions, start, written)
        return draft

    def _valid(self, request: Request) -> int:
        """How many of the request's first positions hold the draft's keys and values."""
        w = self._written.get(request)
        if w is None or w.preemptions != request.num_preemptions:
            return 0
        tokens, n = request.token_ids, w.start
        while (
            n - w.start < len(w.tokens) and n < len(tokens) and tokens[n] == w.tokens[n - w.start]
        ):
            n += 1
        return min(n, request.num_computed_tokens)

    def _step(self, chunk: Chunk) -> torch.Tensor:
        return self.runner.execute(self.runner.prepare([chunk]))[0]


def _check_compatible(
    path: str, draft: Checkpoint, target: Checkpoint, tokenizer: Tokenizer, max_model_len: int
) -> None:
    """Refuse a draft that cannot propose the target's tokens: another vocabulary size, other
    token ids for a probe text, other end-of-sequence ids, or a context shorter than the
    target's max_model_len."""
    name = "speculative_config.model"
    dc, tc = draft.config, target.config
    if dc.vocab_size != tc.vocab_size:
        raise SettingError(
            name, path, f"a model with the target's vocabulary of {tc.vocab_size} tokens "
            f"(the draft's has {dc.vocab_size})",
        )  # fmt: skip
    draft_tokenizer = draft.tokenizer()
    if draft_tokenizer.encode(_PROBE) != tokenizer.encode(_PROBE) or (
        draft_tokenizer.eos_token_ids | set(dc.eos_token_ids)
        != tokenizer.eos_token_ids | set(tc.eos_token_ids)
    ):
        raise SettingError(name, path, "a model with the target's tokenizer (its ids differ)")
    if dc.max_position_embeddings < max_model_len:
        raise SettingError(
            name, path, f"a model whose context ({dc.max_position_embeddings} tokens) holds "
            f"max_model_len ({max_model_len})",
        )  # fmt: skip
