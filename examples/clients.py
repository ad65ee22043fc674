"""The clients agent builders use, against a running `nanoserve serve`: on chat completions the
openai SDK's parse() and a tool round trip, LangChain's with_structured_output and bind_tools,
instructor's TOOLS and JSON_SCHEMA modes (clients_chat.py); on the Messages API the anthropic
SDK's messages.create, messages.stream, a tool-use round trip and count_tokens, LangChain's
ChatAnthropic (clients_anthropic.py); on the Responses API the openai SDK's responses.create
(unary, streamed, a function-call round trip by previous_response_id) and responses.parse, an
openai-agents agent with a function tool, LangChain's ChatOpenAI(use_responses_api=True)
(clients_responses.py). Each prints what it got; the script exits 1 if any of them failed.

    nanoserve serve &            # the default model, SmolLM2-135M-Instruct
    python examples/clients.py [--base-url http://127.0.0.1:8000/v1]
    python examples/clients.py --serve    # starts `nanoserve serve` itself, stops it after
    python examples/clients.py --serve --model ~/models/Qwen3-0.6B --thinking off

`nox -s clients` installs the clients (anthropic, openai-agents, langchain-openai,
langchain-anthropic, instructor) and runs it with --serve.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator

import clients_anthropic
import clients_chat
import clients_responses
import openai
from client_shared import Target

CHECKS: dict[str, Callable[[Target], str]] = {
    **clients_chat.CHECKS,
    **clients_anthropic.CHECKS,
    **clients_responses.CHECKS,
}


@contextlib.contextmanager
def serve(model: str | None) -> Iterator[str]:
    """`nanoserve serve [MODEL]` on a free port; yields its OpenAI base URL."""
    command = [sys.executable, "-m", "nanoserve.cli", "serve", *([model] if model else [])]
    proc = subprocess.Popen([*command, "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            ready = re.search(r"OpenAI API at (\S+)\)", line)
            if ready:
                yield ready[1]
                return
        raise RuntimeError("nanoserve serve exited before it was ready")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_all(target: Target, only: str | None) -> int:
    failed = 0
    for name, check in CHECKS.items():
        if only is not None and only.lower() not in name.lower():
            continue
        try:
            print(f"{name}: ok: {check(target)}", flush=True)
        except Exception:
            failed += 1
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    return failed


def run(base_url: str, model: str | None, thinking: bool | None, only: str | None) -> int:
    """The checks against the server at `base_url`, asking for `model` (the server's own id
    where none is given)."""
    if model is None:
        model = openai.OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id
    print(f"{base_url}, model {model!r}, thinking {thinking}", flush=True)
    return run_all(Target(base_url, model, thinking), only)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--serve", action="store_true", help="start nanoserve serve for the run")
    ap.add_argument(
        "--model",
        help="with --serve, the model it serves (a checkpoint directory or a GGUF file; default: "
        "the default model); without, the name requests give (default: the server's own)",
    )
    ap.add_argument(
        "--thinking",
        choices=["on", "off"],
        help="switch a reasoning model's thinking on (with a budget where the API takes one) or "
        "off, in each API's words (default: send nothing, as the chat template has it)",
    )
    ap.add_argument("--only", help="run the checks whose name contains this text")
    args = ap.parse_args()
    thinking = None if args.thinking is None else args.thinking == "on"
    if args.serve:
        with serve(args.model) as base_url:
            failed = run(base_url, None, thinking, args.only)
    else:
        failed = run(args.base_url, args.model, thinking, args.only)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
