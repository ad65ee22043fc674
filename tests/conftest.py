"""Shared fixtures: tiny random Llama checkpoints written once per test session."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nanoserve.demo import write_checkpoint


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(**write_checkpoint_kwargs) -> Path`; the same kwargs give the same directory."""
    cache: dict[str, Path] = {}

    def factory(**kwargs: Any) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = write_checkpoint(tmp_path_factory.mktemp("tiny_model"), **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny config (hidden 64, 2 layers, llama3 RoPE), float32."""
    return tiny_model_factory()


@pytest.fixture
async def client(server):
    """The official openai client on the module's `server` fixture (a live server). Imported here,
    not at the top: bench/gpu_check.sh runs the engine tests where openai is not installed."""
    import openai

    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


@pytest.fixture(scope="session")
def embedding_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(kind, **kwargs) -> Path`: a tiny random embedding checkpoint written by
    transformers and sentence-transformers (nanoserve.testing.embedding_models; kind: bert,
    cross_encoder, decoder or qwen3_reranker); the same arguments give the same directory."""
    from nanoserve.testing import embedding_models

    writers = {
        "bert": embedding_models.write_bert,
        "cross_encoder": embedding_models.write_cross_encoder,
        "decoder": embedding_models.write_decoder_embedding,
        "qwen3_reranker": embedding_models.write_qwen3_reranker,
    }
    cache: dict[str, Path] = {}

    def factory(kind: str, **kwargs: Any) -> Path:
        key = repr((kind, sorted(kwargs.items())))
        if key not in cache:
            cache[key] = writers[kind](tmp_path_factory.mktemp(kind), **kwargs)
        return cache[key]

    return factory
