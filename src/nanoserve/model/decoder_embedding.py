"""A decoder checkpoint opened as an embedding model (Qwen3-Embedding; vLLM's `--convert embed`):
its final hidden states are what is used, never its logits. Such checkpoints are often saved from
the bare decoder (`Qwen3Model`: tensors without the `model.` prefix, no `lm_head`), so this
checkpoint names the tensors as the causal LM's and ties the absent head to the embedding (it is
never multiplied). A sequence classifier's (Qwen3ForSequenceClassification) is its decoder's
with a `score` head, read apart (model/decoder_classifier.py). Otherwise the decoder's own
checkpoint (model/checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanoserve.model.checkpoint import HFCheckpoint
from nanoserve.model.config import POOLING_DECODERS, CheckpointError, ModelConfig, read_json
from nanoserve.model.loader import checkpoint_files, read_checkpoint
from nanoserve.model.quantized import Weight
from nanoserve.tokenizer import Tokenizer


class DecoderEmbeddingCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        d: dict[str, Any] = read_json(self.path / "config.json")
        architectures = [POOLING_DECODERS.get(a, a) for a in d.get("architectures") or []]
        names = _tensor_names(self.path)
        bare = not any(n.startswith("model.") for n in names)
        tied = d.get("tie_word_embeddings", False) or "lm_head.weight" not in names
        try:
            self.config = ModelConfig.from_dict(
                {**d, "architectures": architectures or None, "tie_word_embeddings": tied}
            )
        except ValueError as e:
            raise CheckpointError(f"{self.path / 'config.json'}: {e}") from None
        self._rename = (lambda n: n if n == "lm_head.weight" else "model." + n) if bare else str
        self._drop_head = tied

    def tokenizer(self) -> Tokenizer:
        return HFCheckpoint.tokenizer(self)  # type: ignore[arg-type]

    def block_formats(self) -> list[str]:
        return []

    def read_tensors(
        self, dtype: torch.dtype, device: str | torch.device, keep_blocks: bool = False
    ) -> dict[str, Weight]:
        tensors = {self._rename(n): t for n, t in read_checkpoint(self.path, dtype, device).items()}
        if self._drop_head:
            tensors.pop("lm_head.weight", None)
        tensors.pop("score.weight", None)  # a classifier's head: model/decoder_classifier.py
        return dict(tensors)


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names += list(f.keys())
    return names
