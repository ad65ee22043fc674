"""One admission point: each prompt of a request is checked once (engine/admission.py) and its
constraint compiled once, on a real server; the engine adds what was admitted without checking it
again, and a prompt refused refuses the whole request before any prompt is queued."""

from collections import Counter

import pytest

from nanoserve.engine.admission import Admission
from nanoserve.engine.structured import GrammarCompiler
from nanoserve.testing.harness import MODEL_NAME, live_server

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture
def calls(monkeypatch):
    """Counts of Admission.admit, GrammarCompiler.compile and its cache misses (_compile)."""
    counts = Counter()

    def counting(cls, name):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(Admission, "admit")
    counting(GrammarCompiler, "compile")
    counting(GrammarCompiler, "_compile")
    return counts


async def test_each_prompt_is_checked_once_and_its_constraint_compiled_once(tiny_model_dir, calls):
    body = {
        "model": MODEL_NAME, "prompt": ["one", "two", "three"], "max_tokens": 6,
        "structured_outputs": {"json": SCHEMA},
    }  # fmt: skip
    async with live_server(tiny_model_dir, num_kv_blocks=128) as server:
        calls.clear()  # the server's own start compiles nothing, but be exact
        response = await server.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 3
        assert calls == {"admit": 3, "compile": 1, "_compile": 1}
        calls.clear()
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "n", "schema": SCHEMA}}}  # fmt: skip
        response = await server.http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text
        assert calls == {"admit": 1, "compile": 1}  # the same schema: the cache has it


async def test_a_refused_prompt_refuses_the_request_before_any_is_queued(tiny_model_dir, calls):
    body = {"model": MODEL_NAME, "prompt": [[1, 2, 3], [10**7]], "max_tokens": 4}
    async with live_server(tiny_model_dir, num_kv_blocks=128) as server:
        response = await server.http.post("/v1/completions", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt"
        assert "outside the vocabulary" in response.json()["error"]["message"]
        health = (await server.http.get("/health")).json()
        assert health["generation_tokens"] == 0 and health["free_blocks"] == 128


def test_the_engine_adds_what_was_admitted_without_checking_it_again(tiny_model_dir, calls):
    from nanoserve import LLM, SamplingParams

    engine = LLM(str(tiny_model_dir), num_kv_blocks=64).engine
    admitted = engine.admit([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    assert calls["admit"] == 1
    engine.add_request("a", admitted)
    while engine.has_unfinished():
        outputs = engine.step()
    assert calls["admit"] == 1
    assert len(outputs[0].outputs[0].token_ids) == 3
