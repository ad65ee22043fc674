"""Tokenizer: a Hugging Face `tokenizers` wrapper with the checkpoint's chat template (jinja2).

`IncrementalDetokenizer` turns one request's generated token ids into text, one token at a time,
holding back incomplete UTF-8 characters and text that may be the start of a stop string. It owns
that request's decode offsets.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoserve.stop_strings import StopStrings

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Encode, decode and chat-template rendering for one checkpoint directory.

    `token_text(id)` is a token as a user sees it in logprobs: its text when its bytes are valid
    UTF-8 on their own, else OpenAI's `bytes:\\xNN...` form (e.g. "bytes:\\xe6\\x97").
    `clean_up_tokenization_spaces` is not applied (as in vLLM's incremental decoding).
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        max_token_chars: int | None = None,
    ) -> None:
        """max_token_chars: what the vocabulary gives it (below), where that is known (a GGUF's
        index keeps it, so a load does not list the whole vocabulary to find it)."""
        config = config or {}
        self._tok = tok
        self.chat_template = chat_template
        self.special_tokens = _special_tokens_map(config)
        self.tokenizer_class = _tokenizer_class(config)
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        eos_id = self._id_of(self.special_tokens.get("eos_token"))
        self.eos_token_ids: set[int] = set() if eos_id is None else {eos_id}
        added = tok.get_added_tokens_decoder()
        self._added_ids = set(added)
        self.all_special_ids: set[int] = {i for i, t in added.items() if t.special}
        self.all_special_ids |= self.eos_token_ids | _set_of(self.bos_token_id)
        self._byte_decoder = _byte_decoder() if _is_byte_level(tok) else None
        self._template: jinja2.Template | None = None
        # A token stands for at most this many characters of text (its piece's length bounds it
        # for byte-level BPE and SentencePiece alike): a text of L characters has at least
        # L / max_token_chars tokens, known before tokenizing it.
        self.max_token_chars = max_token_chars or max(
            len(piece) for piece in tok.get_vocab(with_added_tokens=True)
        )
        specials = sorted({added[i].content for i in self.all_special_ids if i in added}, key=len)
        self._specials = re.compile("|".join(re.escape(t) for t in reversed(specials)) or "(?!)")
        self._literal: tokenizers.Tokenizer | None = None  # special tokens read as plain text

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja (preferred)."""
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        if template_file.exists():
            return cls(tok, config, template_file.read_text("utf-8"))
        return cls(tok, config, _default_template(config.get("chat_template")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A pair's ids and token types, as the tokenizer's post-processor joins pairs (BERT's
        [CLS] first [SEP] second [SEP], types 0 then 1)."""
        encoding = self._tok.encode(first, second)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The tokens' vocabulary pieces ("Ġhello", "▁the", "<0x0A>"), as transformers'
        convert_ids_to_tokens gives them."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as JSON (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a special token: its text)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_decoder is not None:
            table = self._byte_decoder
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` from now on (compiled here: a syntax error is a
        ValueError at once, not at the first chat)."""
        try:
            template = _compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"chat_template must be a Jinja template that compiles (line {e.lineno}: "
                f"{e.message})"
            ) from None
        self.chat_template, self._template = source, template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render messages as transformers does; a template error becomes a ValueError.
        continue_final_message: the text ends with the last message's content, not its turn's
        end, so that the model continues it (an assistant's answer begun by the client)."""
        if self._template is None:
            if not self.chat_template:
                raise ValueError(
                    "this model has no chat template (no chat_template.jinja and no "
                    "chat_template in tokenizer_config.json)"
                )
            self._template = _compile_template(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception as e:  # the template is the checkpoint's code, the messages the user's
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
        return _up_to_final(text, messages[-1]) if continue_final_message else text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """A conversation's prompt ids. Special tokens come only from the template: one typed
        inside a message (`<|im_end|>`, ...) is tokenized as the text it is, so a message cannot
        forge a turn of another role."""
        return self.render_chat(
            messages, add_generation_prompt, continue_final_message=continue_final_message,
            **kwargs,
        )[1]  # fmt: skip

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """A conversation's prompt as text and as ids (`encode_chat`'s)."""
        typed: list[str] = []
        nonce = secrets.token_hex(8)

        def shield(value: Any) -> Any:
            if not isinstance(value, str):
                return value
            return self._specials.sub(lambda m: f"\ue000{nonce}:{_keep(typed, m[0])}\ue001", value)

        shielded = [{k: shield(v) for k, v in m.items()} for m in messages]
        text = self.apply_chat_template(
            shielded, add_generation_prompt, continue_final_message=continue_final_message, **kwargs
        )
        if not typed:
            return text, self.encode(text, add_special_tokens=False)  # the template has the BOS
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False)
            else:
                ids += (
                    self._literal_tokenizer()
                    .encode(typed[int(piece)], add_special_tokens=False)
                    .ids
                )
        plain = "".join(p if i % 2 == 0 else typed[int(p)] for i, p in enumerate(pieces))
        return plain, ids

    def _literal_tokenizer(self) -> tokenizers.Tokenizer:
        if self._literal is None:
            literal = tokenizers.Tokenizer.from_str(self._tok.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    def token_id(self, text: str) -> int | None:
        """The id of the token that is exactly `text` (a special token, say), or None."""
        return self._tok.token_to_id(text)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


def _keep(items: list[str], item: str) -> int:
    items.append(item)
    return len(items) - 1


# A UTF-8 character spans at most 4 byte tokens: a longer run that still ends mid-character is
# invalid UTF-8, released as U+FFFD so the decode window stays short (a one-shot decode may then
# differ from `text` in replacement characters).
_MAX_PENDING_TOKENS = 8
# Prompt tokens decoded before the output, so that a decoder that strips a leading space
# (SentencePiece) keeps the space of the first output token.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Text of one request's output, extended one token at a time.

    `text` holds only complete characters; `append` returns the stop string that ended it, if any
    (`text` is then cut just before it). `visible_text()` hides a tail that may still become a stop
    string, until `finish()` (called at the end of the request) releases everything.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = StopStrings(stop)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # start of the decode window (context for the next piece)
        self._read_offset = len(self._ids)  # tokens before this are already in `text`
        self.text = ""
        self.finished = False

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        self._ids.append(token_id)
        pending = len(self._ids) - self._read_offset
        new = self._decode_new(allow_partial=pending > _MAX_PENDING_TOKENS)
        if not new:
            return None
        at, read = len(self.text), 0
        self.text += new
        while (found := self._stops.feed(new[read:])) is not None:
            end, stop = found
            read += end
            if check_stop:  # before min_tokens, a stop string is text
                self.text = self.text[: at + read - len(stop)]
                self.finished = True
                return stop
        return None

    def visible_text(self) -> str:
        if self.finished:
            return self.text
        return self.text[: len(self.text) - self._stops.held]

    def finish(self) -> None:
        """Release everything: undecodable trailing bytes (as U+FFFD) and a held-back tail."""
        if not self.finished:
            self.text += self._decode_new(allow_partial=True)
            self.finished = True

    def _decode_new(self, allow_partial: bool) -> str:
        """Text added by tokens past the read offset; "" while they end mid-character."""
        window = self._ids[self._prefix_offset :]
        prefix = self._tok.decode(window[: self._read_offset - self._prefix_offset], self._skip)
        full = self._tok.decode(window, self._skip)
        if full.endswith("\ufffd") and not allow_partial and self._ends_mid_character():
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _ends_mid_character(self) -> bool:
        """Whether the unread tokens' bytes stop inside a UTF-8 character (a U+FFFD that the text
        itself holds is a character like any other)."""
        skipped = self._tok.all_special_ids if self._skip else set()
        pending = self._ids[self._read_offset :]
        tail = b"".join(self._tok.token_bytes(i) for i in pending if i not in skipped)
        for back in range(1, min(4, len(tail)) + 1):
            byte = tail[-back]
            if byte & 0xC0 != 0x80:  # the last character's first byte: how long it should be
                length = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
                return byte >= 0xC0 and back < length
        return False  # no first byte within 4: invalid, not incomplete


def _set_of(token_id: int | None) -> set[int]:
    return set() if token_id is None else {token_id}


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_tokens_map(config: dict[str, Any]) -> dict[str, str]:
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    tokens = {name: _token_str(config.get(name)) for name in names}
    return {name: tok for name, tok in tokens.items() if tok is not None}


def _tokenizer_class(config: dict[str, Any]) -> str:
    """The tokenizer's transformers class as the checkpoint names it (tokenizer_config.json's
    tokenizer_class, which AutoTokenizer loads); without one (a GGUF file, a bare
    tokenizer.json), PreTrainedTokenizerFast: the class of a plain `tokenizers` tokenizer, which
    is what nanoserve runs."""
    name = config.get("tokenizer_class")
    return name if isinstance(name, str) and name else "PreTrainedTokenizerFast"


def _default_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (use "default")."""
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    return value


def _is_byte_level(tok: tokenizers.Tokenizer) -> bool:
    decoder = json.loads(tok.decoder.__getstate__()) if tok.decoder is not None else {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in parts)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to bytes."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(moved)})
    return table


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}` blocks (assistant masks), rendering their body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _up_to_final(text: str, final: dict[str, Any]) -> str:
    """The rendered chat cut after the last message's content, as transformers cuts it."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise ValueError("continue_final_message: the chat template drops the last message's text")


def _compile_template(source: str) -> jinja2.Template:
    """Sandboxed like transformers: trim_blocks, lstrip_blocks, loopcontrols, the same globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which a chat prompt must not see.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
