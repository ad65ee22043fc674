"""Tool calls: the functions a chat request offers, put in the prompt, constrained by a grammar
when a call is required, and read back out of the generated text as OpenAI's `tool_calls`.

Four syntaxes, chosen from the chat template: Hermes's (`<tool_call>{"name": ..., "arguments":
...}</tool_call>`, which Qwen 2.5 and 3, SmolLM3 and Hermes use), Llama 3's JSON (`{"name":
..., "parameters": ...}`), Mistral's (the control token `[TOOL_CALLS]`, then a JSON list of
`{"name": ..., "arguments": ...}`; its template wants call ids of 9 letters and digits, so the
calls get such ids and a conversation's ids are cut to 9 where it renders them) and gpt-oss's
harmony messages (`HarmonyTools`, vLLM's `openai` tool parser). A template that
renders no tools (SmolLM2's) gets the Hermes syntax and a system message describing the tools,
as Hermes models are prompted. Owns nothing.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nanoserve.engine import StructuredOutputsParams, closed_schema
from nanoserve.server import harmony


@dataclass(frozen=True)
class ToolSyntax:
    name: str
    open: str  # what starts a call ("" when a call is bare JSON)
    close: str
    arguments: str  # the key of the arguments object
    listed: bool = False  # the calls are one JSON list after `open` (Mistral's)
    special: bool = False  # `open` is a control token: the text keeps special tokens to see it
    id_chars: int = 0  # call ids of this many letters and digits (Mistral's 9); 0: "call_..."

    def grammar(
        self, tools: list[dict[str, Any]], parallel: bool, tags: Mapping[str, int] | None = None
    ) -> StructuredOutputsParams:
        """A call (or several, when `parallel`) of one of `tools`, its arguments matching that
        function's JSON schema. `tags`: the syntax's tags (`tags()`) that are tokens of the
        vocabulary, and their ids: the grammar names those tokens (llguidance reads an added
        token as itself, never as its text: Qwen's `<tool_call>` is one, Mistral's control
        token too)."""
        tags = tags or {}
        # Each tool's schema sits inside the call's; its local `$ref`s are made to point there.
        at = [""] if len(tools) == 1 else [f"/anyOf/{k}" for k in range(len(tools))]
        bodies = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["name"]},
                    self.arguments: rebased(
                        closed_schema(t.get("parameters") or {"type": "object"}),
                        f"{where}/properties/{self.arguments}",
                    ),
                },
                "required": ["name", self.arguments],
                "additionalProperties": False,
            }
            for t, where in zip(tools, at, strict=True)
        ]
        body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        # Calls are written on one line, `{"name": "f", "arguments": {...}}`, as the templates
        # show them: at most one space between two tokens.
        body = {**body, "x-guidance": {"whitespace_pattern": "[ ]?"}}
        if self.listed:  # [TOOL_CALLS] [{...}, {...}]
            opener = " ".join(self._literal(self.open, tags))
            more = ' ("," " "? body)*' if parallel else ""
            lark = f'start: {opener} " "? "[" body{more} "]"\nbody: %json {json.dumps(body)}\n'
            return StructuredOutputsParams(grammar=lark, param="tools")
        call = " ".join([*self._literal(self.open, tags), "body", *self._literal(self.close, tags)])
        separator = '"\\n"' if self.open else '"; "'
        repeat = f" ({separator} call)*" if parallel else ""
        lark = f"start: call{repeat}\ncall: {call}\nbody: %json {json.dumps(body)}\n"
        return StructuredOutputsParams(grammar=lark, param="tools")

    def call_id(self) -> str:
        """A new call's id."""
        if self.id_chars:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_chars))
        return call_id()

    def rendered_id(self, given: str) -> str:
        """A conversation's call id as the template takes it: Mistral's, its last 9 letters and
        digits (zeros in front of a shorter one); the same id always gives the same."""
        if not self.id_chars:
            return given
        return re.sub("[^A-Za-z0-9]", "", given)[-self.id_chars :].rjust(self.id_chars, "0")

    def tags(self) -> list[str]:
        """What opens and closes a call, less whitespace (`<tool_call>`, `[TOOL_CALLS]`)."""
        return [t for t in (self.open.strip(), self.close.strip()) if t]

    @staticmethod
    def _literal(text: str, tags: Mapping[str, int]) -> list[str]:
        """`text` as a grammar's items: each of `tags` by its token id, the rest as strings."""
        pieces = re.split("(" + "|".join(map(re.escape, tags)) + ")", text) if tags else [text]
        return [f"<[{tags[p]}]>" if p in tags else json.dumps(p) for p in pieces if p]

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
        """The content before the first call (None if only whitespace) and the calls, each
        {"name", "arguments" (a JSON string)}. Text that is not a call of a known tool stays
        content."""
        first, calls = self.split(text, names)
        if first is None:
            return text, []
        return text[:first].strip() or None, calls

    def split(self, text: str, names: set[str]) -> tuple[int | None, list[dict[str, Any]]]:
        """Where the first complete call of a known tool starts (None: no call), and the
        calls."""
        calls: list[dict[str, Any]] = []
        first = None
        for start, call in self._calls(text):
            if not isinstance(call, dict):
                continue
            if call.get("name") not in names or not isinstance(call.get(self.arguments), dict):
                continue
            first = start if first is None else first
            arguments = json.dumps(call[self.arguments], ensure_ascii=False)
            calls.append({"name": call["name"], "arguments": arguments})
        return first, calls

    def _calls(self, text: str) -> list[tuple[int, Any]]:
        found: list[tuple[int, Any]] = []
        decoder = json.JSONDecoder()
        opener = re.escape(self.open) if self.open else r"(?:<\|python_tag\|>)?(?=\{)"
        resume = 0  # a call's own braces are not calls
        for match in re.finditer(opener, text):
            if match.start() < resume:
                continue
            at = match.end()
            while at < len(text) and text[at].isspace():
                at += 1
            try:
                value, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                found.append((match.start(), value))
                resume = end
            elif self.listed and isinstance(value, list):  # every call at the opener's place
                found += [(match.start(), v) for v in value]
                resume = end
        return found

    def may_start(self, text: str) -> int:
        """Where a call may begin in streamed `text` (len(text) if nowhere): text before it
        can be sent as content."""
        if self.open:
            at = text.find(self.open)
            if at >= 0:
                return at
            for keep in range(min(len(self.open) - 1, len(text)), 0, -1):
                if self.open.startswith(text[-keep:]):
                    return len(text) - keep
            return len(text)
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{<":
            return 0  # bare JSON calls are the whole answer
        return len(text)


_VALUES = frozenset(["const", "enum", "default", "examples"])  # JSON values, not schemas
# Maps of names (a property's, a definition's) to schemas: a name is not a keyword.
_NAMED = frozenset(["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"])


def rebased(schema: Any, pointer: str) -> Any:
    """`schema` as it reads placed at JSON pointer `pointer` of a larger schema: each local
    `$ref` (`#`, or `#/` and a pointer: `#/$defs/...`, `#/definitions/...`) points under
    `pointer`, so that it still names the part of `schema` it named. Other references (another
    document's, an anchor's), JSON values (`const`, `enum`, ...) and a part with its own `$id`
    (its references start from it: a document of its own) are left as they are."""
    if isinstance(schema, list):
        return [rebased(x, pointer) for x in schema]
    if not isinstance(schema, dict) or isinstance(schema.get("$id"), str):
        return schema
    out = {k: _rebased_part(k, v, pointer) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + pointer + ref[1:]
    return out


def _rebased_part(key: str, value: Any, pointer: str) -> Any:
    if key in _VALUES:
        return value
    if key in _NAMED and isinstance(value, dict):  # names, each of a schema
        return {name: rebased(v, pointer) for name, v in value.items()}
    return rebased(value, pointer)


@dataclass(frozen=True)
class HarmonyTools(ToolSyntax):
    """gpt-oss's calls: commentary messages to `functions.NAME`, each body the arguments, which
    the harmony reasoning parser (server/reasoning.py) writes in the answer as
    `<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>`. The arguments are
    passed on as the model wrote them where they are not JSON: the header made it a call."""

    def grammar(
        self, tools: list[dict[str, Any]], parallel: bool, tags: Mapping[str, int] | None = None
    ) -> StructuredOutputsParams:
        """One call of one of `tools`: `<|channel|>commentary to=functions.NAME`, perhaps
        ` <|constrain|>json`, then `<|message|>`, the arguments (matching NAME's schema) and
        `<|call|>`, which ends the turn (so one call, whatever `parallel`). The engine starts it
        where the analysis has ended (chat_plan: the thinking's end is harmony.NEXT_MESSAGE
        then), so that the model thinks first."""
        tags = tags or {}

        def items(text: str) -> str:
            return " ".join(self._literal(text, tags))

        rules, calls = [], []
        for k, t in enumerate(tools):
            header = items(f"{harmony.CHANNEL}commentary to={harmony.FUNCTIONS}{t['name']}")
            typed = items(f" {harmony.CONSTRAIN}json")
            calls.append(
                f"{header} ({typed})? {items(harmony.MESSAGE)} body{k} {items(harmony.CALL)}"
            )
            schema = closed_schema(t.get("parameters") or {"type": "object"})
            rules.append(f"body{k}: %json {json.dumps(schema)}")
        lark = "start: " + " | ".join(f"({c})" for c in calls) + "\n" + "\n".join(rules) + "\n"
        return StructuredOutputsParams(grammar=lark, param="tools")

    def tags(self) -> list[str]:
        return [harmony.CHANNEL, harmony.MESSAGE, harmony.CALL, harmony.CONSTRAIN]

    def split(self, text: str, names: set[str]) -> tuple[int | None, list[dict[str, Any]]]:
        first = None
        calls: list[dict[str, Any]] = []
        for match in _HARMONY_CALL.finditer(text):
            if match.group(1) not in names:
                continue
            first = match.start() if first is None else first
            calls.append({"name": match.group(1), "arguments": _compact(match.group(2))})
        return first, calls


_HARMONY_CALL = re.compile(
    re.escape(f"{harmony.CHANNEL}commentary to={harmony.FUNCTIONS}") + r"(\S+?)"
    + re.escape(harmony.MESSAGE) + "(.*?)" + re.escape(harmony.CALL), re.DOTALL,
)  # fmt: skip


def _compact(arguments: str) -> str:
    """JSON arguments as the other syntaxes give them; other text as it is."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


HERMES = ToolSyntax("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
LLAMA3_JSON = ToolSyntax("llama3_json", "", "", "parameters")
MISTRAL = ToolSyntax(
    "mistral", "[TOOL_CALLS]", "", "arguments", listed=True, special=True, id_chars=9
)
HARMONY_TOOLS = HarmonyTools("openai", harmony.CHANNEL, harmony.CALL, "arguments", special=True)


def syntax_for(chat_template: str | None) -> tuple[ToolSyntax, bool]:
    """The model family's call syntax, and whether its template renders the tools itself."""
    template = chat_template or ""
    native = "tools" in template
    if native and harmony.is_harmony(template):
        return HARMONY_TOOLS, True
    if native and "[TOOL_CALLS]" in template:
        return MISTRAL, True
    if native and "<tool_call>" not in template and "<|eot_id|>" in template:
        return LLAMA3_JSON, True
    return HERMES, native


def functions(tools: list[Any]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools]


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes's instructions, for a template that renders no tools."""
    signatures = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user "
        "query. Don't make assumptions about what values to plug into functions.\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "For each function call return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_history(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    native: bool,
    syntax: ToolSyntax = HERMES,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and template variables for a conversation with tools. A native template gets
    `tools` and the assistant's calls with their arguments as objects (as transformers passes
    them), their ids as `syntax` renders them; otherwise calls and results become Hermes text,
    and the tools a system message."""
    if native:
        out = [_native(m, syntax) for m in messages]
        return out, {"tools": [{"type": "function", "function": t} for t in tools or []] or None}
    out = [_as_text(m) for m in messages]
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _native(message: dict[str, Any], syntax: ToolSyntax) -> dict[str, Any]:
    if isinstance(message.get("tool_call_id"), str):
        message = {**message, "tool_call_id": syntax.rendered_id(message["tool_call_id"])}
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = [
        {**c, "function": {**c["function"], "arguments": _arguments(c["function"])},
         **({"id": syntax.rendered_id(c["id"])} if isinstance(c.get("id"), str) else {})}
        for c in calls
    ]  # fmt: skip
    return {**message, "tool_calls": parsed}


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "\n".join(
        HERMES.open + json.dumps({"name": c["function"]["name"],
                                  "arguments": _arguments(c["function"])}) + HERMES.close
        for c in calls
    )  # fmt: skip
    content = message.get("content") or ""
    return {"role": "assistant", "content": f"{content}\n{text}".strip()}


def _arguments(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
