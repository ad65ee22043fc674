"""A BERT-family encoder's config.json (`BertModel`; `BertForSequenceClassification`, a
cross-encoder): every key that changes the computation read, or refused by name; the check of
any checkpoint directory's config.json by its kind (`check_checkpoint_config`); and a GGUF
file's kind (`gguf_kind`: its architecture and pooling_type). Imports no torch: the command line
checks a checkpoint before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.model.config import POOLING_DECODERS, CheckpointError, ModelConfig, read_json

ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")  # hidden_act


@dataclass(frozen=True)
class BertConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    num_labels: int  # of the classifier (BertForSequenceClassification); 0 without one

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        """ValueError naming the key nanoserve cannot compute as transformers would."""
        architecture = (d.get("architectures") or ["BertModel"])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(f"architectures {architecture!r}: nanoserve's encoders are "
                             f"{', '.join(ARCHITECTURES)}")  # fmt: skip
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {d['position_embedding_type']!r} is not "
                             "implemented (absolute only)")  # fmt: skip
        for key in ("is_decoder", "add_cross_attention"):
            if d.get(key):
                raise ValueError(f"{key} is not implemented (an encoder only)")
        act = d.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not implemented ({', '.join(ACTIVATIONS)})")
        hidden, heads = _int(d, "hidden_size"), _int(d, "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads")
        labels = 0
        if architecture == "BertForSequenceClassification":
            labels = len(d["id2label"]) if d.get("id2label") else _int(d, "num_labels", 2)
        return cls(
            architecture=architecture,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden,
            num_layers=_int(d, "num_hidden_layers"),
            num_heads=heads,
            intermediate_size=_int(d, "intermediate_size"),
            hidden_act=act,
            max_position_embeddings=_int(d, "max_position_embeddings", 512),
            type_vocab_size=_int(d, "type_vocab_size", 2),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            num_labels=labels,
        )


def check_checkpoint_config(path: Path) -> None:
    """A checkpoint directory's config.json checked as its kind's: a BERT encoder's, an
    embedding model's bare decoder's, a sequence classifier's decoder's, or a decoder's;
    CheckpointError naming the file."""
    data = read_json(path / "config.json")
    architecture = (data.get("architectures") or [None])[0]
    try:
        if is_encoder(path):
            BertConfig.from_dict(data)
        elif architecture in POOLING_DECODERS:
            ModelConfig.from_dict({**data, "architectures": [POOLING_DECODERS[architecture]]})
        else:
            ModelConfig.from_dir(path)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def is_encoder(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a BERT-family encoder (by its architectures), or a
    GGUF file does (architecture `bert`)."""
    if Path(path).is_file():
        return gguf_kind(path)[0] == "bert"
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    architectures = read_json(file).get("architectures") or []
    return bool(architectures) and architectures[0] in ARCHITECTURES


def gguf_kind(path: str | Path) -> tuple[str | None, int | None]:
    """A GGUF file's general.architecture and <architecture>.pooling_type (None where absent: a
    generative model's file has none); (None, None) for a file that is no GGUF, which its
    loader then refuses with the reason."""
    from nanoserve.model.gguf_header import read_header

    try:
        meta = read_header(Path(path))[0]
    except (ValueError, OSError):
        return None, None
    arch = meta.get("general.architecture")
    return arch, meta.get(f"{arch}.pooling_type")


def _int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be an integer > 0, got {value!r}")
    return value
