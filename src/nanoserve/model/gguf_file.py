"""GGUF checkpoints (llama.cpp's file format): the model config from the metadata, the tokenizer
it describes, and the tensors under Hugging Face names, with the rows of the Q and K projections
put back in Hugging Face's order (llama's; llama.cpp keeps qwen2's and qwen3's as they are).
Architectures `llama`, `qwen2`, `qwen3` and `gemma3` (the families of model/config.py; a bias is
there where its tensor is, as llama.cpp loads them; Gemma 3 as llama.cpp reads its files), and the
mixtures of experts `qwen3moe`, `gpt-oss` (model/gguf_gpt_oss.py) and `llama` with `expert_count`
(Mixtral), whose experts are 3-D tensors ([experts, rows, columns]) kept in their blocks as one
run of rows, expert after expert; any other architecture, tensor type or tokenizer is refused.

The header is read by model/gguf_header.py. The scalar metadata, the tensor table and the built
tokenizer are cached (model/gguf_cache.py): only a file's first load parses its vocabulary; the
tokenizer is built when asked for (while the KV cache is written). Matrices in a format the CPU
kernels take are copied once from a memory map into huge pages (K-quants, MXFP4, Q5_0, Q5_1 and
Q8_0 repacked); the rest are de-quantized by the `gguf` package (llama.cpp's own de-quantizers)
into the engine's dtype.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch

from nanoserve.gguf_tokenizer import (
    UnsupportedTokenizer,
    check_supported,
    tokenizer_config,
    tokenizer_from_gguf,
)
from nanoserve.kernels import QUANT_TYPES, QuantizedWeight, c_backend
from nanoserve.kernels.quant import BLOCK_BYTES, BLOCK_VALUES, repack_at_load
from nanoserve.model import gguf_cache, hugepages
from nanoserve.model.config import ModelConfig, RopeConfig
from nanoserve.model.ggml_types import GGMLType
from nanoserve.model.gguf_gpt_oss import gpt_oss_config, yarn_rope
from nanoserve.model.gguf_header import TensorInfo, read_header
from nanoserve.model.quantized import Weight
from nanoserve.model.weights import LAYER, MODEL
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
Q = GGMLType
DEQUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K,
               Q.Q6_K, Q.MXFP4)  # fmt: skip
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss")
MOE_ARCHITECTURES = ("llama", "qwen3moe", "gpt-oss")  # those that may have expert_count
PERMUTED = ("llama",)  # llama.cpp's converter interleaves these architectures' Q and K rows

# GGUF tensor name -> Hugging Face name, from model/weights.py: a layer's after "blk.N." and
# "model.layers.N.", the model's own whole; an experts tensor's, the stacked name (without the
# expert's index).
LAYER_NAMES = {
    g: h.replace(".{e}", "") for _, t in LAYER for g, h in zip(t.gguf, t.hf, strict=True)
}
# Gemma 3 names a tensor otherwise (its ffn_norm is its pre_feedforward_layernorm).
GEMMA_NAMES = {**LAYER_NAMES, **{g: h for _, t in LAYER
                                 if t.renamed and t.renamed[0] == "sandwich_norms"
                                 for g, h in zip(t.gguf, t.renamed[1], strict=True)}}  # fmt: skip
TOP_NAMES = {g: h for _, t in MODEL for g, h in zip(t.gguf, t.hf, strict=True)}
ROPE_FREQS = "rope_freqs.weight"
CLASSIFIER = "cls.output.weight"  # a reranker's head (RANK pooling): model/decoder_classifier.py
NOT_LAYERS = (ROPE_FREQS, CLASSIFIER)


class GGUFError(ValueError):
    """A GGUF file nanoserve cannot serve; the message names what is unsupported."""


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        self._cache_name = gguf_cache.entry(self.path)
        self.index, self._vocabulary = _cached_index(self.path, self._cache_name)
        self.meta: dict[str, Any] = self.index["meta"]
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        self.config = self._model_config()

    def block_formats(self) -> list[str]:
        """The formats of the file's matrices that the CPU kernels take as they are."""
        kept = {Q(i["type"]) for i in self.tensors.values() if _keeps(i)}
        return sorted(q.name.lower() for q in kept)

    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer, a new one each call: read from the cache, else built from the
        file's vocabulary (and cached)."""
        t = self.index["tokenizer"]
        tok = gguf_cache.cached_tokenizer(self._cache_name, self._build_tokenizer)
        return Tokenizer(tok, t["config"], t["template"], t["max_token_chars"])

    def _build_tokenizer(self) -> tokenizers.Tokenizer:
        """From the vocabulary parsed with the index, or parsed again where the index was read
        from the cache."""
        vocabulary = self._vocabulary or _tokenizer_keys(_open(self.path)[0])
        self._vocabulary = None
        try:
            return tokenizer_from_gguf(vocabulary)[0]
        except UnsupportedTokenizer as e:
            raise GGUFError(f"{self.path.name}: {e}") from None

    def read_tensors(
        self, dtype: torch.dtype, device: str | torch.device, keep_blocks: bool = False
    ) -> dict[str, Weight]:
        """Every weight under its Hugging Face name, de-quantized to `dtype` on `device`; with
        keep_blocks, every matrix in a format the CPU kernels take (QUANT_TYPES, F16 and BF16
        too) stays in it, each in its own (a file of mixed formats, llama.cpp's Q4_K_M say, stays
        mixed), K-quants, MXFP4, Q5_0, Q5_1 and Q8_0 repacked (kernels.quant.repack_at_load). Logs
        how many matrices of each format were kept and how many de-quantized."""
        c, weights = self.config, {}
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        permuted = self.meta["general.architecture"] in PERMUTED
        gemma = self.meta["general.architecture"] == "gemma3"
        kept: dict[str, int] = {}
        repacked = 0
        dequantized: dict[str, int] = {}
        # The blocks go from the file into huge pages, a fused matrix's parts one after the other
        # (as model/quantized.py's cat_rows takes them), each byte copied once by one C call.
        keeps = [i["bytes"] for i in self.tensors.values() if keep_blocks and _keeps(i)]
        size = sum(-(-n // hugepages.ALIGN) * hugepages.ALIGN for n in keeps)
        arena = hugepages.Arena(size) if keeps else None
        copies: list[tuple[int, ...]] = []  # c_backend.copy_rows' jobs
        for name, info in sorted(self.tensors.items(), key=lambda item: _fused_order(item[0])):
            if name in NOT_LAYERS:
                continue  # in the config's rope factors, or the classifier's head
            heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(name.split(".")[-2])
            heads = heads if permuted else None
            qtype = Q(info["type"]).name.lower()
            if arena is not None and _keeps(info):
                rows = int(np.prod(info["shape"][:-1]))  # an experts tensor's: every expert's
                blocks = arena.empty((rows, info["bytes"] // rows))
                at = data.ctypes.data + info["offset"]
                repack = repack_at_load(qtype, info["shape"][-2])  # an expert's rows too
                job = (*blocks.shape, heads or 0, BLOCK_BYTES[qtype] if repack else 0)
                copies.append((blocks.data_ptr(), at, *job))
                weight = QuantizedWeight(blocks, qtype, (rows, info["shape"][-1]), repack)
                weights[_hf_name(name, gemma)] = weight
                kept[qtype], repacked = kept.get(qtype, 0) + 1, repacked + repack
                continue
            values = dequantize(data, info)
            values = _unpermute(values, heads) if heads else values
            # Gemma's (1 + w) norms stay float32 in a bfloat16 model, as transformers has them.
            own = torch.float32 if gemma and name.endswith("norm.weight") else dtype
            weights[_hf_name(name, gemma)] = torch.from_numpy(values).to(device=device, dtype=own)
            if len(info["shape"]) >= 2:
                dequantized[qtype] = dequantized.get(qtype, 0) + 1
        if copies:
            c_backend.copy_rows(copies)
        log.info(
            "%s: matrices kept in their formats: %s; de-quantized to %s: %s; repacked: %d",
            self.path.name, _counts(kept), dtype, _counts(dequantized), repacked,
        )  # fmt: skip
        return weights

    def weight_bytes(self, dtype: torch.dtype, keep_blocks: bool = False) -> int:
        """The bytes read_tensors' tensors will hold: a kept matrix's (or experts tensor's) blocks
        as in the file, every other tensor's values in `dtype`."""
        return sum(
            i["bytes"] if keep_blocks and _keeps(i) else math.prod(i["shape"]) * dtype.itemsize
            for name, i in self.tensors.items()
            if name not in NOT_LAYERS
        )

    def _get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.meta['general.architecture']}.{key}", default)

    def _model_config(self) -> ModelConfig:
        heads = self._get("attention.head_count")
        hidden = self._get("embedding_length")
        head_dim = self._get("attention.key_length") or hidden // heads
        self._check_refused(head_dim)
        eos = [self.meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        arch, has = self.meta["general.architecture"], self.tensors.__contains__
        config = ModelConfig(
            vocab_size=self._get("vocab_size") or self.index["tokenizer"]["vocab_size"],
            hidden_size=hidden,
            intermediate_size=self._get("feed_forward_length"),
            num_layers=self._get("block_count"),
            num_heads=heads,
            num_kv_heads=self._get("attention.head_count_kv") or heads,
            head_dim=head_dim,
            rms_norm_eps=self._get("attention.layer_norm_rms_epsilon", 1e-5),
            max_position_embeddings=self._get("context_length", 2048),
            rope=self._rope(head_dim),
            tie_word_embeddings="output.weight" not in self.tensors,
            eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
            family=arch,
            qkv_bias=has("blk.0.attn_q.bias"),
            o_bias=has("blk.0.attn_output.bias"),
            mlp_bias=has("blk.0.ffn_down.bias"),
            qk_norm=arch in ("qwen3", "qwen3moe"),
            **self._experts(),
        )
        if arch == "gpt-oss":
            return gpt_oss_config(config, self._get)
        return self._gemma3(config) if arch == "gemma3" else config

    def _experts(self) -> dict[str, Any]:
        """A mixture's ModelConfig fields (none without expert_count), as llama.cpp's graphs for
        these architectures compute it: softmax gating, the top experts' weights renormalized
        (unless the file's expert_weights_norm says not), each expert's MLP of
        expert_feed_forward_length (Mixtral's converter writes only feed_forward_length)."""
        experts = self._get("expert_count", 0)
        if not experts:
            return {}
        gating = self._get("expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
        if gating != 1:
            raise self._refused("expert_gating_func", gating, 1)  # 1: softmax
        used = self._get("expert_used_count")
        if isinstance(used, bool) or not isinstance(used, int) or not 0 < used <= experts:
            # Else the file loads and its first step fails in the router's top-k.
            raise GGUFError(
                f"{self.path.name}: {self.meta['general.architecture']}.expert_used_count = "
                f"{used!r} must be an integer from 1 to expert_count ({experts})"
            )
        return {
            "num_experts": experts,
            "experts_per_token": used,
            "expert_size": self._get("expert_feed_forward_length")
            or self._get("feed_forward_length"),
            "norm_topk_prob": bool(self._get("expert_weights_norm", True)),
        }

    def _gemma3(self, config: ModelConfig) -> ModelConfig:
        """Gemma 3 as llama.cpp reads its file: the converter stored each norm as 1 + w (so a
        plain RMSNorm), layer i slides over `attention.sliding_window` positions unless the file's
        `attention.sliding_window_pattern` (an int, or a flag per layer; default 6) makes it
        global, the sliding layers rotate with `rope.freq_base_swa` (default 1e4) and no scaling,
        and q.k is scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B), which is
        what llama.cpp computes whatever the checkpoint's query_pre_attn_scalar was."""
        window = self._get("attention.sliding_window") or 0
        pattern = self._get("attention.sliding_window_pattern", 6)
        layers = range(config.num_layers)
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
            if len(sliding) != config.num_layers:
                raise GGUFError(
                    f"{self.path.name}: gemma3.attention.sliding_window_pattern has "
                    f"{len(sliding)} entries for {config.num_layers} layers"
                )
        else:
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in layers]
        windows = tuple(window if s else 0 for s in sliding) if window else ()
        scalar = config.hidden_size // config.num_heads if config.num_layers == 62 else None
        cap = self._get("final_logit_softcapping")
        return replace(
            config,
            qk_norm=True,
            embed_scale=True,
            activation="gelu_pytorch_tanh",
            sandwich_norms=True,
            attn_scale=(scalar or config.head_dim) ** -0.5,
            final_logit_softcapping=float(cap) if cap else None,
            layer_windows=windows if any(windows) else (),
            local_rope=RopeConfig(theta=float(self._get("rope.freq_base_swa", 10000.0))),
        )

    def _check_refused(self, head_dim: int) -> None:
        """Refuse, naming the key, metadata that would make another model than the one run."""
        changes = {
            "rope.dimension_count": (self._get("rope.dimension_count", head_dim), head_dim),
            "attention.value_length": (self._get("attention.value_length", head_dim), head_dim),
            "attention.clamp_kqv": (self._get("attention.clamp_kqv"), None),
        }
        arch = self.meta["general.architecture"]
        if arch not in MOE_ARCHITECTURES:
            changes["expert_count"] = (self._get("expert_count", 0), 0)
        for key in ("expert_shared_count", "expert_shared_feed_forward_length"):  # Qwen2-MoE's
            changes[key] = (self._get(key), None)
        if arch not in ("gemma3", "gpt-oss"):
            # llama.cpp's converter writes none for these architectures, nor says how it applies
            changes["attention.sliding_window"] = (self._get("attention.sliding_window"), None)
        for key in ("attention.logit_softcapping", "attention.scale"):  # Gemma 2's, Granite's
            changes[key] = (self._get(key), None)
        for key, (value, implemented) in changes.items():
            if value != implemented:
                raise self._refused(key, value, implemented)

    def _refused(self, key: str, value: Any, implemented: Any) -> GGUFError:
        """The error that refuses a metadata key's value, naming it."""
        return GGUFError(
            f"{self.path.name}: {self.meta['general.architecture']}.{key} = {value!r} is not "
            f"implemented (nanoserve runs {implemented!r})"
        )

    def _rope(self, head_dim: int) -> RopeConfig:
        """The rope base, and per-frequency divisors: Llama 3.1's `rope_freqs` tensor, times a
        linear scaling factor where the file has one; or YaRN's keys (model/gguf_gpt_oss.py)."""
        factors = [1.0] * (head_dim // 2)
        if ROPE_FREQS in self.tensors:
            data = np.memmap(self.path, dtype=np.uint8, mode="r")
            factors = dequantize(data, self.tensors[ROPE_FREQS]).tolist()
        scaling = self._get("rope.scaling.type") or "none"
        theta = float(self._get("rope.freq_base", 10000.0))
        if scaling == "yarn" and ROPE_FREQS not in self.tensors:
            return yarn_rope(self._get, theta, self._refused)
        if scaling == "linear":
            factors = [f * float(self._get("rope.scaling.factor", 1.0)) for f in factors]
        elif scaling != "none":
            raise GGUFError(f"{self.path.name}: rope scaling {scaling!r} is not supported")
        scaled = set(factors) != {1.0}
        return RopeConfig(theta=theta, freq_factors=tuple(factors) if scaled else None)


def _cached_index(path: Path, cached: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The file's index, and its tokenizer's metadata where this call parsed the file (None: the
    index came from the cache)."""
    index = gguf_cache.read_index(cached)
    if index is not None:
        return index, None
    index, meta = _build_index(path)
    gguf_cache.write_index(cached, index)
    return index, _tokenizer_keys(meta)


def _build_index(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parse the file once: (its index, its metadata); refuse what nanoserve cannot serve, the
    tokenizer included (built later, from the metadata)."""
    meta, tensor_infos = _open(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: architecture {arch!r} is not supported "
            f"(nanoserve serves {', '.join(ARCHITECTURES)})"
        )
    tensors = {t.name: _tensor_info(path, t) for t in tensor_infos}
    try:
        check_supported(meta)
    except UnsupportedTokenizer as e:
        raise GGUFError(f"{path.name}: {e}") from None
    tokens = meta["tokenizer.ggml.tokens"]
    index = {
        "meta": {k: v for k, v in meta.items() if _indexed(k, v)},
        "tensors": tensors,
        "tokenizer": {
            "config": tokenizer_config(meta),
            "template": meta.get("tokenizer.chat_template"),
            # The built vocabulary is the file's tokens, each once (the added ones among them).
            "vocab_size": len(set(tokens)),
            # The longest piece bounds a token's characters without listing the built vocabulary.
            "max_token_chars": max(map(len, tokens), default=1),
        },
    }
    return index, meta


def _tokenizer_keys(meta: dict[str, Any]) -> dict[str, Any]:
    """What of the metadata the tokenizer is built from (the vocabulary's arrays among it)."""
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def _indexed(key: str, value: Any) -> bool:
    """Whether the index keeps a metadata value: not the vocabulary's arrays (the tokenizer holds
    them), but a per-layer array whatever its length."""
    return not (isinstance(value, list) and len(value) > 64 and not key.endswith("_pattern"))


def _tensor_info(path: Path, t: TensorInfo) -> dict[str, Any]:
    if t.tensor_type not in DEQUANTIZED:
        supported = ", ".join(q.name for q in DEQUANTIZED)
        raise GGUFError(
            f"{path.name}: tensor {t.name} is of type {t.tensor_type.name}, which is not "
            f"supported (nanoserve reads {supported})"
        )
    if t.data_offset + t.n_bytes > path.stat().st_size:
        raise GGUFError(f"{path.name} is truncated: tensor {t.name} ends past its end")
    if t.name not in NOT_LAYERS:
        _hf_name(t.name)  # refuses a tensor that is not part of a Llama
    shape = [int(d) for d in reversed(t.shape)]  # GGUF lists its dims innermost first
    return {"type": int(t.tensor_type), "shape": shape, "offset": int(t.data_offset),
            "bytes": int(t.n_bytes)}  # fmt: skip


def _open(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    try:
        return read_header(path)
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path.name} is truncated or is not a GGUF file ({e})") from None


def _hf_name(name: str, gemma: bool = False) -> str:
    base, _, suffix = name.rpartition(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    parts, layer = base.split("."), GEMMA_NAMES if gemma else LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{suffix}"
    raise GGUFError(f"tensor {name} is not part of a Llama model")


# A layer's GGUF tensor names in model/weights.py's order (q, k, v, ...; llama.cpp's converter
# writes them in the checkpoint's alphabetical order, k before q).
def _part_order() -> dict[str, int]:
    order: dict[str, int] = {}
    for _, t in LAYER:
        for g in t.gguf:
            order.setdefault(g, len(order))
    return order


PART_ORDER = _part_order()


def _fused_order(name: str) -> tuple[int, int]:
    """(layer, place within it) in weights.py's order; the model's own tensors first."""
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return (-1, 0)
    return (int(parts[1]), PART_ORDER.get(parts[2], len(PART_ORDER)))


def _keeps(info: dict[str, Any]) -> bool:
    """Whether a tensor stays in its format: a matrix (or experts tensor) in one of the kernels'
    formats whose rows are whole blocks."""
    shape, qtype = info["shape"], Q(info["type"]).name.lower()
    return qtype in QUANT_TYPES and len(shape) in (2, 3) and shape[-1] % BLOCK_VALUES[qtype] == 0


def _counts(counts: dict[str, int]) -> str:
    """'120 q4_k, 2 q6_k', or 'none'."""
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "none"


def dequantize(data: np.ndarray, info: dict[str, Any]) -> np.ndarray:
    """A tensor's values as float32 in [rows, columns] order, from the file's memory map."""
    qtype, shape = Q(info["type"]), tuple(info["shape"])
    raw = data[info["offset"] : info["offset"] + info["bytes"]]
    if qtype in (Q.F32, Q.F16):
        values = raw.view(np.float32 if qtype == Q.F32 else np.float16).astype(np.float32)
    else:
        import gguf  # here: a file whose matrices the kernels all keep loads without it

        gtype = gguf.GGMLQuantizationType(qtype)
        byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, gtype)
        values = gguf.quants.dequantize(raw.reshape(byte_shape), gtype).astype(np.float32)
    return values.reshape(shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's two rotary halves row-wise:
    its row (h, i, j) of [heads, head_dim / 2, 2] is Hugging Face's row (h, j, i)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
