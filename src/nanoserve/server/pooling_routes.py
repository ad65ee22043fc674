"""The pooling routes: OpenAI's /v1/embeddings, the Cohere/Jina /v1/rerank and vLLM's /v1/score.
The model decides which answer: an embedding model serves /v1/embeddings, a cross-encoder
(`BertForSequenceClassification`, or a Qwen3-Reranker: model/decoder_classifier.py) /v1/rerank
and /v1/score, whose pairs go in as given (a reranker's template is the client's, as in vLLM);
a generative model none of them
(each refusal a 400 naming the model). Handlers validate, tokenize (in a "tokenize" thread when
the texts are long), admit every input through the pooling engine's `admit` (RequestRejected
naming the field) and wait for their vectors through `Serving.pool`, the same inbox, queue limit
and turns as generation. Owns nothing.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from functools import partial

import numpy as np
import trio
from quart import Quart, Response, g, request

from nanoserve.engine import PoolingEngine, PoolingInput, PoolingOutput
from nanoserve.server.protocol import InvalidRequest, parse
from nanoserve.server.protocol.pooling import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from nanoserve.server.routes import LONG_PROMPT_CHARS, OpenAIServer

LARGE_RESPONSE = 1 << 16  # floats: a response of more is built off the event loop


class PoolingAPI:
    def __init__(self, api: OpenAIServer):
        self.api = api
        self.serving = api.serving

    def add_routes(self, app: Quart) -> None:
        app.add_url_rule("/v1/embeddings", view_func=self.embeddings, methods=["POST"])
        app.add_url_rule("/v1/rerank", view_func=self.rerank, methods=["POST"])
        app.add_url_rule("/rerank", "rerank", self.rerank, methods=["POST"])  # Jina's path
        app.add_url_rule("/v1/score", view_func=self.score, methods=["POST"])

    async def embeddings(self) -> Response:
        req: EmbeddingRequest = parse(EmbeddingRequest, await request.get_data(cache=False))
        self.api._check_model(req.model)
        engine = self._engine("/v1/embeddings", classifier=False)
        self._check_queue(len(req.inputs()), "input")
        dimensions = self._dimensions(engine, req.dimensions)
        inputs = await self._admit_inputs(engine, req)
        outputs = await self._pool(inputs)
        build = partial(_embedding_response, outputs, dimensions, req.encoding_format,
                        self.api.model_name)  # fmt: skip
        return await _respond(build, len(outputs) * len(outputs[0].data))

    async def rerank(self) -> Response:
        req: RerankRequest = parse(RerankRequest, await request.get_data(cache=False))
        self.api._check_model(req.model)
        engine = self._engine("/v1/rerank", classifier=True)
        self._check_queue(len(req.documents), "documents")
        pairs = [(req.query, d) for d in req.documents]
        scores, tokens = await self._scores(engine, pairs, req.truncate_prompt_tokens, "documents")
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            )  # fmt: skip
            for i in ranked
        ]
        body = RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=self.api.model_name, results=results,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip
        return Response(body.model_dump_json(exclude_none=True), mimetype="application/json")

    async def score(self) -> Response:
        req: ScoreRequest = parse(ScoreRequest, await request.get_data(cache=False))
        self.api._check_model(req.model)
        engine = self._engine("/v1/score", classifier=True)
        pairs = req.pairs()
        self._check_queue(len(pairs), "text_2")
        scores, tokens = await self._scores(engine, pairs, req.truncate_prompt_tokens, "text_2")
        body = ScoreResponse(
            id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=self.api.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip
        return Response(body.model_dump_json(), mimetype="application/json")

    # -- helpers ------------------------------------------------------------------------------

    def _engine(self, route: str, classifier: bool) -> PoolingEngine:
        """The pooling engine, if this model serves `route`; else a 400 naming the model."""
        engine = self.serving.pooling
        name = self.api.model_name
        if engine is None:
            raise InvalidRequest(
                f"{route}: the model {name!r} is a generative model; serve an embedding model "
                "(a BERT encoder, or a decoder with --runner pooling / --convert embed)",
                "model",
            )
        if engine.classifies != classifier:
            serves = "/v1/rerank and /v1/score" if engine.classifies else "/v1/embeddings"
            raise InvalidRequest(f"{route}: the model {name!r} serves {serves}", "model")
        if classifier and engine.num_labels != 1:
            raise InvalidRequest(f"{route}: the model {name!r} has {engine.num_labels} labels; "
                                 "a relevance score needs one", "model")  # fmt: skip
        return engine

    def _check_queue(self, count: int, field: str) -> None:
        limit = self.serving.max_queue
        if limit is not None and count > limit:
            raise InvalidRequest(f"{count} inputs are more than the server queues (--max-queue "
                                 f"{limit}): send fewer at a time", field)  # fmt: skip

    @staticmethod
    def _dimensions(engine: PoolingEngine, dimensions: int | None) -> int | None:
        """The Matryoshka dimensions asked for, where the checkpoint declares them."""
        if dimensions is None:
            return None
        allowed, full = engine.pooling.matryoshka, engine.dimension
        if allowed is None:
            raise InvalidRequest(
                "dimensions: this model declares no Matryoshka dimensions (matryoshka_dimensions "
                "in its config.json)", "dimensions",
            )  # fmt: skip
        if dimensions > full or (allowed and dimensions not in allowed):
            what = ", ".join(map(str, allowed)) if allowed else f"at most {full}"
            raise InvalidRequest(f"dimensions must be {what}, got {dimensions}", "dimensions")
        return dimensions

    async def _admit_inputs(
        self, engine: PoolingEngine, req: EmbeddingRequest
    ) -> list[PoolingInput]:
        """Every input tokenized and admitted (a 400 naming `input` before any is queued): in a
        "tokenize" thread when the inputs are long."""
        inputs = req.inputs()
        truncate = req.truncate_prompt_tokens

        def admit() -> list[PoolingInput]:
            return [
                engine.admit_text(one, "input", truncate, req.prompt_name, req.add_special_tokens)
                if isinstance(one, str) else engine.admit(one, "input", truncate)
                for one in inputs
            ]  # fmt: skip

        if sum(len(one) for one in inputs) <= LONG_PROMPT_CHARS:
            return admit()
        return await trio.to_thread.run_sync(admit, thread_name="tokenize")

    async def _scores(
        self,
        engine: PoolingEngine,
        pairs: list[tuple[str, str]],
        truncate: int | None,
        field: str,
    ) -> tuple[list[float], int]:
        """The cross-encoder's score of each pair, and the tokens it read."""

        def admit() -> list[PoolingInput]:
            return [engine.admit_pair(a, b, field, truncate) for a, b in pairs]

        chars = sum(len(a) + len(b) for a, b in pairs)
        if chars <= LONG_PROMPT_CHARS:
            inputs = admit()
        else:
            inputs = await trio.to_thread.run_sync(admit, thread_name="tokenize")
        outputs = await self._pool(inputs)
        return [o.data[0] for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)

    async def _pool(self, inputs: list[PoolingInput]) -> list[PoolingOutput]:
        g.access.tokens_in = sum(len(i.token_ids) for i in inputs)
        try:
            return await self.serving.pool(inputs)
        except trio.Cancelled:  # the client left: no response, so log it here
            g.access.write("499 (client left)")
            raise


def _embedding_response(
    outputs: list[PoolingOutput], dimensions: int | None, encoding: str, model: str
) -> str:
    data = []
    for index, out in enumerate(outputs):
        vector = np.asarray(out.data, dtype=np.float32)
        if dimensions is not None:  # Matryoshka: the first dimensions, normalized again
            vector = vector[:dimensions]
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        value: list[float] | str = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode()
            if encoding == "base64"
            else vector.tolist()
        )
        data.append(Embedding(index=index, embedding=value))
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return EmbeddingResponse(
        id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=data,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    ).model_dump_json()  # fmt: skip


async def _respond(build: Callable[[], str], floats: int) -> Response:
    if floats <= LARGE_RESPONSE:
        return Response(build(), mimetype="application/json")
    text = await trio.to_thread.run_sync(build, thread_name="respond")
    return Response(text, mimetype="application/json")
