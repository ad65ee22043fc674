"""Where a GGUF load's time goes: `LLM(path)` in this process with the functions of each phase
wrapped by a timer, printed as JSON (seconds; a nested phase runs inside the one above it, and
the tokenizer runs beside the KV pool's write). A profiling aid for bench_load.py's totals; it
names internal functions, so it follows them when they move.

    python -m bench.experiments.load_phases PATH      # NANOSERVE_CACHE=empty dir: a first load
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch  # noqa: F401  (imported before the clock, as bench_load.py's loads have it)

from nanoserve import LLM

PHASES = [  # (module, function, label)
    ("nanoserve.engine.engine", "open_checkpoint", "open the file (index, config)"),
    ("nanoserve.engine.model_runner", "ModelRunner.__init__", "runner (weights, RoPE, KV alloc)"),
    ("nanoserve.model.gguf_file", "GGUFCheckpoint.read_tensors", "  read_tensors"),
    ("nanoserve.kernels.c_backend", "copy_rows", "    blocks copied (C)"),
    ("nanoserve.engine.engine", "Engine._check_pools", "memory check"),
    ("nanoserve.engine.engine", "Engine._take_pools", "KV pool written (nanoserve-take-kv)"),
    ("nanoserve.engine.engine", "Engine._use_tokenizer", "tokenizer and grammars (beside it)"),
    ("nanoserve.model.gguf_file", "GGUFCheckpoint._build_tokenizer", "  tokenizer built"),
]


def timed(times: dict[str, float], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] = times.get(label, 0.0) + time.perf_counter() - start

    return wrapper


def main() -> None:
    times: dict[str, float] = {}
    for module, name, label in PHASES:
        owner_name, _, attr = name.rpartition(".")
        module_obj = importlib.import_module(module)
        owner = getattr(module_obj, owner_name) if owner_name else module_obj
        setattr(owner, attr, timed(times, label, getattr(owner, attr)))
    start = time.perf_counter()
    LLM(sys.argv[1])
    times["LLM() in all"] = time.perf_counter() - start
    print(json.dumps({k: round(v, 4) for k, v in times.items()}, indent=1))


if __name__ == "__main__":
    main()
