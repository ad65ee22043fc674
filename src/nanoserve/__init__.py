"""nanoserve: a small LLM inference server for Llama-family models.

`LLM`, `SamplingParams` and the output types are imported on first use, so that
`nanoserve.kernels` can be imported alone (the GPU check does) without the engine's dependencies.
Importing nanoserve bounds how long idle OpenMP threads spin, unless the user set a policy.
"""

from typing import Any

from nanoserve import env

env.set_openmp_defaults()  # before anything of nanoserve imports torch, which loads libgomp

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

_HOMES = {
    "LLM": "nanoserve.llm",
    "CompletionOutput": "nanoserve.engine.outputs",
    "RequestOutput": "nanoserve.engine.outputs",
    "SamplingParams": "nanoserve.engine.sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
