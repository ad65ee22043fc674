"""nanoserve: a small LLM inference server for Llama-family models.

`LLM`, `SamplingParams` and the output types are imported on first use, so that
`nanoserve.kernels` can be imported alone (the GPU check does) without the engine's dependencies.
Importing nanoserve bounds how long idle OpenMP threads spin, unless the user set a policy.
"""

import os
from typing import Any

# An OpenMP thread that spins while it waits for the next parallel region holds a core that other
# processes need, and a thread that waits at a barrier for a sibling descheduled by them spins
# through the sibling's turn: beside other work a decode step then takes several times its share.
# Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) share fairly but wake too slowly for the
# many short parallel regions of a decode step. A short spin keeps both: measured on a 2-core
# machine (README, "A busy machine"). libgomp reads this once, when torch loads it, so it is set
# here, before anything of nanoserve imports torch.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "100000"

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
