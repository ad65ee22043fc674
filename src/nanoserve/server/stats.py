"""What the engine task publishes after every change, for /health, the queue limit and the
metrics: a typed, immutable snapshot. Owns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingStats:
    running: int  # requests in the running batch
    waiting: int  # admitted to the engine's queue or waiting their turn in the bridge
    free_blocks: int
    total_blocks: int
    steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    peak_running: int
    generation_tokens: int
    spec_decode_num_drafts: int = 0  # speculative drafts verified
    spec_decode_num_draft_tokens: int = 0  # their tokens
    spec_decode_num_accepted_tokens: int = 0  # draft tokens the target model agreed with
    prompt_tokens: int = 0  # of the requests admitted to the engine, n times each
    prefix_hit_tokens: int = 0  # prompt positions found in the prefix cache

    @property
    def kv_usage(self) -> float:
        if not self.total_blocks:  # a pooling engine holds no KV pool
            return 0.0
        return (self.total_blocks - self.free_blocks) / self.total_blocks
