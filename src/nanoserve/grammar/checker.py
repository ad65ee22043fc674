"""Compiles each new constraint first in a child process, `python -m nanoserve.grammar.checker`,
so that no constraint can end or hold the server: a crash or a stack overflow in the compiler
ends only the child, and a compile past its time limit is killed with it. Either way the request
gets a 400 and the next compile starts a new child.

The child builds llguidance's view of the vocabulary once, then checks one constraint at a time
on a thread of CHECK_STACK bytes: the schema has an instance, the grammar compiles, and its first
token mask allows more than the end of the output (an empty language allows nothing else). The
server then compiles what passed on a thread of BUILD_STACK bytes, four times as deep, so what
the child held the server holds.

Owns the children (at most `children` at once, kept between checks), the thread that starts one
in place of a killed one, and the thread that builds.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import IO, Any, TypeVar

from nanoserve.grammar.limits import GrammarError, has_instance

log = logging.getLogger(__name__)

CHILDREN = 2  # checks at once: one slow constraint does not hold up the next
CHECK_STACK = 8 << 20
BUILD_STACK = 32 << 20
START_SECONDS = 120.0  # a new child's start: the interpreter, llguidance, the vocabulary
MESSAGE_CHARS = 300  # of a compiler's error, as a client is told it (it may quote the input)
MEMORY_LIMIT = 4 << 30  # a child's address space: a compile that would take more fails there
# Whitespace a JSON output may put between two tokens, unless the request says otherwise: enough
# for an indented document, bounded so that a small model cannot spend its tokens on blanks.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"
_VALUES = frozenset(["const", "enum", "default", "examples"])  # JSON values, not schemas
# Maps of names (a property's, a definition's) to schemas: a name there is not a keyword.
_NAMED = frozenset(["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"])

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


_STACK_LOCK = threading.Lock()


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


# -- the child ---------------------------------------------------------------------------------


def check(ll: Any, executor: Any, setup: dict[str, Any], request: dict[str, Any]) -> str | None:
    """The child's check of one constraint: None if it compiles and has an output, else why
    not."""
    import llguidance
    import numpy as np

    kind, value = request["kind"], request["value"]
    n_vocab, eos = setup["n_vocab"], setup["eos"]
    if kind == "json" and not has_instance(json.loads(value) if isinstance(value, str) else value):
        return "no JSON value satisfies it (an empty enum or anyOf, or a $ref cycle with no exit)"
    try:
        grammar = grammar_text(kind, value, request["whitespace"])
    except (ValueError, TypeError, RecursionError) as e:
        return str(e) or type(e).__name__
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        return matcher.get_error()
    words = -(-n_vocab // 32)
    mask = np.zeros(words, dtype=np.int32)
    executor.unsafe_compute_mask_ptr([(matcher, 0)], mask.ctypes.data, words * 4, 1)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")
    allowed[[t for t in eos if t < len(allowed)]] = 0
    if matcher.is_error() or (not allowed.any() and not matcher.is_accepting()):
        return "no output satisfies this constraint"
    return None


def child_main() -> None:
    """Reads the vocabulary, then one constraint a line from stdin; writes a reply a line."""
    import resource

    import llguidance

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = json.loads(stdin.readline())
    ll = llguidance.LLTokenizer(
        setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"]
    )
    executor = llguidance.LLExecutor()
    _reply(stdout, {"ready": True})
    for line in stdin:
        request = json.loads(line)
        try:
            error = on_stack(
                CHECK_STACK, "grammar-check", partial(check, ll, executor, setup, request)
            )
        except Exception as e:  # llguidance's panics arrive as exceptions
            error = f"{type(e).__name__}: {e}"
        _reply(stdout, {"error": error})


def _reply(out: IO[bytes], message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


# -- the server's side -------------------------------------------------------------------------


class ChildGone(Exception):
    """The child ended (a crash) before it answered."""


class Child:
    """One child process and its pipes."""

    def __init__(self, setup: bytes):
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (its stderr, read if it dies; closed by kill)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.grammar.checker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
            env={**os.environ, "RUST_BACKTRACE": "0"},
        )  # fmt: skip
        self._buffer = b""
        try:
            self.ask(setup, START_SECONDS)
        except BaseException:
            self.kill()
            raise

    def ask(self, line: bytes, seconds: float) -> dict[str, Any]:
        """Send one line, wait at most `seconds` for the reply. TimeoutError, or ChildGone."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(line + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise ChildGone(self.why()) from None
        return json.loads(self._read_line(time.monotonic() + seconds))

    def _read_line(self, deadline: float) -> bytes:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise ChildGone(self.why())
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def why(self) -> str:
        """How the child ended, with the end of what it wrote to stderr."""
        code = self.process.wait()
        self.errors.seek(0)
        tail = self.errors.read()[-2000:].decode(errors="replace").strip()
        return f"exit status {code}" + (f": {tail}" if tail else "")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        self.errors.close()


