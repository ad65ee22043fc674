"""The engine: continuous batching over a paged KV cache. Outside this package only these names
are used; the scheduler, the KV cache manager and the requests stay inside."""

from nanoserve.engine.admission import Admitted, RequestRejected
from nanoserve.engine.engine import Engine, EngineStats, SchedulerStalled
from nanoserve.engine.memory import ModelTooLarge, NotEnoughMemory
from nanoserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.engine.parallel.tp import WorkerFailed
from nanoserve.engine.parallel.worker import worker_from_env
from nanoserve.engine.pooling import PoolingEngine, PoolingInput, PoolingOutput, runs_pooling
from nanoserve.engine.sampling import WHOLE_VOCAB, Logprob, SamplingParams
from nanoserve.engine.structured import GrammarError, StructuredOutputsParams, closed_schema
from nanoserve.engine.thinking import ThinkingParams

__all__ = [
    "Admitted",
    "CompletionOutput",
    "Engine",
    "EngineStats",
    "GrammarError",
    "Logprob",
    "ModelTooLarge",
    "NotEnoughMemory",
    "PoolingEngine",
    "PoolingInput",
    "PoolingOutput",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "SchedulerStalled",
    "closed_schema",
    "StructuredOutputsParams",
    "ThinkingParams",
    "WHOLE_VOCAB",
    "WorkerFailed",
    "runs_pooling",
    "worker_from_env",
]
