"""GET /v1/loads: this server's load in the schema routers poll (SGLang's, which smg reads from
any backend that answers it, at `--load-monitor-interval`): requests running and waiting, the
KV cache's tokens in use and its capacity, and the prefix cache's hit rate. Least-load,
power-of-two and overload protection in the router act on these; without them every replica
looks idle. One rank: a nanoserve process is one replica (`--data-parallel-size` starts N of
them, each its own backend to the router).
"""

from __future__ import annotations

from datetime import UTC, datetime

from nanoserve.server.bridge import Serving


def loads(serving: Serving) -> dict[str, object]:
    stats = serving.task.stats
    used_blocks = stats.total_blocks - stats.free_blocks
    hit_rate = stats.prefix_hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    waiting = serving.num_waiting  # the inbox and the engine's queue
    rank = {
        "dp_rank": 0,
        "num_running_reqs": stats.running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": stats.running + waiting,
        "num_used_tokens": used_blocks * serving.block_size,
        "max_total_num_tokens": stats.total_blocks * serving.block_size,
        "token_usage": stats.kv_usage,
        "utilization": stats.kv_usage,
        "cache_hit_rate": min(hit_rate, 1.0),
        "max_running_requests": serving.max_num_seqs,
    }
    return {"timestamp": datetime.now(UTC).isoformat(), "dp_rank_count": 1, "loads": [rank]}
