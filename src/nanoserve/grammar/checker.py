"""The server's side of the grammar check: each new constraint is compiled first in a child
process (child.py: a zygote that forks a worker per check), so that no constraint can end or
hold the server. A crash or a stack overflow in the compiler ends only a worker, and a compile
past its time limit is killed with its worker; either way the request gets a 400. The server
then compiles what passed on a thread of BUILD_STACK bytes, four times the worker's stack, so
what the worker held the server holds.

Owns the child processes (at most `children` at once, kept between checks) and the thread that
starts one in place of one that died.
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
from typing import Any

from nanoserve.grammar.compile import public_message
from nanoserve.grammar.limits import GrammarError

log = logging.getLogger(__name__)

CHILDREN = 2  # checks at once: one slow constraint does not hold up the next
BUILD_STACK = 32 << 20
START_SECONDS = 120.0  # a new child's start: the interpreter, llguidance, the vocabulary
FORK_SECONDS = 10.0  # beyond a check's own limit, before the child itself is taken as stuck


class ChildGone(Exception):
    """The child ended (a crash) before it answered."""


class Child:
    """One child process and its pipes."""

    def __init__(self, setup: bytes):
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (its stderr, read if it dies; closed by kill)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.grammar.child"],
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
        request = {"kind": kind, "value": value, "whitespace": whitespace, "seconds": self.seconds}
        child = self._take()
        try:
            reply = child.ask(json.dumps(request).encode(), self.seconds + FORK_SECONDS)
        except (TimeoutError, ChildGone) as e:  # the child itself, not a worker: start anew
            self._drop(child)
            log.warning("the grammar checking process failed (%s)", _escaped(e or "stuck"))
            raise GrammarError(f"{where}: the grammar compiler failed on this input", param) from e
        self._give_back(child)
        if reply.get("timeout"):
            raise GrammarError(f"{where}: took more than {self.seconds:g} s to compile", param)
        if "crashed" in reply:
            log.warning("the grammar check of a %s ended its worker (%s)", where, reply["crashed"])
            raise GrammarError(f"{where}: the grammar compiler failed on this input", param)
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
        """Forget a child that is gone; one that was running is replaced at once, on the
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
