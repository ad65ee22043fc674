"""What a checkpoint says about its model: `ModelConfig` from a Hugging Face `config.json` (both
the `rope_theta` + `rope_scaling` layout of the published Llama-3.2 checkpoints and the newer
`rope_parameters` layout), every field checked here: a `CheckpointError` names the file and the
field. The families (Llama, Mistral, Qwen2, Qwen3) are options of one decoder; a key that would
change the computation in a way nanoserve does not implement is refused by name. Gemma 3 text
(`Gemma3ForCausalLM`) is the same decoder with its options: (1 + w) norms, a scaled embedding,
GELU-tanh, four norms a layer, and sliding-window layers with their own RoPE. Frozen; imports no
torch, so the command line checks a checkpoint before torch loads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nanoserve.model.config_fields import as_ids, flag, positive_int, positive_number
from nanoserve.model.config_moe import gpt_oss_fields, moe_fields

# architectures entry -> model_type: the families the one decoder runs.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",  # Llama's computation; a sliding window caps the context
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    # Mixtures of experts: the decoder's attention (Mistral's; Qwen3's), a sparse MoE block in
    # place of every layer's MLP (model/moe.py).
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Attention sinks, biases everywhere, a clamped SwiGLU (model/gpt_oss.py), alternating
    # sliding-window and full layers, YaRN.
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# The bare decoders embedding checkpoints are saved from (Qwen3-Embedding): their causal LM's
# computation up to the final norm (model/decoder_embedding.py).
BARE_DECODERS = {"LlamaModel": "LlamaForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
                 "Qwen3Model": "Qwen3ForCausalLM"}  # fmt: skip
# Decoders with a classification head (a Qwen3-Reranker converted to one label): their causal
# LM's computation up to the final norm, then the head (model/decoder_classifier.py).
SEQUENCE_CLASSIFIERS = {"Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
POOLING_DECODERS = {**BARE_DECODERS, **SEQUENCE_CLASSIFIERS}
ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None  # GGUF: each frequency divided by its factor
    # YaRN (rope_type "yarn"): the band between beta_slow and beta_fast rotations is blended from
    # interpolated to kept frequencies; cos and sin are scaled by attention_factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


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
    family: str = "llama"  # a model_type of FAMILIES
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection adds one (Llama's attention_bias)
    mlp_bias: bool = False  # gate, up and down add one (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm of each head of q and of k before RoPE (Qwen3)
    # Gemma 3's options (model/llama.py says where each applies).
    norm_plus_one: bool = False  # every RMSNorm scales by (1 + w): folded into w at load
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    sandwich_norms: bool = False  # RMSNorm of the attention's and the MLP's outputs too
    attn_scale: float | None = None  # of q.k; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Sliding-window attention computed as such, a window per layer (0: the layer attends to
    # every position); empty where no layer is windowed (Gemma 3's sliding layers, Mistral 7B
    # v0.1's window, Qwen2's use_sliding_window). Each windowed layer rotates by local_rope where
    # there is one (Gemma 3), the others by rope.
    layer_windows: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None
    # A mixture of experts (0 experts: a dense MLP): every layer's MLP is `num_experts` SwiGLU
    # experts of `expert_size`, of which a router picks `experts_per_token` per token, their
    # weights renormalized to sum to 1 where `norm_topk_prob` (model/moe.py).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk_prob: bool = False
    # gpt-oss's experts: gate clamped above and up on both sides at swiglu_limit, then
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate); 0: Qwen3-MoE's and Mixtral's SwiGLU.
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    @property
    def gpt_oss(self) -> bool:
        """Attention sinks, a router with a bias, experts with biases stored as gpt-oss's."""
        return self.family == "gpt_oss"

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense(self) -> bool:
        return self.num_experts == 0

    @property
    def mixtral_names(self) -> bool:
        """A Hugging Face Mixtral checkpoint names the MoE block `block_sparse_moe` (w1, w2, w3)."""
        return self.family == "mixtral"

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
        """Raises ValueError naming the config.json key that is missing or out of range, or
        that asks for what nanoserve does not implement."""
        family = _family(d)
        _check_refused(d, family)
        if family == "gemma3_text":
            return _gemma3(cls, d)
        hidden, num_heads = positive_int(d, "hidden_size"), positive_int(d, "num_attention_heads")
        num_kv_heads = positive_int(d, "num_key_value_heads", num_heads)
        attention_bias = family != "qwen2" and flag(d, "attention_bias", False)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim_default = 128 if family == "qwen3" else None  # Qwen3Config's default
        moe = moe_fields(d, family)
        if d.get("head_dim") is None and head_dim_default is None and hidden % num_heads:
            raise ValueError(
                f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({num_heads}) "
                "when head_dim is not given"
            )
        return cls(
            vocab_size=positive_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=positive_int(d, "intermediate_size"),
            num_layers=positive_int(d, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=positive_int(d, "head_dim", head_dim_default or hidden // num_heads),
            rms_norm_eps=positive_number(d, "rms_norm_eps", 1e-6),
            max_position_embeddings=positive_int(d, "max_position_embeddings", 2048),
            rope=_rope_config(d),
            tie_word_embeddings=flag(d, "tie_word_embeddings", False),
            eos_token_ids=tuple(as_ids(d.get("eos_token_id"))),
            family=family,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=family == "llama" and flag(d, "mlp_bias", False),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            layer_windows=_layer_windows(d, family),
            **moe,
            **gpt_oss_fields(d, family),
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
        return as_ids(generation.get("eos_token_id"))
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None


def _family(d: dict[str, Any]) -> str:
    """The model_type of the first architecture nanoserve runs (or of model_type alone, where the
    config lists no architectures)."""
    architectures = d.get("architectures")
    if architectures is None:
        model_type = d.get("model_type")
        if model_type in FAMILIES.values():
            return str(model_type)
        architectures = [model_type or "unknown"]
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(f"architectures must be a non-empty list, got {architectures!r}")
    for a in architectures:
        if a in FAMILIES:
            return FAMILIES[a]
    raise ValueError(
        f"unsupported architecture {architectures[0]!r}: nanoserve runs "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_refused(d: dict[str, Any], family: str) -> None:
    """Refuse, naming the key, what would compute another model than the one implemented."""
    if d.get("quantization_config") is not None:
        method = d["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else method
        if not (family == "gpt_oss" and method == "mxfp4"):  # its experts' blocks: hf_mxfp4.py
            raise ValueError(
                f"quantization_config ({method}) is not supported: nanoserve loads float32, "
                "bfloat16 and float16 checkpoints, gpt-oss's MXFP4 experts (and GGUF files)"
            )
    layer_types = d.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ValueError(f"layer_types must be a list, got {layer_types!r}")
    other = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
    if other:
        raise ValueError(f"layer_types {other[0]!r} is not implemented")
    if family == "gemma3_text":
        _check_gemma3_refused(d)
        return
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not implemented (nanoserve runs silu)")


def _check_gemma3_refused(d: dict[str, Any]) -> None:
    """Gemma 3's keys that would change the computation beyond what nanoserve implements."""
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not implemented (gelu_pytorch_tanh)")
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not implemented (only null, as in Gemma 3)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not implemented (causal only)")
    layer_types = d.get("layer_types")
    if layer_types is not None and len(layer_types) != d.get("num_hidden_layers"):
        raise ValueError(f"layer_types has {len(layer_types)} entries, not num_hidden_layers")


def _gemma3(cls: type[ModelConfig], d: dict[str, Any]) -> ModelConfig:
    """Gemma3TextConfig's fields, with its defaults (for a config.json that leaves any out):
    layer i is sliding unless (i + 1) is a multiple of sliding_window_pattern (6) where
    layer_types is absent; the global layers' RoPE from rope_theta (1e6) and rope_scaling, the
    sliding ones' from rope_local_base_freq (1e4), or both from rope_parameters' sections."""
    hidden, heads = positive_int(d, "hidden_size"), positive_int(d, "num_attention_heads")
    kv_heads = positive_int(d, "num_key_value_heads", heads)
    layers = positive_int(d, "num_hidden_layers")
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    windows = _gemma3_windows(d, layers)
    rope, local_rope = _gemma3_ropes(d)
    attention_bias = flag(d, "attention_bias", False)
    cap = d.get("final_logit_softcapping")
    cap = None if cap is None else positive_number(d, "final_logit_softcapping")
    return cls(
        vocab_size=positive_int(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive_int(d, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=positive_int(d, "head_dim", 256),
        rms_norm_eps=positive_number(d, "rms_norm_eps", 1e-6),
        max_position_embeddings=positive_int(d, "max_position_embeddings", 131072),
        rope=rope,
        tie_word_embeddings=flag(d, "tie_word_embeddings", True),
        eos_token_ids=tuple(as_ids(d.get("eos_token_id"))),
        family="gemma3_text",
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=True,
        norm_plus_one=True,
        embed_scale=True,
        activation="gelu_pytorch_tanh",
        sandwich_norms=True,
        attn_scale=positive_number(d, "query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcapping=cap,
        layer_windows=windows if any(windows) else (),
        local_rope=local_rope,
    )


def _gemma3_windows(d: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: a global layer), from layer_types or, where it is absent,
    from sliding_window_pattern (every pattern-th layer is global)."""
    pattern = positive_int(d, "sliding_window_pattern", 6)
    types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    window = positive_int(d, "sliding_window", 4096)
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _gemma3_ropes(d: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """The global layers' RoPE and the sliding layers': from rope_parameters' per-layer-type
    sections, else from rope_theta and rope_scaling, and rope_local_base_freq."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = {"rope_theta": 1e6, "rope_parameters": params.get("full_attention") or {}}
        local = {"rope_theta": 1e4, "rope_parameters": params.get("sliding_attention") or {}}
    else:
        full = {"rope_theta": d.get("rope_theta") or 1e6, "rope_parameters": params,
                "rope_scaling": d.get("rope_scaling")}  # fmt: skip
        local = {"rope_theta": d.get("rope_local_base_freq") or 1e4}
    try:
        rope = _rope_config({**full, "max_position_embeddings": d.get("max_position_embeddings")})
    except ValueError as e:
        raise ValueError(f"full_attention layers: {e}") from None
    try:
        local_rope = _rope_config(local)
    except ValueError as e:
        raise ValueError(f"sliding_attention layers: {e}") from None
    return rope, local_rope


def _layer_windows(d: dict[str, Any], family: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), or () where no layer has one: Mistral's
    sliding_window on every layer, layer_types' sliding_attention layers, or Qwen2's and Qwen3's
    from layer max_window_layers on when use_sliding_window (as transformers reads them)."""
    if d.get("sliding_window") is None:
        return ()
    window, layers = positive_int(d, "sliding_window"), positive_int(d, "num_hidden_layers")
    if family in ("mistral", "mixtral"):
        windowed = [True] * layers
    elif family == "qwen3_moe":  # transformers keeps its window only with use_sliding_window
        windowed = [bool(d.get("use_sliding_window"))] * layers
    elif d.get("layer_types"):
        windowed = [t == "sliding_attention" for t in d["layer_types"]]
    elif d.get("use_sliding_window"):
        windowed = [i >= d.get("max_window_layers", 0) for i in range(layers)]
    else:
        windowed = [False] * layers
    return tuple(window if w else 0 for w in windowed) if any(windowed) else ()


def _rope_config(d: dict[str, Any]) -> RopeConfig:
    """`rope_parameters` (newer layout) or `rope_theta` + `rope_scaling` (Llama-3.2 files)."""
    section = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    params = d.get(section) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{section} must be a JSON object, got {params!r}")
    section += "."
    theta = positive_number(d, "rope_theta", 10000.0)
    theta = positive_number(params, "rope_theta", theta, section)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{section}rope_type {rope_type!r} is not implemented "
            f"(nanoserve runs {', '.join(ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{section}partial_rotary_factor is not implemented (only 1.0)")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = positive_number(params, "factor", section=section)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    if rope_type == "yarn":
        return _yarn(d, params, theta, factor, section)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=positive_number(params, "low_freq_factor", 1.0, section),
        high_freq_factor=positive_number(params, "high_freq_factor", 4.0, section),
        original_max_position_embeddings=int(
            positive_number(params, "original_max_position_embeddings", 8192, section)
        ),
    )


def _yarn(
    d: dict[str, Any], params: dict[str, Any], theta: float, factor: float, section: str
) -> RopeConfig:
    """YaRN's parameters, with transformers' defaults: the original context from the config's
    top level, else the section, else max_position_embeddings; the attention factor from
    `mscale` and `mscale_all_dim` where both are given, else 0.1 ln(factor) + 1."""
    original = d.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    original = original or d.get("max_position_embeddings") or 2048
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor, 1.0)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{section}truncate must be true or false, got {truncate!r}")
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=positive_number(
            {"attention_factor": attention_factor}, "attention_factor", section=section
        ),
        truncate=truncate,
    )


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
