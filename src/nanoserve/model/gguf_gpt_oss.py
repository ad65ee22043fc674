"""llama.cpp's `gpt-oss` GGUF architecture (its converter's files of GptOssForCausalLM), as
llama.cpp's graph runs it: attention sinks, biases, a router with a bias whose top k are
softmaxed, every other layer (the even ones) sliding over `attention.sliding_window` positions,
and the clamped SwiGLU with llama.cpp's constants (the file holds no key for them). Also YaRN's
rope keys, which llama.cpp reads for any architecture (model/gguf_file.py's _rope).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nanoserve.model.config import ModelConfig, RopeConfig

Get = Callable[..., Any]  # a GGUF's `<architecture>.<key>` value, or the default given
Refused = Callable[[str, Any, Any], Exception]  # (key, value, what is implemented) -> the error

# llama.cpp's gpt-oss graph (llm_build_openai_moe_iswa): its SwiGLU's alpha and limit, fixed.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
SWA_PATTERN = 2  # hparams.set_swa_pattern(2): layer i slides where i % 2 == 0


def gpt_oss_config(config: ModelConfig, get: Get) -> ModelConfig:
    """The config gguf_file read as for any mixture, made gpt-oss's."""
    window = get("attention.sliding_window") or 0
    layers = range(config.num_layers)
    windows = tuple(window if i % SWA_PATTERN == 0 else 0 for i in layers) if window else ()
    return replace(
        config,
        family="gpt_oss",
        layer_windows=windows,
        swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT,
        norm_topk_prob=True,  # the top k's softmax among themselves
    )


def yarn_rope(get: Get, theta: float, refused: Refused) -> RopeConfig:
    """YaRN from the rope.scaling keys, as ggml's rope computes it: the blended band's ends
    floored and ceiled (transformers' truncate), cos and sin scaled by yarn_attn_factor (default
    1) times 0.1 ln(factor) + 1. An extrapolation factor other than 1 or a log multiplier is
    refused by name."""
    factor = float(get("rope.scaling.factor", 1.0))
    for key, implemented in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = get(f"rope.scaling.{key}", implemented)
        if value != implemented:
            raise refused(f"rope.scaling.{key}", value, implemented)
    if factor <= 0:
        raise refused("rope.scaling.factor", factor, "a positive factor")
    attention = float(get("rope.scaling.yarn_attn_factor", 1.0)) * (0.1 * math.log(factor) + 1)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(
            get("rope.scaling.original_context_length") or get("context_length", 2048)
        ),
        beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=attention,
        truncate=True,
    )
