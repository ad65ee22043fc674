"""nanoserve: a small LLM inference server for Llama-family models.

`LLM`, `SamplingParams` and the output types are imported on first use, so that
`nanoserve.kernels` can be imported alone (the GPU check does) without the engine's dependencies.
Importing nanoserve makes idle OpenMP threads sleep at once unless OMP_WAIT_POLICY is set.
"""

import os
from typing import Any

# An OpenMP thread that spins while it waits for the next parallel region holds a core that other
# processes need, and a thread that waits at a barrier for a sibling descheduled by them spins
# through the sibling's turn: beside other work a decode step then takes many times its share.
# Threads that sleep at once cost their fair share. libgomp reads this once, when torch loads
# it, so it is set here, before anything of nanoserve imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
