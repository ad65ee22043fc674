"""Qwen3-Reranker in both forms against transformers on the same token ids: the "seq-cls"
conversion (Qwen3ForSequenceClassification: sigmoid of its one logit) and the original causal LM
under hf_overrides (sigmoid of logit(true) - logit(false) at the last token), in the pooling
engine, through /v1/rerank and /v1/score, and LLM.score; the overrides refused by name; and the
original's GGUF file as llama.cpp's converter writes it (a RANK head of "yes" and "no")."""

import pytest
import torch
import transformers

from nanoserve.config import EngineConfig, SettingError
from nanoserve.engine import PoolingEngine, runs_pooling
from nanoserve.llm import LLM
from nanoserve.model.bert_config import check_checkpoint_config
from nanoserve.testing.harness import live_pooling_server
from nanoserve.testing.hf_families import write_family_checkpoint
from nanoserve.testing.llamacpp_convert import (
    convert,
    converter,
    smollm2_vocabulary,
    write_vocabulary,
)

# Qwen3-Reranker's documented prompt, formatted by the caller as vLLM's example does.
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the '
          'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
          "<|im_end|>\n<|im_start|>user\n")  # fmt: skip
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = PREFIX + "<Instruct>: Given a query, retrieve passages\n<Query>: capital of france\n"
DOCUMENTS = [f"<Document>: {d}{SUFFIX}" for d in (
    "paris is the capital of france", "the cat", "a river runs to the sea " * 3, "france",
)]  # fmt: skip
# The demo tokenizer has no "yes" and "no" tokens: two of its own stand for them.
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
             "classifier_from_token": ["n", "y"], "is_original_qwen3_reranker": True}  # fmt: skip


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return write_family_checkpoint(tmp_path_factory.mktemp("reranker"), "qwen3", seed=3)


def seq_cls_scores(path, token_ids: list[list[int]]) -> list[float]:
    model = transformers.Qwen3ForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item() for ids in token_ids]


