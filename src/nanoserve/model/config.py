"""What a checkpoint says about its model: `ModelConfig` from a Hugging Face `config.json` (both
the `rope_theta` + `rope_scaling` layout of the published Llama-3.2 checkpoints and the newer
`rope_parameters` layout). Frozen; imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None  # GGUF: each frequency divided by its factor


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        config = cls.from_dict(json.loads(config_file.read_text()))
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            eos = _as_ids(json.loads(generation_file.read_text()).get("eos_token_id"))
            if eos:
                config = replace(config, eos_token_ids=tuple(eos))
        return config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        architectures = d.get("architectures") or [d.get("model_type", "unknown")]
        if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            raise ValueError(
                f"unsupported architecture {architectures[0]!r}: nanoserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 3.x) only"
            )
        num_heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope=_rope_config(d),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            eos_token_ids=tuple(_as_ids(d.get("eos_token_id"))),
        )


def _rope_config(d: dict[str, Any]) -> RopeConfig:
    """`rope_parameters` (newer layout) or `rope_theta` + `rope_scaling` (Llama-3.2 files)."""
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: expected 'default' or 'llama3'")
    if rope_type == "default":
        return RopeConfig(theta=float(params.get("rope_theta", 10000.0)))
    return RopeConfig(
        theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
