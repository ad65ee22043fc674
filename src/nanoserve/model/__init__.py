"""The model: its config, the checkpoint loader (fusion, packing), the Llama forward pass with its
matmuls, attention over the paged cache and the CPU's one-call decode step. Knows no engine.

This package is the model's one face: the engine imports the names below from `nanoserve.model`
and nothing from its modules (an import-linter contract says so). They load on first use, so
that `nanoserve.model.config` stays importable without torch (the CLI checks a checkpoint's
config.json before torch is imported).
"""

from importlib import import_module
from typing import Any

_FACE = {  # name: the module of this package that defines it
    "AttentionMetadata": "attention",
    "Bert": "bert",
    "is_encoder": "bert_config",
    "DecoderEmbeddingCheckpoint": "decoder_embedding",
    "classifier_head": "decoder_classifier",
    "gguf_classifier_head": "decoder_classifier",
    "is_sequence_classifier": "decoder_classifier",
    "GGUFBert": "gguf_bert",
    "GGUFCheckpoint": "gguf_file",
    "gguf_kind": "bert_config",
    "gguf_pooling": "pooling",
    "GGUF_RANK": "pooling",
    "Pooling": "pooling",
    "pool": "pooling",
    "read_pooling": "pooling",
    "PrefillChunk": "attention",
    "Checkpoint": "checkpoint",
    "open_checkpoint": "checkpoint",
    "CheckpointError": "config",
    "ModelConfig": "config",
    "CpuDecodeStep": "cpu_step",
    "KVCaches": "llama",
    "Llama": "llama",
    "decode_step": "load",
    "held_bytes": "load",
    "invariant_rows": "load",
    "load_model": "load",
    "resolve_dtype": "load",
    "weight_bytes": "load",
    "SINGLE": "parallel",
    "Parallel": "parallel",
    "check_divisible": "parallel",
}
__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_FACE[name]}"), name)