def original_scores(
    path, token_ids: list[list[int]], engine_tokens: tuple[int, int] = (77, 88)
) -> list[float]:
    """sigmoid(logit(true) - logit(false)) at the last token; engine_tokens (false, true): by
    default "n" and "y" in the demo vocabulary."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0, -1, engine_tokens] for ids in token_ids]
    return [torch.sigmoid(lg[1] - lg[0]).item() for lg in logits]


@pytest.fixture(scope="module")
def reranker_gguf(tmp_path_factory):
    """(a random Qwen3 causal LM in SmolLM2's vocabulary, in a folder named as Qwen3-Reranker's,
    by which llama.cpp's converter knows it; the converter's F32 file of it)."""
    if converter() is None:  # nothing is downloaded at test time
        pytest.skip("llama.cpp's converter is not fetched")
    vocab = smollm2_vocabulary()
    model_dir = tmp_path_factory.mktemp("gguf") / "qwen3-reranker-tiny"
    model_dir.mkdir()
    write_family_checkpoint(model_dir, "qwen3", seed=3, vocab_size=vocab.vocab_size)
    write_vocabulary(model_dir, vocab)
    return model_dir, convert(model_dir, model_dir / "f32.gguf")


def test_a_gguf_reranker_scores_as_its_checkpoint(reranker_gguf):
    """llama.cpp's converter keeps Qwen3-Reranker's LM head rows of "yes" and "no" (cls.output,
    pooling_type RANK) and drops the rest of it: the file serves scores only (--runner generate
    refused by name), sigmoid(yes - no) at the last token, as transformers on the checkpoint."""
    model_dir, path = reranker_gguf
    assert runs_pooling(path, EngineConfig())
    with pytest.raises(SettingError, match="runner"):
        runs_pooling(path, EngineConfig(runner="generate"))
    engine = PoolingEngine(path)
    assert engine.classifies and engine.num_labels == 1
    scores, token_ids = run_pairs(engine)
    tokens = (engine.tokenizer.token_id("no"), engine.tokenizer.token_id("yes"))
    expected = original_scores(model_dir, token_ids, tokens)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert max(expected) - min(expected) > 0.05


def run_pairs(engine: PoolingEngine) -> tuple[list[float], list[list[int]]]:
    for i, document in enumerate(DOCUMENTS):
        engine.add_request(str(i), engine.admit_pair(QUERY, document, "documents"))
    outputs = engine.step()
    return [o.data[0] for o in outputs], [o.prompt_token_ids for o in outputs]


def test_seq_cls_scores_equal_transformers(embedding_model_factory):
    path = embedding_model_factory("qwen3_reranker")
    check_checkpoint_config(path)  # what the command line checks before torch loads
    assert runs_pooling(path, EngineConfig())
    engine = PoolingEngine(path)
    assert engine.classifies and engine.num_labels == 1
    scores, token_ids = run_pairs(engine)
    assert token_ids[0] == engine.tokenizer.encode(QUERY) + engine.tokenizer.encode(DOCUMENTS[0])
    expected = seq_cls_scores(path, token_ids)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert max(expected) - min(expected) > 0.05  # scores that tell the documents apart


def test_original_scores_equal_transformers(original):
    config = EngineConfig(hf_overrides=OVERRIDES)
    assert runs_pooling(original, config)
    engine = PoolingEngine(original, config)
    assert engine.classifies and engine.num_labels == 1
    assert engine.tokenizer.token_id("n") == 77 and engine.tokenizer.token_id("y") == 88
    scores, token_ids = run_pairs(engine)
    expected = original_scores(original, token_ids)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert max(expected) - min(expected) > 0.05


def test_llm_score_of_the_original(original):
    with LLM(str(original), hf_overrides=OVERRIDES) as llm:
        outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        ids = [o.prompt_token_ids for o in outputs]
        torch.testing.assert_close([o.outputs.score for o in outputs],
                                   original_scores(original, ids), atol=1e-5, rtol=0)  # fmt: skip
        with pytest.raises(ValueError, match="embed: this model is a cross-encoder"):
            llm.embed("a")
        with pytest.raises(ValueError, match="generate: this LLM holds a pooling model"):
            llm.generate("a")


async def test_rerank_and_score_routes(original):
    engine = PoolingEngine(original, EngineConfig(hf_overrides=OVERRIDES))
    expected, _ = run_pairs(engine)
    async with live_pooling_server(original, hf_overrides=OVERRIDES) as server:
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
        results = (await server.http.post("/v1/rerank", json=body)).json()["results"]
        assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -expected[i])[:2]
        for r in results:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-6)
        body = {"text_1": QUERY, "text_2": DOCUMENTS}
        data = (await server.http.post("/v1/score", json=body)).json()["data"]
        torch.testing.assert_close([d["score"] for d in data], expected, atol=1e-6, rtol=0)
        response = await server.http.post("/v1/embeddings", json={"input": "a"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "model"
        await server.wait_idle()


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({**OVERRIDES, "num_labels": 2}, "hf_overrides.num_labels"),
        ({**OVERRIDES, "architectures": ["Qwen2ForCausalLM"]}, "hf_overrides.architectures"),
        ({**OVERRIDES, "is_original_qwen3_reranker": False},
         "hf_overrides.is_original_qwen3_reranker"),
        ({**OVERRIDES, "classifier_from_token": ["y"]}, "hf_overrides.classifier_from_token"),
        ("{not json", "hf_overrides"),
    ],
)  # fmt: skip
def test_overrides_refused_by_name(overrides, name):
    with pytest.raises(SettingError) as e:
        EngineConfig(hf_overrides=overrides)
    assert e.value.name == name


def test_overrides_that_do_not_fit_the_model(original, embedding_model_factory):
    with pytest.raises(SettingError) as e:  # the demo vocabulary has no "yes"
        PoolingEngine(original, EngineConfig(hf_overrides={**OVERRIDES,
                      "classifier_from_token": ["no", "yes"]}))  # fmt: skip
    assert e.value.name == "hf_overrides.classifier_from_token"
    with pytest.raises(SettingError) as e:
        runs_pooling(original, EngineConfig(hf_overrides=OVERRIDES, runner="generate"))
    assert e.value.name == "runner"
    path = embedding_model_factory("qwen3_reranker")
    with pytest.raises(SettingError) as e:
        PoolingEngine(path, EngineConfig(hf_overrides=OVERRIDES))
    assert e.value.name == "hf_overrides"
    assert not runs_pooling(original, EngineConfig())  # a causal LM generates by default
