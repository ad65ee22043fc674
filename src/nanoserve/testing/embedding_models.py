"""Tiny random embedding checkpoints written by transformers and sentence-transformers: a BERT
encoder with a WordPiece tokenizer (`write_bert`), the same as a cross-encoder
(`BertForSequenceClassification`, `write_cross_encoder`), a Qwen3 decoder saved as a
sentence-transformers model with last-token pooling (`write_decoder_embedding`), and a Qwen3
reranker converted to one label (`Qwen3ForSequenceClassification`, `write_qwen3_reranker`). Each
directory loads in sentence-transformers or transformers, the oracles of the pooling tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from nanoserve.testing.hf_families import write_family_checkpoint

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_TEXT = (
    "the a of to and in is it that for on with as was at by an be this are from or have not "
    "what which who when where why how paris france capital city river sea tide moon sun rain "
    "cat dog bird fish tree house car road book word model vector query document rank score"
)
WORDS = _TEXT.split()
BERT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    max_position_embeddings=128, type_vocab_size=2,
)  # fmt: skip


def bert_tokenizer(size: int | None = None) -> Tokenizer:
    """WordPiece over the specials, the letters (with ## continuations) and WORDS, lower-cased
    as BERT's uncased tokenizers are; pairs get token types 0 and 1. `size`: the vocabulary
    filled up to that many entries with [unusedN] tokens (as BERT's own has them)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,?!'")
    # Once each ("a" is a letter and a word): llama.cpp's converter wants ids below the size.
    vocab = list(dict.fromkeys([*SPECIALS, *letters, *("##" + c for c in letters), *WORDS]))
    vocab += [f"[unused{i}]" for i in range(max(0, (size or 0) - len(vocab)))]
    tok = Tokenizer(WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = vocab.index("[CLS]"), vocab.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )  # fmt: skip
    return tok


def _save_bert(path: Path, architecture: str, seed: int, **config: Any) -> Path:
    tok = bert_tokenizer(config.pop("vocab_size", None))
    cfg = transformers.BertConfig(vocab_size=tok.get_vocab_size(), **{**BERT, **config})
    torch.manual_seed(seed)
    cls = getattr(transformers, architecture)
    model = cls(cfg).eval()
    with torch.no_grad():  # transformers' init leaves LayerNorms at 1 and 0: make them matter
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.startswith("classifier"):  # scores that differ from pair to pair
                p.mul_(10.0)
    model.save_pretrained(path)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=cfg.max_position_embeddings,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )  # fmt: skip
    fast.save_pretrained(path)
    return path


def write_bert(
    path: Path, pooling: str = "mean", normalize: bool = True, seed: int = 0, **config: Any
) -> Path:
    """A random BertModel as a sentence-transformers model: Transformer, Pooling (`pooling`:
    cls, mean or lasttoken) and, with `normalize`, Normalize. `config`: BertConfig fields (a
    key of config.json, e.g. matryoshka_dimensions, is written as given)."""
    raw = _save_bert(path / "raw", "BertModel", seed, **config)
    _as_sentence_transformer(raw, path, pooling, normalize)
    return path


def write_cross_encoder(path: Path, seed: int = 0, **config: Any) -> Path:
    """A random BertForSequenceClassification with one label, saved as CrossEncoder saves it."""
    raw = _save_bert(path / "raw", "BertForSequenceClassification", seed, num_labels=1, **config)
    CrossEncoder(str(raw), device="cpu").save(str(path))
    return path


def write_decoder_embedding(
    path: Path, seed: int = 0, tokenizer_json: str | None = None, **config: Any
) -> Path:
    """A random Qwen3 decoder as a sentence-transformers model: last-token pooling, normalized
    (Qwen3-Embedding's modules). `tokenizer_json` replaces the demo tokenizer (one llama.cpp's
    converter recognizes, for a GGUF; `config` then gives its vocab_size)."""
    raw = write_family_checkpoint(path / "raw", "qwen3", seed, **config)
    if tokenizer_json is not None:
        _with_eos(raw, Tokenizer.from_str(tokenizer_json), "<|endoftext|>")
    # Without a chat template sentence-transformers encodes plain text, as Qwen3-Embedding's own
    # files have it; its batches need a padding token.
    (raw / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((raw / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    tokenizer_config["pad_token"] = tokenizer_config.get("eos_token") or "<|endoftext|>"
    (raw / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _as_sentence_transformer(raw, path, "lasttoken", True)
    return path


def _with_eos(raw: Path, tok: Tokenizer, eos: str) -> None:
    """`tok` as the checkpoint's tokenizer, appending `eos` to each text as Qwen3-Embedding's
    does (its last token, the one pooled)."""
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B:1 {eos}:1",
        special_tokens=[(eos, tok.token_to_id(eos))],
    )  # fmt: skip
    tok.save(str(raw / "tokenizer.json"))
    special = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    (raw / "tokenizer_config.json").write_text(json.dumps(special))


def write_qwen3_reranker(path: Path, seed: int = 0) -> Path:
    """A random Qwen3 decoder with a one-label `score` head (the "seq-cls" conversion of
    Qwen3-Reranker): as the conversion makes it, the difference of two rows of the LM head
    (scaled down: a random head's logits saturate the sigmoid)."""
    raw = write_family_checkpoint(path / "raw", "qwen3", seed)
    lm_head = transformers.AutoModelForCausalLM.from_pretrained(raw).lm_head.weight
    model = transformers.Qwen3ForSequenceClassification.from_pretrained(raw, num_labels=1)
    with torch.no_grad():
        model.score.weight.copy_((lm_head[88] - lm_head[77]) / 8)  # tokens of the demo vocabulary
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((raw / name).read_bytes())
    return path


def _as_sentence_transformer(raw: Path, path: Path, pooling: str, normalize: bool) -> None:
    transformer = Transformer(str(raw))
    dim = transformer.get_embedding_dimension()
    modules: list[Any] = [transformer, Pooling(dim, pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    extra = json.loads((raw / "config.json").read_text())
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**extra, **config}, indent=2))
