"""The pooling APIs' bodies: OpenAI's /v1/embeddings, the Cohere/Jina /v1/rerank and vLLM's
/v1/score, with vLLM's `truncate_prompt_tokens` (and `add_special_tokens` and TEI's
`prompt_name` for embeddings). A
request is bounded in inputs (MAX_INPUTS, OpenAI's 2,048); an empty input is refused by name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from nanoserve.server.protocol.base import StrictModel
from nanoserve.server.protocol.errors import InvalidRequest

MAX_INPUTS = 2048  # inputs of one /v1/embeddings request, documents of one rerank (OpenAI's)


def _check_truncate(value: int | None) -> None:
    if value is not None and value != -1 and value < 1:
        raise InvalidRequest(
            f"truncate_prompt_tokens must be -1 (the context) or >= 1, got {value}",
            "truncate_prompt_tokens",
        )


def _check_count(count: int, field: str) -> None:
    if count == 0:
        raise InvalidRequest(f"{field} is empty", field)
    if count > MAX_INPUTS:
        raise InvalidRequest(f"{field} has {count} entries; at most {MAX_INPUTS} a request", field)


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    # Text Embeddings Inference's field: a prompt of the model's sentence-transformers config by
    # name (its default_prompt_name's when absent); token-id inputs take none.
    prompt_name: str | None = None

    def check(self) -> None:
        _check_count(len(self.inputs()), "input")
        if any(not one for one in self.inputs()):
            raise InvalidRequest("input must not contain an empty string or token list", "input")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequest(f"dimensions must be >= 1, got {self.dimensions}", "dimensions")
        _check_truncate(self.truncate_prompt_tokens)

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs, one entry each: a text or its token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        return self.input  # type: ignore[return-value]


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None

    def check(self) -> None:
        if not self.query:
            raise InvalidRequest("query is empty", "query")
        _check_count(len(self.documents), "documents")
        if self.top_n is not None and self.top_n < 1:
            raise InvalidRequest(f"top_n must be >= 1, got {self.top_n}", "top_n")
        _check_truncate(self.truncate_prompt_tokens)


class ScoreRequest(StrictModel):
    """vLLM's /v1/score: text_1 against each text_2 (one to one, one to many, or pairwise)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None

    def check(self) -> None:
        first, second = self.pairs_of()
        _check_count(len(first), "text_1")
        _check_count(len(second), "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise InvalidRequest(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or "
                "as many as text_2",
                "text_1",
            )
        _check_truncate(self.truncate_prompt_tokens)

    def pairs_of(self) -> tuple[list[str], list[str]]:
        as_list = lambda t: [t] if isinstance(t, str) else t  # noqa: E731
        return as_list(self.text_1), as_list(self.text_2)

    def pairs(self) -> list[tuple[str, str]]:
        first, second = self.pairs_of()
        if len(first) == 1:
            first = first * len(second)
        return list(zip(first, second, strict=True))


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
