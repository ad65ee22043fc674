"""What a GGUF file's first load parses, kept under cache_dir()/gguf for the loads after it: the
index (the metadata but the vocabulary's arrays, and the tensor table; JSON) and the tokenizer
built from the vocabulary (tokenizers' own JSON), so that a later load parses no vocabulary.

An entry is keyed by the file's path, size, modification time and inode (a file replaced by a
rename is a new inode), and the tokenizer's also by the source of the code that builds it and the
tokenizers version that reads it, so that a changed file or builder never meets an old entry.
Entries are written whole or not at all (concurrent starts never read half of one); where the
cache cannot be written the load goes on without it, and an entry that cannot be read is built
again. Owns nothing but those files.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from nanoserve import gguf_tokenizer
from nanoserve.env import cache_dir

log = logging.getLogger(__name__)
# 2: the header read by model/gguf_header.py; 3: max_token_chars; 4: *_pattern; 5: the tokenizer
# in a file of its own.
INDEX_VERSION = 5


def entry(path: Path) -> Path:
    """The cache's name for the file at `path` (a resolved path): its files are this name with
    their suffixes."""
    stat = path.stat()
    key = f"{INDEX_VERSION}:{path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    return cache_dir() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:24]


def read_index(name: Path) -> dict[str, Any] | None:
    """The index kept under `name`, or None where there is none (or it cannot be read)."""
    file = name.with_suffix(".json")
    if not file.is_file():
        return None
    try:
        index: dict[str, Any] = json.loads(file.read_text("utf-8"))
    except (OSError, ValueError) as e:
        log.warning("GGUF index %s unreadable (%s): parsing the file again", file, e)
        return None
    return index


def write_index(name: Path, index: dict[str, Any]) -> None:
    _write(name.with_suffix(".json"), json.dumps(index))


def cached_tokenizer(name: Path, build: Callable[[], tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
    """The tokenizer kept under `name`; else `build()`, kept for the next load."""
    file = _tokenizer_file(name)
    if file.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises bare Exceptions
            log.warning("cached tokenizer %s unreadable (%s): building it again", file, e)
    tok = build()
    _write(file, tok.to_str())
    return tok


def _tokenizer_file(name: Path) -> Path:
    return name.with_name(f"{name.name}.tokenizer-{_builder_key()}.json")


@functools.cache
def _builder_key() -> str:
    """What else a built tokenizer depends on: the code that builds it, the library that reads
    it (its JSON may change between versions)."""
    source = Path(gguf_tokenizer.__file__).read_bytes()
    key = source + tokenizers.__version__.encode()
    return hashlib.sha256(key).hexdigest()[:12]


def _write(file: Path, text: str) -> None:
    """`text` into `file`, whole or not at all; an unwritable cache is logged, not raised: the
    next load builds again."""
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, "utf-8")
        os.replace(tmp, file)
    except OSError as e:
        log.warning("GGUF cache %s not written (%s): the next load parses the file again", file, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
