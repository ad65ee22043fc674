"""The fields the two generation endpoints (completions and chat) share: sampling, stops,
streaming options and the constraint on the output (response_format, structured_outputs,
guided_*), checked and turned into the engine's SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from nanoserve.engine import GrammarError, SamplingParams, StructuredOutputsParams
from nanoserve.server.protocol.base import StrictModel
from nanoserve.server.protocol.errors import InvalidRequest

MAX_N = 16  # completions per prompt: each one is a sequence in the batch
MAX_LOGPROBS = 20
MAX_SEQUENCES = 256  # prompts x n in one request: each one is a sequence in the batch
MAX_STOP = 16  # stop strings in one request (OpenAI allows 4)
MAX_STOP_CHARS = 4096  # their total length
MAX_STOP_TOKEN_IDS = 1024  # stop token ids in one request
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (as the sampler allows)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # vLLM's allowed_token_ids: more than any vocabulary
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # a signed 64-bit integer, as in OpenAI's and vLLM's


def _constraint(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields, param=param)
    except GrammarError as e:
        raise InvalidRequest(str(e), e.param) from None


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk

    def asks(self) -> bool:
        """Whether these options change a stream (unset, they change nothing)."""
        return self.include_usage or self.continuous_usage_stats


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None  # the output is always held to the schema


class ResponseFormatSpec(StrictModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsSpec(StrictModel):
    """vLLM's `structured_outputs`."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # the default: objects take no other keys
    disable_fallback: bool = False  # one backend: nothing to fall back to
    structural_tag: Any = None  # refused


class GenerationRequest(StrictModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras, then harmless ones."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    allowed_token_ids: list[int] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # vLLM's: the prompt's token ids and each choice's
    # OpenAI's: token ids (as strings, JSON's keys) to biases added to their logits.
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    # Harmless: bookkeeping that does not change the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    request_id: str | None = None  # vLLM's
    # Would change the answer and are not implemented: declared only to be refused by name (at
    # their defaults they change nothing, and are accepted).
    include_stop_str_in_output: bool = False
    priority: int = 0  # vLLM's priority scheduling: this server runs first come, first served
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields; at most one of them.
    response_format: ResponseFormatSpec | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def refused(self) -> str | None:
        """The first set parameter that would change the answer and is not implemented."""
        unsupported = {
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "priority": self.priority != 0,
            "structured_outputs.structural_tag": self.structured_outputs is not None
            and self.structured_outputs.structural_tag is not None,
        }
        return next((name for name, used in unsupported.items() if used), None)

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever field gave it (a 400 naming it if two
        did, or if it is malformed)."""
        given = {
            "response_format": self._response_format(),
            "structured_outputs": self._structured_outputs(),
            "guided_json": self._guided("json", self.guided_json),
            "guided_regex": self._guided("regex", self.guided_regex),
            "guided_choice": self._guided("choice", self.guided_choice),
            "guided_grammar": self._guided("grammar", self.guided_grammar),
        }
        set_ = [(k, v) for k, v in given.items() if v is not None]
        if len(set_) > 1:
            names = " and ".join(k for k, _ in set_)
            raise InvalidRequest(f"{names} cannot be combined: give one", set_[1][0])
        return set_[0][1] if set_ else None

    def _response_format(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return _constraint("response_format", json_object=True)
        if rf.json_schema is None:
            raise InvalidRequest(
                "response_format.json_schema is required for type json_schema",
                "response_format.json_schema",
            )
        return _constraint("response_format.json_schema.schema", json=rf.json_schema.json_schema)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        so = self.structured_outputs
        if so is None:
            return None
        return _constraint(
            "structured_outputs",
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
            whitespace_pattern="" if so.disable_any_whitespace else so.whitespace_pattern,
        )

    def _guided(self, kind: str, value: Any) -> StructuredOutputsParams | None:
        if value is None:
            return None
        ws = self.guided_whitespace_pattern
        return _constraint(f"guided_{kind}", **{kind: value}, whitespace_pattern=ws)

    def check(self) -> None:
        if name := self.refused():
            raise InvalidRequest(f"{name} is not supported by this server", name)
        if self.stream_options is not None and self.stream_options.asks() and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or sum(len(s) for s in stops) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop: at most {MAX_STOP} strings of {MAX_STOP_CHARS} characters in all "
                f"(got {len(stops)} of {sum(len(s) for s in stops)})",
                "stop",
            )

    def check_sequences(self, num_prompts: int) -> None:
        """One request may fill at most MAX_SEQUENCES rows of the batch."""
        if num_prompts * self.n > MAX_SEQUENCES:
            raise InvalidRequest(
                f"{num_prompts} prompts x n={self.n} is {num_prompts * self.n} sequences; one "
                f"request may ask for at most {MAX_SEQUENCES}",
                "prompt" if num_prompts > 1 else "n",
            )

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=constraint,
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
            )
        except ValueError as e:  # SamplingParams names the field first: "min_tokens must be ..."
            raise InvalidRequest(str(e), str(e).split(" ", 1)[0]) from None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's string keys as token ids; biases of 0 dropped (they change nothing)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}",
                                     "logit_bias")  # fmt: skip
            if value:
                bias[int(key)] = value
        return bias

    def check_whole_vocab(self, param: str, prompts: int = 1, echo: bool = False) -> None:
        """Logprobs of the whole vocabulary (-1, vLLM's) on one prompt's unary answer: their
        chunks would be built on the event loop, and an echo would score the prompt too (the
        engine bounds their number)."""
        for refused, why in ((self.stream, "with stream"), (echo, "with echo"),
                             (prompts > 1, "for several prompts")):  # fmt: skip
            if refused:
                raise InvalidRequest(f"{param} -1 (the whole vocabulary) is not served {why}: "
                                     "ask for it on a unary request", param)  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage so far in every chunk (with include_usage)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats
