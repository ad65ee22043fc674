"""The benchmarks' shared workloads: model shapes, and request mixes of prompt token ids with the
number of output tokens each wants."""

from __future__ import annotations

import torch

SHAPES = {
    "25m": dict(
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1536,
        vocab_size=4096,
        max_position_embeddings=1024,
    ),
    "1b": dict(
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=4096,
    ),
}
MODEL = SHAPES["25m"]


def workload(
    count: int = 64,
    seed: int = 0,
    vocab: int = 4096,
    prompts: tuple[int, int] = (16, 256),
    outputs: tuple[int, int] = (16, 128),
) -> list[tuple[list[int], int]]:
    """Prompt and output lengths drawn uniformly from the given ranges (inclusive)."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(count):
        prompt_len = int(torch.randint(prompts[0], prompts[1] + 1, (1,), generator=g))
        output_len = int(torch.randint(outputs[0], outputs[1] + 1, (1,), generator=g))
        requests.append((torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), output_len))
    return requests


def chat_workload(
    conversations: int = 16, turns: int = 4, seed: int = 1, vocab: int = 4096
) -> list[tuple[list[int], int]]:
    """Chat-like traffic: every conversation opens with one shared 96-token system prompt, and turn
    t's prompt is the conversation so far (earlier user messages of 16-64 tokens, each followed by
    a stand-in reply of 32-96) plus a new user message; replies of 32-160 tokens. All turns are
    submitted at once, so a server with prefix caching computes the shared parts once."""
    g = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int) -> list[int]:
        return torch.randint(
            0, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g
        ).tolist()

    system = tokens(96, 96)
    requests = []
    for _ in range(conversations):
        history = list(system)
        for _ in range(turns):
            history += tokens(16, 64)
            requests.append((list(history), int(torch.randint(32, 161, (1,), generator=g))))
            history += tokens(32, 96)
    return requests
