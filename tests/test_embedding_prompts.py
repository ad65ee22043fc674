"""sentence-transformers' prompts (config_sentence_transformers.json): the default prompt goes
before every text as SentenceTransformer.encode puts it, a request's prompt_name (TEI's field)
picks another, in the pooling engine, through /v1/embeddings and LLM.embed; an unknown name is
a 400 naming prompt_name. The oracle is sentence-transformers' encode."""

import json
import shutil

import pytest
import torch
from sentence_transformers import SentenceTransformer

from nanoserve.engine import PoolingEngine
from nanoserve.engine.admission import RequestRejected
from nanoserve.llm import LLM
from nanoserve.testing.harness import live_pooling_server

TEXTS = ["the cat", "paris is the capital of france", "a"]
PROMPTS = {"query": "Instruct: find the city\nQuery:", "document": "", "title": "title: "}


def with_prompts(path, tmp_path, default: str | None):
    copy = shutil.copytree(path, tmp_path / "prompted")
    file = copy / "config_sentence_transformers.json"
    config = json.loads(file.read_text())
    file.write_text(json.dumps({**config, "prompts": PROMPTS, "default_prompt_name": default}))
    return copy


def vectors(engine: PoolingEngine, texts: list[str], prompt_name: str | None) -> torch.Tensor:
    for i, text in enumerate(texts):
        engine.add_request(str(i), engine.admit_text(text, "input", prompt_name=prompt_name))
    return torch.tensor([o.data for o in engine.step()])


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_prompts_equal_sentence_transformers(embedding_model_factory, tmp_path, kind):
    path = with_prompts(embedding_model_factory(kind), tmp_path, default="title")
    model = SentenceTransformer(str(path), device="cpu")
    engine = PoolingEngine(path)
    cases = [(None, model.encode(TEXTS)), ("query", model.encode(TEXTS, prompt_name="query")),
             ("document", model.encode(TEXTS, prompt_name="document"))]  # fmt: skip
    for name, expected in cases:
        torch.testing.assert_close(vectors(engine, TEXTS, name), torch.tensor(expected),
                                   atol=1e-5, rtol=1e-4)  # fmt: skip
    plain = torch.tensor(SentenceTransformer(str(embedding_model_factory(kind))).encode(TEXTS))
    assert not torch.allclose(torch.tensor(cases[0][1]), plain, atol=1e-3)  # the prompt counts
    with pytest.raises(RequestRejected, match="prompt_name 'nope'"):
        engine.admit_text("a", "input", prompt_name="nope")


async def test_prompt_name_on_the_embeddings_route(embedding_model_factory, tmp_path):
    path = with_prompts(embedding_model_factory("bert"), tmp_path, default=None)
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS, prompt_name="query")
    async with live_pooling_server(path) as server:
        body = {"input": TEXTS, "prompt_name": "query"}
        data = (await server.http.post("/v1/embeddings", json=body)).json()["data"]
        torch.testing.assert_close(torch.tensor([d["embedding"] for d in data]),
                                   torch.tensor(expected), atol=1e-5, rtol=1e-4)  # fmt: skip
        response = await server.http.post("/v1/embeddings", json={**body, "prompt_name": "x"})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt_name"
        await server.wait_idle()


def test_llm_embed_applies_the_prompt(embedding_model_factory, tmp_path):
    path = with_prompts(embedding_model_factory("bert"), tmp_path, default="title")
    model = SentenceTransformer(str(path), device="cpu")
    with LLM(str(path)) as llm:
        outputs = llm.embed(TEXTS, prompt_name="query", use_tqdm=False)
        ours = torch.tensor([o.outputs.embedding for o in outputs])
        torch.testing.assert_close(ours, torch.tensor(model.encode(TEXTS, prompt_name="query")),
                                   atol=1e-5, rtol=1e-4)  # fmt: skip
        ids = outputs[0].prompt_token_ids
        by_ids = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
        assert by_ids == outputs[0].outputs.embedding  # token ids go in as given
        scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
        default = torch.tensor(model.encode(TEXTS))
        cosine = torch.nn.functional.cosine_similarity(default[:1], default[1:])
        torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), cosine,
                                   atol=1e-5, rtol=0)  # fmt: skip
        with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
            llm.score(TEXTS[:2], TEXTS)
