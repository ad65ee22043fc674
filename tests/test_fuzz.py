"""Property-based fuzzing of the request schema (hypothesis) against one live server.

Bodies are built from the real field names (read from the pydantic models, so a new field is
fuzzed without touching this file), each given a value of the right type or junk: NaN and
infinities, huge integers, unicode, nested lists and objects; plus raw bytes and corrupted JSON.
The properties: never a 5xx; a 4xx carries an OpenAI-shaped error; a 200 is a whole answer (a
stream ends with [DONE] and carries no error event). Afterwards the server gives the answer it
gave before the fuzzing, and the pool is back (ledger audit and counts).

The server runs in a thread with its own `trio.run` for the whole module; hypothesis drives it
with a plain `httpx.Client`. Examples are few and derandomized, so CI runs the same ones.
"""

import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from queue import Queue

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.testing.crowd import check_pool_returned
from nanoserve.testing.harness import MODEL_NAME, WAIT_S, LiveServer, live_server, sse_data

C, X = "/v1/completions", "/v1/chat/completions"
EXAMPLES = 60
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NORMAL = {"model": MODEL_NAME, "prompt": "She wrote the weather", "max_tokens": 8, "temperature": 0}


# -- the server, in its own thread ----------------------------------------------------------


@dataclass
class Fuzzed:
    server: LiveServer
    token: trio.lowlevel.TrioToken
    http: httpx.Client
    baseline: str = ""  # the answer to NORMAL before any fuzzing
    statuses: Counter = field(default_factory=Counter)

    def post(self, path: str, content: bytes) -> httpx.Response:
        response = self.http.post(
            path, content=content, headers={"Content-Type": "application/json"}
        )
        self.statuses[response.status_code] += 1
        return response

    def normal_answer(self) -> str:
        response = self.http.post(C, json=NORMAL)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    def check_recovered(self) -> None:
        """The server is healthy, answers as before, and every block came back."""
        assert self.http.get("/health").json()["status"] == "ok"
        assert self.normal_answer() == self.baseline
        trio.from_thread.run(check_pool_returned, self.server, trio_token=self.token)


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir) -> Iterator[Fuzzed]:
    """One live server for the module, in a "fuzz-server" thread running its own Trio loop."""
    started: Queue = Queue()
    errors: list[BaseException] = []

    async def serve() -> None:
        async with live_server(tiny_model_dir, num_kv_blocks=256) as server:
            stop = trio.Event()
            started.put((server, trio.lowlevel.current_trio_token(), stop))
            await stop.wait()

    def main() -> None:
        try:
            trio.run(serve)
        except BaseException as e:
            errors.append(e)
            started.put(e)

    thread = threading.Thread(target=main, name="fuzz-server", daemon=True)
    thread.start()
    ready = started.get(timeout=WAIT_S)
    if isinstance(ready, BaseException):
        raise ready
    server, token, stop = ready
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
            f = Fuzzed(server, token, http)
            f.baseline = f.normal_answer()
            yield f
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(timeout=WAIT_S)
    assert not thread.is_alive() and not errors, errors


# -- strategies ------------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=()), max_size=24)  # lone surrogates too
HUGE = st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, -(10**400)])
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
JUNK = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=8,
)
# Budgets are small when valid, so a valid example generates a few tokens, never 2000.
BUDGET = st.one_of(
    st.integers(1, 6),
    st.integers(max_value=0),
    st.integers(min_value=2049),
    HUGE,
    st.floats(allow_nan=True),
    TEXT,
    st.booleans(),
    st.lists(LEAF, max_size=2),
)
TOKEN_IDS = st.lists(st.integers(0, 1100), min_size=1, max_size=8)  # the vocabulary is 1024
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]) | TEXT}, optional={"text": TEXT | JUNK}
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]),
        "content": st.one_of(TEXT, st.none(), st.lists(PART, max_size=3), JUNK),
    },
    optional={"name": TEXT | JUNK, "tool_calls": JUNK},
)
RIGHT = {  # a value of the right type (not always a valid one) per field
    "model": st.sampled_from([MODEL_NAME, "gpt-4"]) | TEXT,
    "prompt": st.one_of(
        TEXT,
        st.lists(TEXT, min_size=1, max_size=3),
        TOKEN_IDS,
        st.lists(TOKEN_IDS, min_size=1, max_size=3),
    ),
    "messages": st.lists(MESSAGE | JUNK, max_size=3),
    "n": st.integers(0, 17),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-30, 1e308]),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 2000),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 10),
    "seed": st.integers() | HUGE,
    "stop": TEXT | st.lists(TEXT, max_size=4),
    "stop_token_ids": TOKEN_IDS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logprobs": st.integers(0, 21) | st.booleans(),
    "top_logprobs": st.integers(0, 21),
    "min_tokens": st.integers(0, 8),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=3),
    "logit_bias": st.dictionaries(TEXT, st.floats(-100, 100), max_size=2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["bos_token", "messages", "add_generation_prompt", "tools", "loop"]) | TEXT,
        JUNK,
        max_size=3,
    ),
}
BUDGETS = {"max_tokens", "max_completion_tokens"}
# Unknown names, some of them shaped like pydantic's union tags (once mistaken for them: a 500).
TAG_LIKE = ["x-request-id", "max_tokens ", "\u0000", "str", "int"]
UNKNOWN = ["repeat_penalty", "prompt_token_ids", "", "Prompt", "MAX_TOKENS", *TAG_LIKE]


