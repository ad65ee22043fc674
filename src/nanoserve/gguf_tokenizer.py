"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary, the BPE merges (or, for a
SentencePiece vocabulary, each token's score), each token's type, the special token ids and the
name of llama.cpp's pre-tokenizer. This module builds the two kinds the Llama-family files use:
byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen, SmolLM) for the pre-tokenizers
it knows, splitting text as llama.cpp does for each, and SentencePiece BPE (`"llama"`: Mistral,
Llama 2, TinyLlama), whose merges are the pairs of tokens that make a longer one, best score
first, as SentencePiece merges them. Anything else is refused by name, never approximated.
Imports nothing of nanoserve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"  # SentencePiece's stand-in for a space

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
    check_supported(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    if meta.get("tokenizer.ggml.model") == "gpt2":
        tok = _bpe(tokens, meta, meta.get("tokenizer.ggml.pre", "default"))
    else:
        tok = _sentencepiece(tokens, meta)
    _add_typed_tokens(tok, tokens, meta)
    config = tokenizer_config(meta)
    if config.get("add_bos_token") and "bos_token" in config:
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return tok, config, meta.get("tokenizer.chat_template")


def check_supported(meta: Mapping[str, Any]) -> None:
    """Raise UnsupportedTokenizer where tokenizer_from_gguf would, without building anything:
    a loader refuses the file before it loads weights for a tokenizer it cannot have."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise UnsupportedTokenizer(
            f"tokenizer kind {kind!r} is not supported: nanoserve builds byte-level BPE "
            "('gpt2') and SentencePiece BPE ('llama') GGUF tokenizers"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"pre-tokenizer {pre!r} is not supported: nanoserve knows "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    if kind == "llama" and "tokenizer.ggml.scores" not in meta:
        raise UnsupportedTokenizer(
            "a SentencePiece ('llama') vocabulary needs tokenizer.ggml.scores"
        )


def _bpe(tokens: list[str], meta: Mapping[str, Any], pre: str) -> Tokenizer:
    make_pre, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
    tok = Tokenizer(model)
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], meta: Mapping[str, Any]) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces become U+2581 (one in front of the text
    unless add_space_prefix is false), the adjacent pair whose join is the best-scored token
    merges first, and a character no token spells falls back to its UTF-8 bytes (<0xNN>)."""
    scores = list(meta["tokenizer.ggml.scores"])
    types = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = next((t for t, k in zip(tokens, types, strict=False) if k == UNKNOWN), None)
    model = models.BPE(
        vocab=vocab, merges=_merges_by_score(tokens, scores, types), unk_token=unk,
        fuse_unk=True, byte_fallback=True,
    )  # fmt: skip
    tok = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # As a normalizer, the prefix also goes after each special token, as llama.cpp puts it, and
    # before text that starts with a space (Metaspace would skip it there).
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_by_score(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """Every split of a normal token into two normal tokens, the joined token's score deciding
    the order (higher first; SentencePiece's own order, where pieces are kept by score)."""
    normal = {t for t, k in zip(tokens, types, strict=False) if k == NORMAL}
    ranked = []
    for i, token in enumerate(tokens):
        if token not in normal:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, cut, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _add_typed_tokens(tok: Tokenizer, tokens: list[str], meta: Mapping[str, Any]) -> None:
    """Control tokens (<|im_start|>, [INST]...), the unknown token and user-defined ones
    (<think>...) are matched whole in the text, as llama.cpp matches them."""
    typed = list(zip(tokens, meta.get("tokenizer.ggml.token_type", []), strict=False))
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in typed if k in (CONTROL, UNKNOWN)]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == USER_DEFINED])


def tokenizer_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json's fields as far as the metadata gives them."""
    tokens = meta["tokenizer.ggml.tokens"]
    # llama.cpp puts BOS before a SentencePiece vocabulary's text unless the file says not to.
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    add_bos = meta.get("tokenizer.ggml.add_bos_token", default_bos)
    config: dict[str, Any] = {"add_bos_token": bool(add_bos)}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    return config
