"""Where a model comes from: a Hugging Face checkpoint directory (config.json, safetensors,
tokenizer.json) or a GGUF file. Either gives the model config, the tokenizer and the tensors under
Hugging Face names; `open_checkpoint` picks by path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.gguf_file import GGUFCheckpoint, is_gguf
from nanoserve.model.loader import read_checkpoint
from nanoserve.tokenizer import Tokenizer


class Checkpoint(Protocol):
    config: ModelConfig

    def tokenizer(self) -> Tokenizer: ...

    def read_tensors(
        self, dtype: torch.dtype, device: str | torch.device
    ) -> dict[str, torch.Tensor]: ...


class HFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = ModelConfig.from_dir(self.path)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path)

    def read_tensors(
        self, dtype: torch.dtype, device: str | torch.device
    ) -> dict[str, torch.Tensor]:
        return read_checkpoint(self.path, dtype, device)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A GGUF file (by its .gguf suffix) or a Hugging Face checkpoint directory."""
    if not Path(path).exists():
        raise FileNotFoundError(f"no model at {path}")
    return GGUFCheckpoint(path) if is_gguf(path) else HFCheckpoint(path)
