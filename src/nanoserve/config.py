"""The settings a user gives: `EngineConfig` (how the engine runs) and `ServerConfig` (how the
HTTP server runs). Both frozen: nothing here changes after start-up. Imports no torch, so that the
command line shows its defaults at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# Block formats weights may be kept in (the C kernels'), and "none" to de-quantize a GGUF's.
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "none")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: dtype, device, cache geometry, batch budgets and how many processes
    (tensor parallelism) share the model."""

    dtype: str = "float32"  # or "auto": the fastest correct one on the device (see engine.py)
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights + cache
    cuda_graphs: bool = True  # CUDA: replay decode steps from captured graphs (not with TP > 1)
    tensor_parallel_size: int = 1  # processes (and devices) the model is split across
    # None: a GGUF's Q8_0/Q4_0/Q4_1 matrices stay in their blocks (CPU, float32, one process);
    # "q8_0"... quantizes a float checkpoint's matrices at load; "none" de-quantizes a GGUF's.
    quantization: str | None = None
    # A request that gives no max_tokens generates this many at most (and never past the context):
    # a small model asked an open question can otherwise loop until its context is full.
    default_max_tokens: int = 2048

    def __post_init__(self) -> None:
        checks = {
            "dtype": self.dtype in (*DTYPES, "auto"),
            "quantization": self.quantization is None or self.quantization in QUANTIZATIONS,
            "block_size": self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "num_kv_blocks": self.num_kv_blocks is None or self.num_kv_blocks > 0,
            "kv_cache_memory_gb": self.kv_cache_memory_gb > 0,
            "max_num_seqs": self.max_num_seqs > 0,
            "max_num_batched_tokens": self.max_num_batched_tokens > 0,
            "max_model_len": self.max_model_len is None or self.max_model_len > 0,
            "watermark": 0.0 <= self.watermark < 1.0,
            "device": self.device == "cpu" or self.device.startswith("cuda"),
            "gpu_memory_utilization": 0.0 < self.gpu_memory_utilization <= 1.0,
            "tensor_parallel_size": isinstance(self.tensor_parallel_size, int)
            and self.tensor_parallel_size > 0,
            "default_max_tokens": isinstance(self.default_max_tokens, int)
            and self.default_max_tokens > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid engine setting {name}={getattr(self, name)!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server runs: where it listens, whom it admits, how much it queues."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int | None = None  # 503 past this many waiting requests
    max_body_bytes: int = 4 * 2**20
    graceful_timeout: float = 3.0  # seconds open requests get to finish after SIGINT/SIGTERM
