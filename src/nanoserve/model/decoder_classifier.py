"""A decoder as a one-label relevance classifier (Qwen3-Reranker, as vLLM serves it): the score is
the head's logit of the final normed hidden state of the last token (then the activation, sigmoid
for one label). The head is the checkpoint's `score.weight` (`Qwen3ForSequenceClassification`, the
community "seq-cls" conversion) or, for the original causal LM under --hf-overrides, the LM head's
row of the true token less that of the false one (vLLM's from_2_way_softmax: sigmoid(a - b) is the
softmax of [b, a] at a), or a GGUF reranker's (llama.cpp's RANK pooling: the same difference).
Reads tensors; owns nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nanoserve.config import HfOverrides, SettingError
from nanoserve.model.config import SEQUENCE_CLASSIFIERS, CheckpointError, read_json
from nanoserve.model.gguf_file import CLASSIFIER, GGUFCheckpoint, dequantize
from nanoserve.model.loader import checkpoint_files
from nanoserve.model.pooling import GGUF_RANK
from nanoserve.tokenizer import Tokenizer

# The original Qwen3-Reranker's architecture: what --hf-overrides turns into a classifier.
ORIGINAL = "Qwen3ForCausalLM"


def is_sequence_classifier(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a decoder with a classification head."""
    file = Path(path) / "config.json"
    architectures = (read_json(file).get("architectures") or [None]) if file.is_file() else [None]
    return architectures[0] in SEQUENCE_CLASSIFIERS


def classifier_head(
    path: Path, overrides: HfOverrides | None, tokenizer: Tokenizer
) -> torch.Tensor | None:
    """The head [labels, hidden] in float32, or None for a decoder served for its embeddings."""
    if is_sequence_classifier(path):
        if overrides is not None:
            raise SettingError("hf_overrides", overrides, "absent for a checkpoint that is "
                               "already a sequence classifier")  # fmt: skip
        head = _tensor(path, ("score.weight",))
        if head is None:
            raise CheckpointError(f"{path}: a sequence classifier without score.weight")
        return head
    if overrides is None:
        return None
    architecture = (read_json(path / "config.json").get("architectures") or [None])[0]
    if architecture != ORIGINAL:
        raise SettingError("hf_overrides.architectures", architecture, f"given for a "
                           f"{ORIGINAL} checkpoint (the original Qwen3-Reranker)")  # fmt: skip
    false, true = (_token_id(tokenizer, t) for t in overrides.classifier_from_token)
    lm_head = _tensor(path, ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"))
    if lm_head is None:
        raise CheckpointError(f"{path}: no lm_head.weight nor embed_tokens.weight")
    return (lm_head[true] - lm_head[false]).unsqueeze(0)


def gguf_classifier_head(checkpoint: GGUFCheckpoint) -> torch.Tensor | None:
    """A GGUF reranker's head [1, hidden] in float32 (pooling_type RANK), or None. llama.cpp's
    converter writes Qwen3-Reranker's LM head rows of "yes" and "no" as cls.output.weight [2,
    hidden], output_labels ["yes", "no"]: the head is their difference, the score sigmoid(yes -
    no), llama.cpp's softmax at "yes" and the directory's under --hf-overrides. A one-row head is
    the logit as it is; any other refused by name."""
    arch, name = checkpoint.meta["general.architecture"], checkpoint.path.name
    info = checkpoint.tensors.get(CLASSIFIER)
    head = None
    if info is not None:
        values = dequantize(np.memmap(checkpoint.path, dtype=np.uint8, mode="r"), info)
        head = torch.from_numpy(np.array(values, dtype=np.float32))
    if checkpoint.meta.get(f"{arch}.pooling_type") != GGUF_RANK:
        if head is not None:
            raise CheckpointError(f"{name}: {CLASSIFIER} without {arch}.pooling_type = RANK")
        return None
    if head is None:
        raise CheckpointError(f"{name}: {arch}.pooling_type = RANK without {CLASSIFIER}")
    labels = checkpoint.meta.get(f"{arch}.classifier.output_labels")
    if head.shape[0] == 2 and labels == ["yes", "no"]:
        return (head[0] - head[1]).unsqueeze(0)
    if head.shape[0] == 1:
        return head
    raise CheckpointError(f"{name}: {CLASSIFIER} of {head.shape[0]} labels ({labels}) is not "
                          "implemented (one label, or llama.cpp's yes and no)")  # fmt: skip


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_id(token)
    if token_id is None:
        raise SettingError("hf_overrides.classifier_from_token", token,
                           "a token of the model's vocabulary")  # fmt: skip
    return token_id


def _tensor(path: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    """The first of `names` the checkpoint holds, in float32 (the head's products in float32)."""
    from safetensors import safe_open

    for name in names:
        for file in checkpoint_files(path):
            with safe_open(file, framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    return f.get_tensor(name).float()
    return None
