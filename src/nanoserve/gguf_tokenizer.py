"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary, the BPE merges (or, for a
SentencePiece vocabulary, each token's score), each token's type, the special token ids and the
name of llama.cpp's pre-tokenizer. This module builds the two kinds the Llama-family files use:
byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen, SmolLM) for the pre-tokenizers
it knows, splitting text as llama.cpp does for each, and SentencePiece BPE (`"llama"`: Mistral,
Llama 2, TinyLlama), whose merges are the pairs of tokens that make a longer one, best score
first, as SentencePiece merges them; and BERT's WordPiece (`"bert"`), from the vocabulary
llama.cpp's converter rewrites. Anything else is refused by name, never approximated.
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
    if meta.get("tokenizer.ggml.model") == "bert":
        return _wordpiece(tokens, meta), tokenizer_config(meta), None
    if meta.get("tokenizer.ggml.model") == "gpt2":
        tok = _bpe(tokens, meta, meta.get("tokenizer.ggml.pre", "default"))
    else:
        tok = _sentencepiece(tokens, meta)
    _add_typed_tokens(tok, tokens, meta)
    config = tokenizer_config(meta)
    # BOS before a text and, where the file says (an embedding model's: Qwen3-Embedding pools
    # its last token, <|endoftext|>), EOS after it, as llama.cpp adds them.
    bos = config.get("bos_token") if config.get("add_bos_token") else None
    eos = config.get("eos_token") if meta.get("tokenizer.ggml.add_eos_token") else None
    if bos or eos:
        ends = [t for t in (bos, eos) if t]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(t for t in (bos, "$A", eos) if t),
            pair=" ".join(t for t in (bos, "$A", eos, bos, "$B", eos) if t),
            special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(ends)],
        )  # fmt: skip
    return tok, config, meta.get("tokenizer.chat_template")


def check_supported(meta: Mapping[str, Any]) -> None:
    """Raise UnsupportedTokenizer where tokenizer_from_gguf would, without building anything:
    a loader refuses the file before it loads weights for a tokenizer it cannot have."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama", "bert"):
        raise UnsupportedTokenizer(
            f"tokenizer kind {kind!r} is not supported: nanoserve builds byte-level BPE "
            "('gpt2'), SentencePiece BPE ('llama') and WordPiece ('bert') GGUF tokenizers"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "bert":
        return  # llama.cpp's WordPiece reads no pre-tokenizer name
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


def _wordpiece(tokens: list[str], meta: Mapping[str, Any]) -> Tokenizer:
    """BERT's WordPiece. The converter wrote a word's first piece as U+2581 + piece and a
    continuation ("##ing") without its "##", control tokens as they are: undone here. Text is
    split and cleaned as BERT's tokenizer does, lower-cased (accents stripped) unless the file's
    normalizer.lowercase says not (a file older than that key: lower-cased, as the uncased BERTs
    most such files hold are); [CLS] (the BOS) and [SEP] go around a text, and a pair is
    [CLS] A [SEP] B [SEP], B's token type 1."""
    types = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    pieces = [
        t if k == CONTROL else t[1:] if t.startswith(SPACE) else "##" + t
        for t, k in zip(tokens, types, strict=True)
    ]
    unk = _token(pieces, meta, "unknown")
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token=unk or ""))
    lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    _add_typed_tokens(tok, pieces, meta)
    cls, sep = _token(pieces, meta, "bos"), _token(pieces, meta, "seperator")
    if cls is None or sep is None or not meta.get("tokenizer.ggml.add_bos_token", True):
        raise UnsupportedTokenizer("a WordPiece ('bert') vocabulary needs its [CLS] (bos) and "
                                   "[SEP] (seperator) token ids, and adds them")  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, pieces.index(cls)), (sep, pieces.index(sep))],
    )  # fmt: skip
    return tok


def _token(tokens: list[str], meta: Mapping[str, Any], key: str) -> str | None:
    """The token of tokenizer.ggml.<key>_token_id, or None."""
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


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
