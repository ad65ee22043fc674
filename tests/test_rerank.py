"""A cross-encoder (BertForSequenceClassification, one label): its scores equal
sentence-transformers' CrossEncoder.predict (sigmoid of the logit) in the pooling engine and
through /v1/rerank and /v1/score on a live server, which rank by them, and LLM.score; bad input
is a 400 naming the field."""

import pytest
import torch
from sentence_transformers import CrossEncoder

from nanoserve.engine import PoolingEngine
from nanoserve.llm import LLM
from nanoserve.testing.harness import live_pooling_server

QUERY = "what is the capital of france"
DOCUMENTS = [
    "the cat and the dog",
    "paris is the capital of france",
    "a river runs to the sea when the tide is low and the moon is up",
    "france",
    "what is the capital",
]


@pytest.fixture(scope="module")
def expected(embedding_model_factory):
    model = CrossEncoder(str(embedding_model_factory("cross_encoder")), device="cpu")
    return model.predict([(QUERY, d) for d in DOCUMENTS]).tolist()


def test_scores_equal_the_cross_encoders(embedding_model_factory, expected):
    engine = PoolingEngine(embedding_model_factory("cross_encoder"))
    assert engine.classifies and engine.num_labels == 1
    for i, document in enumerate(DOCUMENTS):
        engine.add_request(str(i), engine.admit_pair(QUERY, document, "documents"))
    batched = [o.data[0] for o in engine.step()]
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=0)
    engine.add_request("x", engine.admit_pair(QUERY, DOCUMENTS[2], "documents"))
    assert engine.step()[0].data[0] == batched[2]  # bitwise, alone or in a batch


async def test_rerank_ranks_by_the_cross_encoders_scores(embedding_model_factory, expected):
    async with live_pooling_server(embedding_model_factory("cross_encoder")) as server:
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}
        response = (await server.http.post("/v1/rerank", json=body)).json()
        order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
        assert [r["index"] for r in response["results"]] == order
        for r in response["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
            assert r["document"]["text"] == DOCUMENTS[r["index"]]
        assert response["usage"]["total_tokens"] > len(DOCUMENTS)
        body = {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}
        plain = (await server.http.post("/v1/rerank", json=body)).json()["results"]
        assert len(plain) == len(DOCUMENTS) and all("document" not in r for r in plain)

        body = {"text_1": QUERY, "text_2": DOCUMENTS}
        scores = (await server.http.post("/v1/score", json=body)).json()["data"]
        assert [s["index"] for s in scores] == list(range(len(DOCUMENTS)))
        torch.testing.assert_close([s["score"] for s in scores], expected, atol=1e-5, rtol=0)
        body = {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}
        pairwise = (await server.http.post("/v1/score", json=body)).json()["data"]
        torch.testing.assert_close([s["score"] for s in pairwise], expected[:2], atol=1e-5,
                                   rtol=0)  # fmt: skip

        for path, body, param in [
            ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
            ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
            ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
            ("/v1/rerank", {"query": QUERY, "documents": ["the cat " * 100]}, "documents"),
            ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
            ("/v1/embeddings", {"input": "a"}, "model"),  # a cross-encoder embeds nothing
        ]:
            response = await server.http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["error"]["param"] == param
        body = {"query": QUERY, "documents": ["the cat " * 100], "truncate_prompt_tokens": 16}
        assert (await server.http.post("/v1/rerank", json=body)).status_code == 200
        await server.wait_idle()


def test_llm_score_equals_the_cross_encoders(embedding_model_factory, expected):
    with LLM(str(embedding_model_factory("cross_encoder"))) as llm:
        one_to_many = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        torch.testing.assert_close([o.outputs.score for o in one_to_many], expected, atol=1e-5,
                                   rtol=0)  # fmt: skip
        pairwise = llm.score([QUERY, QUERY], DOCUMENTS[:2], use_tqdm=False)
        assert [o.outputs.score for o in pairwise] == [o.outputs.score for o in one_to_many[:2]]