@st.composite
def bodies(draw: st.DrawFn, path: str) -> dict:
    """A minimal valid body for `path`, then up to six fields set either to values of the right
    type, or (real or unknown fields) to the right type or junk; sometimes the required field is
    dropped."""
    model = CompletionRequest if path == C else ChatCompletionRequest
    required = "prompt" if path == C else "messages"
    budget = "max_tokens" if path == C else "max_completion_tokens"
    body: dict = {"model": MODEL_NAME, budget: 4}
    body[required] = "hi" if path == C else [{"role": "user", "content": "hi"}]
    if draw(st.booleans()):  # right types only, so that about half the examples are answered
        names = st.sampled_from(sorted(set(model.model_fields) & set(RIGHT)))
        values = RIGHT
    else:
        names = st.sampled_from(sorted(model.model_fields) + UNKNOWN)
        values = {name: right | JUNK for name, right in RIGHT.items()}
    for name in draw(st.lists(names, max_size=6, unique=True)):
        body[name] = draw(BUDGET if name in BUDGETS else values.get(name, JUNK))
    if path == X and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 4  # max_tokens may be null: keep every answer short
    if draw(st.integers(0, 9)) == 0:
        del body[required]
    return body


def encoded(body: dict, ascii_only: bool) -> bytes:
    return json.dumps(body, ensure_ascii=ascii_only, allow_nan=True).encode(
        "utf-8", "surrogatepass"
    )


@st.composite
def corrupted(draw: st.DrawFn) -> bytes:
    """Raw bytes, or a valid request's bytes cut short or with random bytes spliced in."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=256))
    data = encoded(draw(bodies(C)), ascii_only=False)
    at = draw(st.integers(0, len(data)))
    if draw(st.booleans()):
        return data[:at]
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]


# -- the properties --------------------------------------------------------------------------


def check(response: httpx.Response, stream: bool) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if status >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error", error
        return
    assert status == 200
    if stream and response.headers["content-type"].startswith("text/event-stream"):
        events = sse_data(response.content)
        assert events[-1] == "[DONE]", events[-2:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-1]
        finished = {ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")}
        assert finished, "no choice finished"
    else:
        choices = response.json()["choices"]
        assert choices and all(c["finish_reason"] is not None for c in choices)


@pytest.mark.parametrize("path", [C, X], ids=["completions", "chat"])
def test_fuzzed_bodies_never_get_a_5xx(fuzzed, path):
    @FUZZ
    @given(body=bodies(path), ascii_only=st.booleans())
    def examples(body: dict, ascii_only: bool) -> None:
        check(fuzzed.post(path, encoded(body, ascii_only)), body.get("stream") is True)

    before = fuzzed.statuses.copy()
    examples()
    seen = fuzzed.statuses - before
    print(f"\n[fuzz {path}] {seen.total()} examples: {dict(sorted(seen.items()))}")
    assert seen[200] >= 5 and seen[400] >= 5, f"the fuzzing never reached one side: {seen}"
    fuzzed.check_recovered()


def test_raw_and_corrupted_bytes_never_get_a_5xx(fuzzed):
    @FUZZ
    @given(data=corrupted())
    def examples(data: bytes) -> None:
        check(fuzzed.post(C, data), stream=b'"stream": true' in data)

    before = fuzzed.statuses.copy()
    examples()
    seen = fuzzed.statuses - before
    print(f"\n[fuzz bytes] {seen.total()} examples: {dict(sorted(seen.items()))}")
    assert seen[400] >= 5
    fuzzed.check_recovered()


# -- edge values found while writing the strategies ------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-320])
def test_a_vanishing_temperature_answers_like_greedy(fuzzed, temperature):
    body = {**NORMAL, "temperature": temperature, "seed": 0}
    response = fuzzed.http.post(C, json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == fuzzed.baseline


@pytest.mark.parametrize("name", TAG_LIKE)
def test_unknown_fields_with_any_name_are_400(fuzzed, name):
    response = fuzzed.http.post(C, json={**NORMAL, name: 1})
    check(response, stream=False)
    error = response.json()["error"]
    assert (
        response.status_code == 400
        and error["param"] == name
        and "unrecognized" in error["message"]
    )
