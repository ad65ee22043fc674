"""Prometheus metrics, named as vLLM names them with the `nanoserve:` prefix, and the process's
own (`process_resident_memory_bytes` and the rest of prometheus_client's process collector, read
from /proc when scraped). Updated only by the engine task (between steps), read by the /metrics
route. Owns a registry per server, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from nanoserve.engine import PoolingOutput, RequestOutput
from nanoserve.server.stats import ServingStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # this process's only (under TP, not the workers')
        p = "nanoserve:"
        self.cache_config = Gauge(
            p + "cache_config_info", "The KV cache's configuration (value 1), as vLLM's "
            "cache_config_info: num_gpu_blocks is the pool's blocks on any device; cache_bytes "
            "its bytes on this host",
            ["block_size", "num_gpu_blocks", "cache_dtype", "cache_bytes"], registry=r,
        )  # fmt: skip
        self.running = Gauge(
            p + "num_requests_running", "Requests in the running batch", registry=r
        )
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to run", registry=r)
        self.kv_usage = Gauge(
            p + "kv_cache_usage_perc", "Fraction of KV blocks held by requests", registry=r
        )
        self.preemptions = Counter(p + "num_preemptions", "Preemptions by recompute", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(
            p + "request_success", "Requests finished, by reason", ["finished_reason"], registry=r
        )
        self.aborted = Counter(p + "requests_aborted", "Requests aborted", registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.spec_drafts = Counter(
            p + "spec_decode_num_drafts", "Speculative drafts verified", registry=r
        )
        self.spec_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Speculative draft tokens verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Draft tokens the model agreed with", registry=r
        )
        self.spec_acceptance = Gauge(
            p + "spec_decode_draft_acceptance_rate",
            "Accepted over verified draft tokens since start (0 before any draft)",
            registry=r,
        )

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(p + name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("inter_token_latency_seconds", "Between output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first run")
        self._last: dict[str, tuple[int, float]] = {}  # request -> (tokens seen, when)
        self._generated = 0
        self._preempted = 0
        self._spec = (0, 0, 0)  # drafts, draft tokens, accepted tokens counted so far

    def on_start(self, block_size: int, num_blocks: int, dtype: str, cache_bytes: int) -> None:
        """The KV cache's fixed facts, once the engine holds it."""
        labels = (block_size, num_blocks, dtype, cache_bytes)
        self.cache_config.labels(*map(str, labels)).set(1)

    def on_arrival(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_abort(self, request_id: str) -> None:
        self.aborted.inc()
        self._last.pop(request_id, None)

    def on_state(self, stats: ServingStats) -> None:
        """Gauges, from the engine task's snapshot after every change."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)

    def on_step(self, stats: ServingStats) -> None:
        self.generation_tokens.inc(stats.generation_tokens - self._generated)
        self._generated = stats.generation_tokens
        self.preemptions.inc(stats.num_preemptions - self._preempted)
        self._preempted = stats.num_preemptions
        spec = (
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
        )
        for counter, now, before in zip(
            (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens),
            spec, self._spec, strict=True,
        ):  # fmt: skip
            counter.inc(now - before)
        self._spec = spec
        if spec[1]:
            self.spec_acceptance.set(spec[2] / spec[1])

    def on_output(self, output: RequestOutput | PoolingOutput) -> None:
        if isinstance(output, PoolingOutput):  # embedded or scored whole in one step
            self.e2e.observe(output.finished_time - output.arrival_time)
            self.success.labels(finished_reason="stop").inc()
            return
        now = time.monotonic()
        m = output.metrics
        count = sum(len(c.token_ids) for c in output.outputs)
        seen, when = self._last.get(output.request_id, (0, now))
        if seen == 0 and count and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.prefix_queries.inc(len(output.prompt_token_ids))
            self.prefix_hits.inc(output.num_cached_tokens)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
        elif count > seen:
            gap = (now - when) / (count - seen)
            for _ in range(count - seen):
                self.itl.observe(gap)
        self._last[output.request_id] = (count, now)
        if output.finished:
            del self._last[output.request_id]
            self.e2e.observe((m.finished_time or now) - m.arrival_time)
            for c in output.outputs:
                if c.finish_reason != "abort":
                    self.success.labels(finished_reason=c.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
