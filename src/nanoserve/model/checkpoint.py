"""Where a model comes from: a Hugging Face checkpoint directory (config.json, safetensors,
tokenizer.json) or a GGUF file. Either gives the model config, the tokenizer and the tensors under
Hugging Face names; `open_checkpoint` picks by path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from nanoserve.model import gpt_oss
from nanoserve.model.config import CheckpointError, ModelConfig
from nanoserve.model.loader import check_tensors, read_checkpoint, tensor_bytes
from nanoserve.model.quantized import Weight
from nanoserve.tokenizer import Tokenizer


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig

    def tokenizer(self) -> Tokenizer: ...

    def block_formats(self) -> list[str]:
        """Block formats of its matrices that the CPU kernels take as they are (GGUF)."""
        ...

    def read_tensors(
        self, dtype: torch.dtype, device: str | torch.device, keep_blocks: bool = False
    ) -> dict[str, Weight]:
        """Every tensor under its Hugging Face name; with keep_blocks, a matrix stored in a block
        format the CPU kernels take stays in its blocks."""
        ...

    def weight_bytes(self, dtype: torch.dtype, keep_blocks: bool = False) -> int:
        """The bytes read_tensors' tensors will hold (from the files' headers alone)."""
        ...


class HFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        """Reads config.json and checks that the tokenizer and the weights are there, and the
        weights' names, dtypes and shapes, so that a broken directory is refused before anything
        loads."""
        self.path = Path(path)
        self.config = ModelConfig.from_dir(self.path)
        if not (self.path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{self.path}: no tokenizer.json (nanoserve reads Hugging Face fast tokenizers)"
            )
        self.formats = check_tensors(self.path, self.config)

    def tokenizer(self) -> Tokenizer:
        try:
            return Tokenizer.from_dir(self.path)
        except Exception as e:  # the tokenizers library raises bare Exceptions
            raise CheckpointError(f"{self.path}: cannot read its tokenizer ({e})") from None

    def block_formats(self) -> list[str]:
        return self.formats  # gpt-oss's MXFP4 experts (model/hf_mxfp4.py)

    def read_tensors(
        self, dtype: torch.dtype, device: str | torch.device, keep_blocks: bool = False
    ) -> dict[str, Weight]:
        raw = read_checkpoint(self.path, dtype, device)
        if self.config.gpt_oss:
            return gpt_oss.as_kept(raw, dtype, keep_blocks)
        return dict(raw)

    def weight_bytes(self, dtype: torch.dtype, keep_blocks: bool = False) -> int:
        return tensor_bytes(self.path, dtype, keep_blocks)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A GGUF file (by its .gguf suffix) or a Hugging Face checkpoint directory."""
    if not Path(path).exists():
        raise FileNotFoundError(f"no model at {path}")
    if Path(path).suffix.lower() != ".gguf":
        return HFCheckpoint(path)
    # Imported here: a Hugging Face checkpoint needs no gguf package (the GPU check's machine).
    from nanoserve.model.gguf_file import GGUFCheckpoint

    return GGUFCheckpoint(path)
