"""What a config.json says of a mixture of experts (Qwen3-MoE, Mixtral, gpt-oss): ModelConfig's
expert fields, as transformers reads them; a ValueError naming the key for what nanoserve does
not run. Imports no torch.
"""

from __future__ import annotations

from typing import Any

from nanoserve.model.config_fields import flag, positive_int, positive_number

MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")


def moe_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts as transformers 5 reads them (none for a
    dense family): Qwen3-MoE's num_experts (saved as num_local_experts), moe_intermediate_size
    and norm_topk_prob; Mixtral's (and gpt-oss's) num_local_experts and intermediate_size,
    always renormalized (gpt-oss's softmax is over the chosen k).
    A sparse block on every layer only: Qwen3-MoE's dense layers are refused by name."""
    if family not in MOE_FAMILIES:
        for key in ("num_experts", "num_local_experts"):
            if d.get(key):
                raise ValueError(f"{key} is not implemented for {family} (no mixture of experts)")
        return {}
    # Training-only keys, deliberately ignored: the router's auxiliary loss (router_aux_loss_coef,
    # output_router_logits) changes no output, and router_jitter_noise is applied by transformers
    # only in training (MixtralSparseMoeBlock: `if self.training and self.jitter_noise > 0`).
    if family == "qwen3_moe":
        if d.get("mlp_only_layers"):
            raise ValueError("mlp_only_layers (dense layers among sparse ones) is not implemented")
        if d.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"decoder_sparse_step {d['decoder_sparse_step']!r} is not implemented (only 1: "
                "every layer sparse)"
            )
    local = family in ("mixtral", "gpt_oss")
    key = "num_local_experts" if local or "num_experts" not in d else "num_experts"
    experts = positive_int(d, key)
    per_token = positive_int(d, "num_experts_per_tok")
    if per_token > experts:
        raise ValueError(f"num_experts_per_tok ({per_token}) must be at most {key} ({experts})")
    size_key = "intermediate_size" if local else "moe_intermediate_size"
    return {
        "num_experts": experts,
        "experts_per_token": per_token,
        "expert_size": positive_int(d, size_key),
        "norm_topk_prob": local or flag(d, "norm_topk_prob", False),
    }


def gpt_oss_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    """GptOssConfig's SwiGLU alpha and limit, with its defaults (1.702, 7.0)."""
    if family != "gpt_oss":
        return {}
    return {
        "swiglu_alpha": positive_number(d, "swiglu_alpha", 1.702),
        "swiglu_limit": positive_number(d, "swiglu_limit", 7.0),
    }
