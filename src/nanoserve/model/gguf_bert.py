"""A BERT encoder from a GGUF file as llama.cpp's converter writes it (architecture `bert`): its
BertConfig from the bert.* keys, its tensors under transformers' BertModel names (every tensor
de-quantized at load to the encoder's float dtype, logged: its matmuls are oneDNN's, not the
block kernels'), and its WordPiece tokenizer (gguf_tokenizer.py). A key or tensor that would
change the computation and is not implemented is refused by name; so is a cross-encoder's file,
whose classifier reads BERT's pooler, which the converter drops. Owns nothing after a load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoserve.gguf_tokenizer import UnsupportedTokenizer, tokenizer_from_gguf
from nanoserve.model.bert_config import BertConfig
from nanoserve.model.ggml_types import GGMLType
from nanoserve.model.gguf_file import DEQUANTIZED, GGUFError, dequantize
from nanoserve.model.gguf_header import TensorInfo, read_header
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# GGUF tensor name (without .weight / .bias) -> transformers' BertModel name.
TOP_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
LAYER_NAMES = {  # after blk.N. / encoder.layer.N.
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}


class GGUFBert:
    def __init__(self, path: str | Path) -> None:
        """The file's header read and checked; GGUFError naming what is not implemented."""
        self.path = Path(path)
        try:
            self.meta, infos = read_header(self.path)
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path.name} is truncated or is not a GGUF file ({e})") from None
        if self.meta.get("general.architecture") != "bert":
            raise GGUFError(f"{self.path.name}: architecture "
                            f"{self.meta.get('general.architecture')!r} is not bert")  # fmt: skip
        # Before the weights load: the converter writes (XLM-)RoBERTa as `bert` too, with their
        # own tokenizers and position offsets, which are not implemented.
        kind = self.meta.get("tokenizer.ggml.model")
        if kind != "bert":
            raise GGUFError(f"{self.path.name}: tokenizer.ggml.model = {kind!r} in a bert file "
                            "is not implemented (BERT's WordPiece, 'bert', only)")  # fmt: skip
        self.tensors = {_hf_name(self.path, t.name): t for t in infos}
        for t in self.tensors.values():
            if t.tensor_type not in DEQUANTIZED:
                raise GGUFError(f"{self.path.name}: tensor {t.name} is of type "
                                f"{t.tensor_type.name}, which is not supported")  # fmt: skip
        self.config = self._config()

    def _get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"bert.{key}", default)

    def _config(self) -> BertConfig:
        if self._get("attention.causal", False):
            raise GGUFError(f"{self.path.name}: bert.attention.causal = True is not implemented "
                            "(an encoder attends both ways)")  # fmt: skip
        words = self.tensors.get("embeddings.word_embeddings.weight")
        types = self.tensors.get("embeddings.token_type_embeddings.weight")
        d = {
            "architectures": ["BertModel"],
            "vocab_size": int(words.shape[-1]) if words else None,
            "hidden_size": self._get("embedding_length"),
            "num_hidden_layers": self._get("block_count"),
            "num_attention_heads": self._get("attention.head_count"),
            "intermediate_size": self._get("feed_forward_length"),
            "max_position_embeddings": self._get("context_length", 512),
            "type_vocab_size": int(types.shape[-1]) if types else 1,
            "layer_norm_eps": self._get("attention.layer_norm_epsilon", 1e-12),
            # The file does not say; BERT's own (transformers' default, exact GELU).
            "hidden_act": "gelu",
        }
        try:
            return BertConfig.from_dict(d)
        except ValueError as e:
            raise GGUFError(f"{self.path.name}: the bert.* metadata gives {e}") from None

    def read_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every tensor under its BertModel name, de-quantized to `dtype` on the CPU."""
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        weights, formats = {}, dict[str, int]()
        for name, t in self.tensors.items():
            values = dequantize(data, _info(t))
            weights[name] = torch.from_numpy(values).to(dtype)
            kind = t.tensor_type.name.lower()
            formats[kind] = formats.get(kind, 0) + 1
        listed = ", ".join(f"{n} {k}" for k, n in sorted(formats.items()))
        log.info("%s: %d tensors (%s) de-quantized to %s", self.path.name, len(weights), listed,
                 dtype)  # fmt: skip
        return weights

    def tokenizer(self) -> Tokenizer:
        try:
            tok, config, _ = tokenizer_from_gguf(self.meta)
        except UnsupportedTokenizer as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        return Tokenizer(tok, config)


def _hf_name(path: Path, name: str) -> str:
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"encoder.layer.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    if parts[0] == "cls":
        raise GGUFError(f"{path.name}: tensor {name}: a classifier's file is not implemented "
                        "(llama.cpp's converter drops BERT's pooler, which the classifier "
                        "reads: its scores would not be the checkpoint's)")  # fmt: skip
    raise GGUFError(f"{path.name}: tensor {name} is not part of a BERT encoder")


def _info(t: TensorInfo) -> dict[str, Any]:
    """gguf_file's description of a tensor: [rows, columns] order (GGUF lists dims innermost
    first)."""
    shape = [int(d) for d in reversed(t.shape)]
    return {"type": int(GGMLType(t.tensor_type)), "shape": shape,
            "offset": int(t.data_offset), "bytes": int(t.n_bytes)}  # fmt: skip
