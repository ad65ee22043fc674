"""The engine: continuous batching over a paged KV cache. Outside this package only these names
are used; the scheduler, the KV cache manager and the requests stay inside."""

from nanoserve.engine.engine import Engine, EngineStats, RequestRejected, SchedulerStalled
from nanoserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.engine.sampling import Logprob, SamplingParams
from nanoserve.engine.tp import WorkerFailed
from nanoserve.engine.worker import worker_from_env

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineStats",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "SchedulerStalled",
    "WorkerFailed",
    "worker_from_env",
]
