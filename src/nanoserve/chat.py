"""`nanoserve chat`: a conversation on the terminal, as `ollama run` or `llama-cli` hold one.

Each turn renders the whole conversation with the model's chat template and streams the answer
as the engine produces it. The prefix cache keeps the earlier turns' KV blocks, so a turn computes
little more than its own message: the line after each answer says how many prompt tokens came from
the cache. Commands: /reset starts over, /exit (or Ctrl-D) quits; Ctrl-C stops an answer. Owns one
Engine, driven from this thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from nanoserve.engine import Engine, RequestOutput, SamplingParams

Ask = Callable[[str], str]  # input(): the user's next line; EOFError ends the chat


class Chat:
    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None):
        self.engine = engine
        self.params = params
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self._turns = 0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def run(self, ask: Ask, out: TextIO) -> None:
        """Read lines with `ask` until /exit or end of input, answering each on `out`."""
        while True:
            try:
                line = ask(">>> ").strip()
            except EOFError:
                out.write("\n")
                return
            if line in ("/exit", "/quit", "/bye"):
                return
            if line == "/reset":
                self.reset()
                out.write("(conversation cleared)\n")
            elif line:
                self.turn(line, out)

    def turn(self, text: str, out: TextIO) -> RequestOutput | None:
        """One exchange: the answer streamed to `out`, then a line of numbers."""
        self.messages.append({"role": "user", "content": text})
        tok = self.engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template(self.messages), add_special_tokens=False)
        request_id = f"chat-{self._turns}"
        self._turns += 1
        self.engine.add_request(request_id, prompt, self.params)
        start, shown, final = time.monotonic(), 0, None
        try:
            while final is None:
                for output in self.engine.step():
                    text_so_far = output.outputs[0].text
                    out.write(text_so_far[shown:])
                    out.flush()
                    shown = len(text_so_far)
                    if output.finished:
                        final = output
        except KeyboardInterrupt:
            self.engine.abort(request_id)
            self.messages.pop()
            out.write("\n(stopped)\n")
            return None
        answer = final.outputs[0]
        self.messages.append({"role": "assistant", "content": answer.text})
        seconds = time.monotonic() - start
        out.write(
            f"\n[{len(prompt)} prompt tokens, {final.num_cached_tokens} from the prefix cache; "
            f"{len(answer.token_ids)} tokens in {seconds:.2f} s]\n"
        )
        return final
