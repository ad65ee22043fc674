"""The grammar-checking process, `python -m nanoserve.grammar.child`: a zygote that builds
llguidance's view of the vocabulary once, then forks a worker for each constraint it is asked
about. The worker checks the constraint on a thread of CHECK_STACK bytes (the schema has an
instance, the grammar compiles, its first token mask allows more than the end of the output),
writes why not (or nothing) and exits. A worker that crashes or overflows its stack ends alone;
one past its time limit is killed. The zygote stays, so no check waits for a vocabulary to be
built again. Owns its workers, one at a time.

One line of JSON a message on stdin and stdout: first the vocabulary ({"tokenizer", "n_vocab",
"eos"}), answered {"ready": true}; then each constraint ({"kind", "value", "whitespace",
"seconds"}), answered {"error": null or why}, {"timeout": true} or {"crashed": how}.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import IO, Any

from nanoserve.grammar.compile import grammar_text, on_stack
from nanoserve.grammar.limits import has_instance

CHECK_STACK = 8 << 20  # the server builds on a stack four times as deep (checker.BUILD_STACK)
MEMORY_LIMIT = 4 << 30  # the address space of the zygote and its workers
ERROR_CHARS = 10_000  # of a compiler's message sent back (the client sees its first line)


def check(ll: Any, executor: Any, setup: dict[str, Any], request: dict[str, Any]) -> str | None:
    """One constraint's check: None if it compiles and has an output, else why not."""
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


def main() -> None:
    import resource

    import llguidance
    import numpy  # noqa: F401 (imported once here, not in each worker)

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = json.loads(stdin.readline())
    ll = llguidance.LLTokenizer(
        setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"]
    )
    _reply(stdout, {"ready": True})
    for line in stdin:
        _reply(stdout, in_worker(partial(_worker, ll, setup, json.loads(line)), line))


def in_worker(work: Callable[[], dict[str, Any]], line: bytes) -> dict[str, Any]:
    """work() in a forked worker, its reply read back under the request's time limit."""
    seconds = json.loads(line)["seconds"]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: no return from here
        try:
            os.close(read_end)
            with os.fdopen(write_end, "wb") as out:
                out.write(json.dumps(work()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as replies:
        data = _read_all(replies, time.monotonic() + seconds)
    if data is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"timeout": True}
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"crashed": _how(status)}
    return json.loads(data)


def _worker(ll: Any, setup: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    import llguidance

    try:
        check_ = partial(check, ll, llguidance.LLExecutor(), setup, request)
        error = on_stack(CHECK_STACK, "grammar-check", check_)
    except Exception as e:  # llguidance's panics arrive as exceptions
        error = f"{type(e).__name__}: {e}"
    return {"error": None if error is None else error[:ERROR_CHARS]}


def _read_all(pipe: IO[bytes], deadline: float) -> bytes | None:
    """Everything until the writer closes its end, or None at the deadline."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([pipe], [], [], left)[0]:
            return None
        chunk = os.read(pipe.fileno(), 1 << 16)
        if not chunk:
            return data
        data += chunk


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)} ({signal.Signals(os.WTERMSIG(status)).name})"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _reply(out: IO[bytes], message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


if __name__ == "__main__":
    main()
