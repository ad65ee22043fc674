"""/v1/embeddings on a live server, through the official openai client: vectors equal
sentence-transformers' (float and base64), Matryoshka dimensions, each bad input a 400 naming
its field, the routes a model kind does not serve refused by name, /metrics counting the
requests, and a request whose client left aborted."""

import base64
import subprocess
import sys

import numpy as np
import pytest
import torch
import trio
from sentence_transformers import SentenceTransformer

from nanoserve.engine import PoolingInput
from nanoserve.testing.harness import MODEL_NAME, live_pooling_server, live_server, serve_command

TEXTS = ["the cat and the dog", "paris is the capital of france, a city on a river", "a"]


@pytest.fixture
async def server(embedding_model_factory):
    async with live_pooling_server(embedding_model_factory("bert"), max_queue=64) as s:
        yield s


def expected(path, texts, **kwargs):
    model = SentenceTransformer(str(path), device="cpu", **kwargs)
    return model.encode(texts, normalize_embeddings=bool(kwargs))


async def test_the_openai_client_embeds(server, client, embedding_model_factory):
    reference = expected(embedding_model_factory("bert"), TEXTS)
    # The client asks for base64 and decodes it when no encoding_format is given.
    got = await client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in got.data], reference, atol=1e-5)
    tokens = sum(len(server.engine.tokenizer.encode(t)) for t in TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    floats = await client.embeddings.create(model=MODEL_NAME, input=TEXTS[1],
                                            encoding_format="float")  # fmt: skip
    np.testing.assert_allclose(floats.data[0].embedding, reference[1], atol=1e-5)
    raw = await client.embeddings.create(model=MODEL_NAME, input=TEXTS[1],
                                         encoding_format="base64")  # fmt: skip
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.float32(floats.data[0].embedding))
    ids = server.engine.tokenizer.encode(TEXTS[0])
    by_ids = await client.embeddings.create(model=MODEL_NAME, input=[ids, ids], user="u")
    np.testing.assert_allclose(by_ids.data[1].embedding, reference[0], atol=1e-5)


