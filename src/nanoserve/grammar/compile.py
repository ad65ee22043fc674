"""What the server and the checking child both compile with: a constraint's llguidance grammar,
a schema closed to unlisted keys, a function run on a thread of a given stack, and the part of a
compiler's message that a client may read. Owns nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

# Whitespace a JSON output may put between two tokens, unless the request says otherwise: enough
# for an indented document, bounded so that a small model cannot spend its tokens on blanks.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"
MESSAGE_CHARS = 300  # of a compiler's error, as a client is told it (it may quote the input)
_VALUES = frozenset(["const", "enum", "default", "examples"])  # JSON values, not schemas
# Maps of names (a property's, a definition's) to schemas: a name there is not a keyword.
_NAMED = frozenset(["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"])
_STACK_LOCK = threading.Lock()

T = TypeVar("T")


def closed_schema(schema: Any) -> Any:
    """The schema with every object that does not say otherwise taking no keys beyond its
    properties (`additionalProperties: false`), as vLLM's default backend reads schemas: left
    open, a small model may add keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_part(k, v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_part(key: str, value: Any) -> Any:
    if key in _VALUES:
        return value
    if key in _NAMED and isinstance(value, dict):  # a property named "const" is a schema too
        return {name: closed_schema(v) for name, v in value.items()}
    return closed_schema(value)


def grammar_text(kind: str, value: Any, whitespace_pattern: str | None) -> str:
    """llguidance's grammar for a constraint: `kind` is json, json_object, regex, choice or
    grammar (Lark, or llama.cpp's GBNF). Raises ValueError or TypeError on a bad one."""
    import llguidance

    options: Any = {"whitespace_pattern": JSON_WHITESPACE}
    if whitespace_pattern == "":
        options = {"whitespace_flexible": False}
    elif whitespace_pattern is not None:
        options = {"whitespace_pattern": whitespace_pattern}
    m = llguidance.LLMatcher
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        return m.grammar_from_json_schema(closed_schema(schema), defaults=options)
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":
        return m.grammar_from_regex(value)
    if kind == "choice":
        return m.grammar_from_lark("start: " + " | ".join(map(json.dumps, value)))
    if "::=" in value:  # GBNF, as llama.cpp's server takes it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            value = gbnf_to_lark(value)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        except Exception as e:  # its parser raises plain exceptions
            raise ValueError(str(e)) from None
    return m.grammar_from_lark(value)


def on_stack(size: int, name: str, fn: Callable[[], T]) -> T:
    """fn() on a new thread with a stack of `size` bytes; its result or its exception."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # handed to the caller
            box.append((False, e))

    with _STACK_LOCK:  # the size applies to threads started after it is set
        old = threading.stack_size(size)
        try:
            thread = threading.Thread(target=run, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def public_message(message: str) -> str:
    """What a client is told of a compiler's error: its first line, never a panic's backtrace or
    the parser's state (the detail goes to the server log)."""
    if "panic" in message:
        return "the grammar compiler failed on this input"
    for cut in ("<state>", "<backtrace>"):
        message = message.split(cut, 1)[0]
    lines = message.strip().splitlines()
    first = lines[0].strip() if lines else "invalid"
    return first if len(first) <= MESSAGE_CHARS else first[: MESSAGE_CHARS - 3] + "..."
