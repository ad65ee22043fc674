"""The engine's one way to its model. An executor holds rank 0's runner and runs a method of the
runner on every rank, returning rank 0's result: `LocalExecutor` runs it in this process; under
tensor parallelism `TensorParallelExecutor` (tp.py) first sends the call to the other ranks,
each of which runs the same method on its own runner. The engine holds one and never asks which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from nanoserve.config import EngineConfig
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.parallel.tp import TensorParallelExecutor
from nanoserve.model import Checkpoint, check_divisible


class Executor(Protocol):
    runner: ModelRunner  # rank 0's: prepares each step's inputs; the pool's facts

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first (none in one process)."""
        ...

    def call(self, method: str, *args: Any) -> Any:
        """`runner.method(*args)` on every rank; rank 0's result."""
        ...

    def gather(self, method: str) -> list[int]:
        """`runner.method()` (an int) on every rank; every rank's result, rank 0 first."""
        ...

    def check(self) -> None:
        """Raise if a call can no longer run on every rank (a worker died)."""
        ...

    def close(self) -> None:
        """Stop the other ranks, if any. Idempotent."""
        ...


class LocalExecutor:
    """The model in this process only."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def pids(self) -> list[int]:
        return []

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.runner, method)(*args)

    def gather(self, method: str) -> list[int]:
        return [getattr(self.runner, method)()]

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


def start_executor(model: str | Path, checkpoint: Checkpoint, config: EngineConfig) -> Executor:
    """The executor of `config.tensor_parallel_size` ranks, their runners built."""
    size = config.tensor_parallel_size
    if size == 1:
        return LocalExecutor(ModelRunner(checkpoint, config))
    check_divisible(checkpoint.config, size)  # before any process starts
    return TensorParallelExecutor.launch(model, checkpoint, config)