async def test_matryoshka_dimensions_are_truncated_and_renormalized(embedding_model_factory):
    path = embedding_model_factory("bert", matryoshka_dimensions=[16, 32])
    async with live_pooling_server(path) as s:
        body = {"input": TEXTS, "dimensions": 16, "encoding_format": "float"}
        data = (await s.http.post("/v1/embeddings", json=body)).json()["data"]
        got = np.array([d["embedding"] for d in data])
        reference = expected(path, TEXTS, truncate_dim=16)
        np.testing.assert_allclose(got, reference, atol=1e-5)
        refused = await s.http.post("/v1/embeddings", json={"input": "a", "dimensions": 20})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "the cat " * 100}, "input"),  # over the 128-token context
        ({"input": [[100000]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": "a", "dimensions": 8}, "dimensions"),  # the model declares none
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "a", "pooling": "max"}, "pooling"),
        ({"input": "a", "model": "other"}, "model"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(server, body, param):
    response = await server.http.post("/v1/embeddings", json=body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param
    await server.wait_idle()


async def test_too_many_inputs_for_the_queue_are_refused(embedding_model_factory):
    async with live_pooling_server(embedding_model_factory("bert"), max_queue=2) as s:
        response = await s.http.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "input"


async def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    body = {"input": "the cat " * 100, "truncate_prompt_tokens": 10}
    response = await server.http.post("/v1/embeddings", json=body)
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == 10


async def test_an_embedding_model_serves_no_generation(server):
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        response = await server.http.post(path, json=body)
        assert response.status_code == 400, path
        error = response.json()["error"]
        assert error["param"] == "model" and path in error["message"]


async def test_a_generative_model_refuses_embeddings_by_name(tiny_model_dir):
    async with live_server(tiny_model_dir) as s:
        for path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
            body = {"input": "a", "query": "a", "documents": ["b"], "text_1": "a", "text_2": "b"}
            body = {k: v for k, v in body.items() if (k == "input") == (path == "/v1/embeddings")
                    and (k.startswith("text") == (path == "/v1/score"))}  # fmt: skip
            response = await s.http.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["param"] == "model" and "generative" in error["message"]


async def test_metrics_count_embedding_requests_and_their_tokens(server):
    await server.http.post("/v1/embeddings", json={"input": "a"})  # the counters' first samples
    before = await server.metric("nanoserve:prompt_tokens_total")
    done = await server.metric("nanoserve:request_success_total")
    response = await server.http.post("/v1/embeddings", json={"input": TEXTS})
    tokens = response.json()["usage"]["prompt_tokens"]
    assert await server.metric("nanoserve:prompt_tokens_total") == before + tokens
    assert await server.metric("nanoserve:request_success_total") == done + len(TEXTS)


async def test_inputs_of_a_client_that_left_are_aborted(embedding_model_factory):
    """The handler is cancelled (a disconnect) while its inputs run one a step: those still
    waiting are aborted and never computed, and nothing stays queued."""
    path = embedding_model_factory("bert")
    async with live_pooling_server(path, max_num_batched_tokens=4) as server:
        ids = server.engine.tokenizer.encode("the cat")
        assert len(ids) == 4  # one input a step
        async with trio.open_nursery() as nursery:
            inputs = [PoolingInput(ids) for _ in range(40)]
            nursery.start_soon(server.serving.pool, inputs)
            await server.wait_until(lambda h: h["steps"] >= 1)
            nursery.cancel_scope.cancel()
        await server.wait_idle()
        aborted = await server.metric("nanoserve:requests_aborted_total")
        computed = server.engine.stats().computed_tokens
        assert aborted > 0 and computed + aborted * len(ids) == len(inputs) * len(ids)
        response = await server.http.post("/v1/embeddings", json={"input": "a"})
        assert response.status_code == 200  # still serves


async def test_a_decoder_serves_embeddings_under_runner_pooling(embedding_model_factory):
    path = embedding_model_factory("decoder")
    async with live_pooling_server(path, runner="pooling") as s:
        response = await s.http.post("/v1/embeddings", json={"input": TEXTS})
        got = torch.tensor([d["embedding"] for d in response.json()["data"]])
    torch.testing.assert_close(got, torch.tensor(expected(path, TEXTS)), atol=1e-5, rtol=1e-4)


async def test_nanoserve_serve_runs_an_encoder_and_a_decoder_as_embedders(embedding_model_factory):
    for path, flags in [
        (embedding_model_factory("bert"), ()),
        (embedding_model_factory("decoder"), ("--convert", "embed")),
    ]:
        async with serve_command(path, *flags) as (_, server):
            response = await server.http.post("/v1/embeddings", json={"input": TEXTS})
            assert response.status_code == 200, response.text
            got = torch.tensor([d["embedding"] for d in response.json()["data"]])
            reference = torch.tensor(expected(path, TEXTS))
            torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-4)


def test_an_encoder_under_runner_generate_is_a_usage_error(embedding_model_factory):
    path = embedding_model_factory("bert")
    command = [sys.executable, "-m", "nanoserve.cli", "serve", str(path), "--runner", "generate"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--runner" in result.stderr, result.stderr


async def test_langchain_embeds(server, embedding_model_factory):
    """LangChain's OpenAIEmbeddings, as RAG stacks call it (strings: without tiktoken's
    context check, which would download OpenAI's vocabulary); its sync client in a thread."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=MODEL_NAME, base_url=server.url + "/v1", api_key="unused",
        check_embedding_ctx_length=False, max_retries=0,
    )  # fmt: skip
    documents = await trio.to_thread.run_sync(embeddings.embed_documents, TEXTS)
    query = await trio.to_thread.run_sync(embeddings.embed_query, TEXTS[1])
    reference = expected(embedding_model_factory("bert"), TEXTS)
    np.testing.assert_allclose(documents, reference, atol=1e-5)
    np.testing.assert_allclose(query, reference[1], atol=1e-5)
