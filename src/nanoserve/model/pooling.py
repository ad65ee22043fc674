"""How an embedding model turns its last hidden states into one vector, read from the checkpoint:
sentence-transformers' `modules.json` (a Transformer, a Pooling, a Normalize), its pooling's
`config.json` (either layout: `pooling_mode` or the `pooling_mode_*_token(s)` flags), its
`sentence_bert_config.json` (max_seq_length, do_lower_case), config.json's Matryoshka keys
(`matryoshka_dimensions`, `is_matryoshka`) and `config_sentence_transformers.json`'s `prompts`
and `default_prompt_name`; defaults by model kind where a file is absent. A GGUF file's is its
`<arch>.pooling_type` (`gguf_pooling`). A module or mode that would change the vector and is
not implemented is refused by name. `pool` applies it. Frozen; owns nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nanoserve.model.config import CheckpointError, read_json

POOLING_MODES = ("cls", "mean", "lasttoken")
# The old layout's flags, as sentence-transformers' Pooling reads them.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
}
REFUSED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens")  # fmt: skip
# llama.cpp's LLAMA_POOLING_TYPE_*: those that give one vector, and those refused.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
GGUF_RANK = 4  # a reranker's score: a decoder's classifier head on its last token
GGUF_REFUSED = {0: "NONE (a vector per token)", GGUF_RANK: "RANK (a reranker's score)"}
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
               "torch.nn.modules.linear.Identity": "identity"}  # fmt: skip


@dataclass(frozen=True)
class Pooling:
    mode: str  # one of POOLING_MODES
    normalize: bool
    matryoshka: tuple[int, ...] | None = None  # dimensions a request may ask for; () any
    max_seq_length: int | None = None  # sentence-transformers' truncation: the context here
    lower_case: bool = False  # sentence-transformers lower-cases the text first
    activation: str = "sigmoid"  # of a cross-encoder's scores: sigmoid or identity
    # sentence-transformers' prompts by name, put before a text (a pair's first), and the one
    # put when a request names none ("" for none).
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str = ""


def read_pooling(path: str | Path, default_mode: str) -> Pooling:
    """The checkpoint's pooling, or `default_mode` normalized where it has no modules.json."""
    path = Path(path)
    config = read_json(path / "config.json")
    matryoshka = _matryoshka(config, path)
    st = _json(path / "sentence_bert_config.json")
    max_len = st.get("max_seq_length")
    lower = bool(st.get("do_lower_case", False))
    activation = _activation(path)
    prompts, default_prompt = _prompts(path)
    default = Pooling(default_mode, True, matryoshka, max_len, lower, activation, prompts,
                      default_prompt)  # fmt: skip
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return default
    modules = _modules(modules_file)
    mode, normalize = default_mode, False
    for module in modules[1:]:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            mode = _pooling_mode(path / str(module.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise CheckpointError(f"{modules_file}: module {module.get('type')!r} is not "
                                  "implemented (Transformer, Pooling, Normalize)")  # fmt: skip
    return replace(default, mode=mode, normalize=normalize)


def gguf_pooling(
    meta: dict[str, Any], default_mode: str, file: str, ranks: bool = False
) -> Pooling:
    """A GGUF's pooling: its `<arch>.pooling_type` (else `default_mode`), normalized as
    llama.cpp's server normalizes embeddings (the file does not say whether the checkpoint had a
    Normalize module); RANK where `ranks` (a decoder's: the last token, for the classifier head).
    CheckpointError naming the key for a type that is not implemented."""
    key = f"{meta.get('general.architecture')}.pooling_type"
    value = meta.get(key)
    if value is None:
        return Pooling(default_mode, True)
    if value == GGUF_RANK and ranks:
        return Pooling("lasttoken", False)
    if value not in GGUF_POOLING:
        what = GGUF_REFUSED.get(value, "unknown")
        raise CheckpointError(f"{file}: {key} = {value!r}, {what}, is not implemented (1 MEAN, "
                              "2 CLS, 3 LAST)")  # fmt: skip
    return Pooling(GGUF_POOLING[value], True)


def pool(h: torch.Tensor, lengths: list[int], pooling: Pooling) -> torch.Tensor:
    """One float32 vector per packed sequence of h [num_tokens, hidden]."""
    ends = torch.tensor(lengths).cumsum(0)
    starts = ends - torch.tensor(lengths)
    if pooling.mode == "cls":
        out = h[starts].float()
    elif pooling.mode == "lasttoken":
        out = h[ends - 1].float()
    else:
        out = torch.stack([h[s:e].float().mean(0) for s, e in zip(starts, ends, strict=True)])
    return F.normalize(out, dim=-1) if pooling.normalize else out


def _modules(file: Path) -> list[dict[str, Any]]:
    try:
        modules = json.loads(file.read_text("utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(modules, list) or not modules:
        raise CheckpointError(f"{file}: expected a list of modules")
    modules.sort(key=lambda m: m.get("idx", 0))
    if not str(modules[0].get("type", "")).endswith("Transformer"):
        raise CheckpointError(f"{file}: the first module must be a Transformer, got "
                              f"{modules[0].get('type')!r}")  # fmt: skip
    return modules


def _pooling_mode(file: Path) -> str:
    config = read_json(file)
    if config.get("include_prompt") is False:  # the prompt's tokens left out of the pooling
        raise CheckpointError(f"{file}: include_prompt false is not implemented")
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        if mode not in POOLING_MODES:
            raise CheckpointError(f"{file}: pooling_mode {mode!r} is not implemented "
                                  f"({', '.join(POOLING_MODES)})")  # fmt: skip
        return str(mode)
    refused = [k for k in REFUSED_FLAGS if config.get(k)]
    modes = [mode for key, mode in POOLING_FLAGS.items() if config.get(key)]
    if refused or len(modes) != 1:
        what = refused[0] if refused else f"{len(modes)} pooling modes"
        raise CheckpointError(f"{file}: {what} is not implemented (one of "
                              f"{', '.join(POOLING_FLAGS)})")  # fmt: skip
    return modes[0]


def _matryoshka(config: dict[str, Any], path: Path) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not all(type(d) is int and d > 0 for d in dims):
            raise CheckpointError(f"{path / 'config.json'}: matryoshka_dimensions must be a "
                                  f"list of integers > 0, got {dims!r}")  # fmt: skip
        return tuple(dims)
    return () if config.get("is_matryoshka") else None


def _activation(path: Path) -> str:
    """A cross-encoder's activation of its scores (sentence-transformers' CrossEncoder:
    config_sentence_transformers.json's activation_fn; sigmoid for one label by default)."""
    name = _json(path / "config_sentence_transformers.json").get("activation_fn")
    if name is None:
        return "sigmoid"
    if name not in ACTIVATIONS:
        file = path / "config_sentence_transformers.json"
        raise CheckpointError(f"{file}: activation_fn {name!r} is not implemented "
                              f"({', '.join(ACTIVATIONS)})")  # fmt: skip
    return ACTIVATIONS[name]


def _prompts(path: Path) -> tuple[dict[str, str], str]:
    """config_sentence_transformers.json's prompts (None read as "", as sentence-transformers
    does) and the default one's text."""
    file = path / "config_sentence_transformers.json"
    config = _json(file)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(v, str | None) for v in prompts.values()
    ):
        raise CheckpointError(f"{file}: prompts must map names to texts, got {prompts!r}")
    prompts = {str(k): v or "" for k, v in prompts.items()}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise CheckpointError(f"{file}: default_prompt_name {default!r} is not one of prompts "
                              f"({', '.join(prompts) or 'none'})")  # fmt: skip
    return prompts, prompts[default] if default is not None else ""


def _json(file: Path) -> dict[str, Any]:
    return read_json(file) if file.is_file() else {}