class GrammarChecker:
    """Checks constraints in child processes, at most `children` at once (a check waits for a
    free one); each check may take `seconds`."""

    def __init__(
        self, setup: Callable[[], dict[str, Any]], seconds: float, children: int = CHILDREN
    ):
        self._setup = setup  # the vocabulary, built only when a first child starts
        self.seconds = seconds
        self._children = children
        self._idle: list[Child] = []
        self._started = 0
        self._free = threading.Condition()
        self._closed = False

    def check(self, kind: str, value: Any, whitespace: str | None, param: str) -> None:
        """Raises GrammarError (naming `param`) for a constraint that fails, crashes the
        compiler or takes too long."""
        where = f"{param}.{kind}"
        line = json.dumps({"kind": kind, "value": value, "whitespace": whitespace}).encode()
        child = self._take()
        try:
            reply = child.ask(line, self.seconds)
        except TimeoutError:
            self._drop(child)
            raise GrammarError(
                f"{where}: took more than {self.seconds:g} s to compile", param
            ) from None
        except ChildGone as e:
            self._drop(child)
            log.warning("the grammar check of a %s ended its process (%s)", where, _escaped(e))
            raise GrammarError(f"{where}: the grammar compiler failed on this input", param) from e
        self._give_back(child)
        if reply["error"] is not None:
            message = public_message(reply["error"])
            if message != reply["error"]:
                log.info("grammar check of a %s: %s", where, _escaped(reply["error"]))
            raise GrammarError(f"{where}: {message}", param)

    def close(self) -> None:
        """Stop the children; one busy now stops when its check ends."""
        with self._free:
            self._closed = True
            idle, self._idle = self._idle, []
            self._started -= len(idle)
            self._free.notify_all()
        for child in idle:
            child.kill()

    def _take(self) -> Child:
        with self._free:
            while not self._idle and self._started >= self._children:
                self._free.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        return self._start()

    def _start(self) -> Child:
        try:
            return Child(json.dumps(self._setup()).encode())
        except BaseException:
            self._drop(None)
            raise

    def _give_back(self, child: Child) -> None:
        with self._free:
            if not self._closed:
                self._idle.append(child)
                self._free.notify()
                return
        self._drop(child)

    def _drop(self, child: Child | None) -> None:
        """Forget a child that is gone; a killed one is replaced at once, on the
        "grammar-start" thread, so that the next check does not wait for a start."""
        if child is not None:
            child.kill()
            with self._free:
                if not self._closed:  # its place stays taken by the replacement
                    name = "grammar-start"
                    threading.Thread(target=self._replace, name=name, daemon=True).start()
                    return
        with self._free:
            self._started -= 1
            self._free.notify()

    def _replace(self) -> None:
        try:
            self._give_back(self._start())
        except Exception as e:  # the next check starts one, or reports why it cannot
            log.warning("could not start a grammar checking process: %s", _escaped(e))


def _escaped(value: object) -> str:
    return str(value).encode("unicode_escape").decode("ascii")[:4000]


if __name__ == "__main__":
    child_main()
