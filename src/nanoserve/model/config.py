"""What a checkpoint says about its model: `ModelConfig` from a Hugging Face `config.json` (both
the `rope_theta` + `rope_scaling` layout of the published Llama-3.2 checkpoints and the newer
`rope_parameters` layout), every field checked here: a `CheckpointError` names the file and the
field. Frozen; imports no torch, so the command line checks a checkpoint before torch loads.
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
        """The config.json of a checkpoint directory, with generation_config.json's EOS ids;
        raises CheckpointError naming the file and the field at fault."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        data = read_json(config_file)
        try:
            config = cls.from_dict(data)
        except ValueError as e:
            raise CheckpointError(f"{config_file}: {e}") from None
        eos = _generation_eos(path / "generation_config.json")
        return replace(config, eos_token_ids=tuple(eos)) if eos else config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Raises ValueError naming the config.json key that is missing or out of range."""
        _check_architecture(d)
        hidden, num_heads = _positive_int(d, "hidden_size"), _positive_int(d, "num_attention_heads")
        num_kv_heads = _positive_int(d, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if d.get("head_dim") is None and hidden % num_heads:
            raise ValueError(
                f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({num_heads}) "
                "when head_dim is not given"
            )
        return cls(
            vocab_size=_positive_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(d, "intermediate_size"),
            num_layers=_positive_int(d, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_positive_int(d, "head_dim", hidden // num_heads),
            rms_norm_eps=_positive_number(d, "rms_norm_eps", 1e-5),
            max_position_embeddings=_positive_int(d, "max_position_embeddings", 2048),
            rope=_rope_config(d),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            eos_token_ids=tuple(_as_ids(d.get("eos_token_id"))),
        )


class CheckpointError(ValueError):
    """A checkpoint file nanoserve cannot use; the message starts with the file's path."""


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`; CheckpointError naming the file if it is not one."""
    try:
        data = json.loads(file.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {json.dumps(data)[:40]}")
    return data


def _generation_eos(file: Path) -> list[int]:
    """The EOS ids a generation_config.json names (they override config.json's)."""
    if not file.is_file():
        return []
    generation = read_json(file)
    try:
        return _as_ids(generation.get("eos_token_id"))
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None


def _check_architecture(d: dict[str, Any]) -> None:
    architectures = d.get("architectures") or [d.get("model_type", "unknown")]
    if not isinstance(architectures, list):
        raise ValueError(f"architectures must be a list, got {architectures!r}")
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ValueError(
            f"unsupported architecture {architectures[0]!r}: nanoserve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 3.x) only"
        )


def _positive_int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """d[key] (or `default` where it is absent or null) as an integer > 0."""
    value = _value(d, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be an integer > 0, got {value!r}")
    return value


def _positive_number(
    d: dict[str, Any], key: str, default: float | None = None, section: str = ""
) -> float:
    value = _value(d, key, default, section)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{section}{key} must be a number > 0, got {value!r}")
    return float(value)


def _value(d: dict[str, Any], key: str, default: Any, section: str = "") -> Any:
    value = d.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{section}{key} is missing")
        return default
    return value


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _rope_config(d: dict[str, Any]) -> RopeConfig:
    """`rope_parameters` (newer layout) or `rope_theta` + `rope_scaling` (Llama-3.2 files)."""
    section = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    params = d.get(section) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{section} must be a JSON object, got {params!r}")
    section += "."
    theta = _positive_number(d, "rope_theta", 10000.0)
    theta = _positive_number(params, "rope_theta", theta, section)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: expected 'default' or 'llama3'")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=_positive_number(params, "factor", section=section),
        low_freq_factor=_positive_number(params, "low_freq_factor", 1.0, section),
        high_freq_factor=_positive_number(params, "high_freq_factor", 4.0, section),
        original_max_position_embeddings=int(
            _positive_number(params, "original_max_position_embeddings", 8192, section)
        ),
    )


def _as_ids(value: Any) -> list[int]:
    """An eos_token_id: null, one id, or a list of them."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return ids
