"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary, the BPE merges, each token's
type, the special token ids and the name of llama.cpp's pre-tokenizer. This module builds the
byte-level BPE kind (`tokenizer.ggml.model == "gpt2"`) for the pre-tokenizers it knows, splitting
text as llama.cpp does for each; anything else is refused by name, never approximated. Imports
nothing of nanoserve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _llama3() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _qwen2() -> pre_tokenizers.PreTokenizer:
    # Llama 3's split, but one digit at a time (Qwen2's tokenizer.json and llama.cpp).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM's own tokenizer (and llama.cpp) split digits one by one, then split as GPT-2 does.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# tokenizer.ggml.pre -> (pre-tokenizer, whether a word found whole in the vocabulary skips the
# merges, as llama.cpp does for Llama 3's vocabulary).
PRE_TOKENIZERS = {
    "default": (_gpt2, False),
    "gpt-2": (_gpt2, False),
    "gpt2": (_gpt2, False),
    "llama-bpe": (_llama3, True),
    "qwen2": (_qwen2, False),
    "llama3": (_llama3, True),
    "llama-v3": (_llama3, True),
    "smollm": (_smollm, False),
}


class UnsupportedTokenizer(ValueError):
    """The GGUF describes a tokenizer this module does not build."""


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any], str | None]:
    """The tokenizer, its tokenizer_config.json fields and its chat template, from the file's
    metadata (key -> value). Raises UnsupportedTokenizer, naming what is unsupported."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(
            f"tokenizer kind {kind!r} is not supported: nanoserve builds the byte-level BPE "
            "kind ('gpt2') of GGUF tokenizers"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"pre-tokenizer {pre!r} is not supported: nanoserve knows "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    tok = _bpe(tokens, meta, pre)
    config = _special_tokens(tokens, meta)
    if config.get("add_bos_token") and "bos_token" in config:
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return tok, config, meta.get("tokenizer.chat_template")


def _bpe(tokens: list[str], meta: Mapping[str, Any], pre: str) -> Tokenizer:
    make_pre, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
    tok = Tokenizer(model)
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    # Control tokens (<|im_start|>...) and user-defined ones (<think>...) are matched whole.
    typed = list(zip(tokens, types, strict=False))
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in typed if k == CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == USER_DEFINED])
    return tok


def _special_tokens(tokens: list[str], meta: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json's fields as far as the metadata gives them."""
    config: dict[str, Any] = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token"))}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    return config
