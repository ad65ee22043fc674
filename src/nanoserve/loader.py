"""Reads a checkpoint's weights: `model.safetensors`, or shards listed in
`model.safetensors.index.json`. Returns Hugging Face names mapped to tensors cast to the engine's
dtype; owns nothing after loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {path}; "
        "nanoserve loads Hugging Face checkpoints in safetensors format"
    )


def load_weights(
    path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, cast to `dtype` on `device`, one tensor at a time."""
    weights: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names = f.keys()
            for name in names:
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return weights
