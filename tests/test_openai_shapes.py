"""Requests as vLLM's own tests and today's OpenAI SDKs send them, over a real socket: fields at
their defaults, OpenAI's bookkeeping fields, seeds across the signed 64-bit range, vLLM's
continuous usage stats, /tokenize's token strings, /tokenizer_info's class, the model retrieved
by the name or the path it was served from (`nanoserve serve`), and OpenAI's logit_bias with
vLLM's allowed_token_ids through the openai SDK.
"""

import json
import signal

import openai
import pytest

from nanoserve.default_model import default_model_path
from nanoserve.testing.harness import MODEL_NAME, live_server, serve_command

BLOCKS = 64
C, X = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}
CHAT = {"model": MODEL_NAME, **MESSAGES, "max_tokens": 2}
NO_USAGE = {"include_usage": False, "continuous_usage_stats": False}


@pytest.fixture
async def server(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as s:
        yield s


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (X, {**CHAT, "continue_final_message": False, "echo": False, "logit_bias": {}}),
        (X, {**CHAT, "include_stop_str_in_output": False, "top_logprobs": 0}),
        (C, {**COMPLETION, "logit_bias": {"5": 0}}),
        (C, {**COMPLETION, "stream_options": NO_USAGE}),
        (X, {**CHAT, "prompt_cache_key": "k", "safety_identifier": "user-1234"}),
        (C, {**COMPLETION, "priority": 0, "request_id": "r-1"}),  # vLLM's, as routers send
        (C, {**COMPLETION, "stream": True, "stream_options": {**NO_USAGE, "include_usage": True}}),
        ("/tokenize", {**MESSAGES, "continue_final_message": False}),
    ],
    ids=[
        "chat",
        "chat-logprobs",
        "logit-bias-0",
        "no-usage",
        "bookkeeping",
        "vllm-routing",
        "usage",
        "tokenize",
    ],  # fmt: skip
)
async def test_fields_at_their_defaults_are_accepted(server, path, body):
    """A field sent at its default changes nothing: no 400 for it."""
    response = await server.http.post(path, json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (C, {**COMPLETION, "logit_bias": {"5": 0, "6": 1000}}, "logit_bias"),
        (X, {**CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {**MESSAGES, "continue_final_message": True}, "continue_final_message"),
        (C, {**COMPLETION, "stream_options": {"continuous_usage_stats": True}}, "stream"),
        (X, {**CHAT, "top_logprobs": 1}, "top_logprobs"),
        (X, {**CHAT, "seed": 2**64 + 5}, "seed"),
        (C, {**COMPLETION, "seed": 2**63}, "seed"),
        (C, {**COMPLETION, "seed": -(2**63) - 1}, "seed"),
    ],
    ids=[
        "logit-bias",
        "continue",
        "tokenize-continue",
        "usage-unstreamed",
        "top",
        "seed",
        "seed-max",
        "seed-min",
    ],
)
async def test_values_that_would_change_the_answer_are_400_naming_the_field(
    server, path, body, param
):
    response = await server.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["param"] in error["message"]


@pytest.mark.parametrize("seed", [-(2**63), -1, 2**63 - 1])
async def test_seeds_across_the_signed_64_bit_range_sample_and_reproduce(client, seed):
    async def sample():
        r = await client.completions.create(
            model=MODEL_NAME, prompt="She wrote", max_tokens=8, temperature=1.0, seed=seed, n=2
        )
        return [c.text for c in r.choices]

    first = await sample()
    assert await sample() == first and len(first) == 2


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    the usage so far; the last one, of its own, the total."""
    requests = [
        (client.completions.create, {"prompt": "She wrote"}),
        (client.chat.completions.create, MESSAGES),
    ]
    for create, extra in requests:
        stream = await create(
            model=MODEL_NAME, max_tokens=6, temperature=0, stream=True, **extra,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 6
        assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks)  # fmt: skip
        assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"


async def test_logit_bias_and_allowed_token_ids_steer_the_answer(server, client):
    """A bias of 100 on one token makes a greedy answer all that token (chat and completions);
    allowed_token_ids keep a sampled answer to those ids."""

    async def text_of(token_id):
        response = await server.http.post("/detokenize", json={"tokens": [token_id]})
        return response.json()["prompt"]

    chat = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logit_bias={"65": 100}, logprobs=True,
    )  # fmt: skip
    assert [t.token for t in chat.choices[0].logprobs.content] == [await text_of(65)] * 4
    text = await client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=0, logit_bias={"65": 100}
    )
    assert text.choices[0].text == (await text_of(65)) * 4
    allowed = await client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=8, temperature=1.0, seed=3, logprobs=0,
        extra_body={"allowed_token_ids": [66, 67]},
    )  # fmt: skip
    tokens = allowed.choices[0].logprobs.tokens
    assert len(tokens) == 8 and set(tokens) <= {await text_of(66), await text_of(67)}


async def test_models_and_version_say_what_vllm_says(server, client):
    """/v1/models gives the context length, the path the model was loaded from as `root` and no
    `parent`; /version gives the installed version."""
    from importlib import metadata

    (card,) = (await client.models.list()).data
    assert card.model_extra["max_model_len"] == server.engine.max_model_len
    assert card.model_extra["root"] == MODEL_NAME  # live_server gives no path: the name
    assert card.model_extra["parent"] is None
    response = await server.http.get("/version")
    assert response.json() == {"version": metadata.version("nanoserve")}


async def test_a_chat_template_of_the_servers_own_replaces_the_models(tiny_model_dir, tmp_path):
    """--chat-template FILE (or the template itself) renders every chat, /tokenize's too."""
    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    for given in (str(template), template.read_text()):
        async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS, chat_template=given) as s:
            chat = await s.http.post("/tokenize", json={**MESSAGES, "add_special_tokens": False})
            text = await s.http.post("/tokenize", json={"prompt": "[hi]", "add_special_tokens":
                                                        False})  # fmt: skip
            assert chat.json()["tokens"] == text.json()["tokens"]


async def test_continue_final_message_continues_the_assistants_answer(server):
    """With add_generation_prompt false, the prompt ends with the last message's text (no end of
    its turn, no new turn), and the answer continues it; both flags true are a 400."""
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    cont = await server.http.post("/tokenize", json={"messages": begun, **flags})
    closed = await server.http.post("/tokenize", json={"messages": begun,
                                                       "add_generation_prompt": False})  # fmt: skip
    tail = await server.http.post("/tokenize", json={"prompt": "Once upon",
                                                     "add_special_tokens": False})  # fmt: skip
    ids, end = cont.json()["tokens"], tail.json()["tokens"]
    assert ids[-len(end) :] == end and len(ids) < closed.json()["count"]
    body = {**CHAT, "messages": begun, **flags, "max_tokens": 3, "temperature": 0}
    response = await server.http.post(X, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(ids)


async def test_tokens_named_by_id_in_logprobs(server):
    """vLLM's return_tokens_as_token_ids: "token_id:N" in every place logprobs name a token; the
    text and its offsets are unchanged."""
    body = {**COMPLETION, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = (await server.http.post(C, json=body)).json()["choices"][0]
    named = await server.http.post(C, json={**body, "return_tokens_as_token_ids": True})
    named = named.json()["choices"][0]
    assert named["text"] == plain["text"]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert all(t.startswith("token_id:") for t in named["logprobs"]["tokens"])
    assert all(k.startswith("token_id:") for e in named["logprobs"]["top_logprobs"] for k in e)
    chat = {**CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}  # fmt: skip
    content = (await server.http.post(X, json=chat)).json()["choices"][0]["logprobs"]["content"]
    names = [e["token"] for e in content] + [t["token"] for e in content for t in e["top_logprobs"]]
    assert names and all(n.startswith("token_id:") and n[9:].isdigit() for n in names)


async def test_prompt_logprobs_on_chat_score_the_rendered_prompt(server):
    """vLLM's prompt_logprobs on a unary chat: one entry per prompt token of the rendered chat
    (None first), equal to what completions give for the same token ids."""
    chat = {**CHAT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    body = (await server.http.post(X, json=chat)).json()
    scored = body["prompt_logprobs"]
    ids = (await server.http.post("/tokenize", json=MESSAGES)).json()["tokens"]
    assert len(scored) == len(ids) == body["usage"]["prompt_tokens"] and scored[0] is None
    same = {**COMPLETION, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    plain = (await server.http.post(C, json=same)).json()["choices"][0]["prompt_logprobs"]
    assert scored == plain


async def test_tokenize_returns_the_token_strings_when_asked(server):
    """As vLLM's return_token_strs: the vocabulary's pieces, as transformers'
    convert_ids_to_tokens gives them (byte-level "Ġ" for a space)."""
    plain = (await server.http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert plain["token_strs"] is None
    body = {"prompt": "Hello world", "return_token_strs": True}
    asked = (await server.http.post("/tokenize", json=body)).json()
    assert asked["tokens"] == plain["tokens"]
    assert asked["token_strs"] == ["<|begin_of_text|>", "H", "e", "ll", "o", "Ġwor", "ld"]


async def test_tokenizer_info_names_the_checkpoints_tokenizer_class(tiny_model_dir, tmp_path):
    async with live_server(tiny_model_dir, num_kv_blocks=BLOCKS) as server:
        info = (await server.http.get("/tokenizer_info")).json()
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast"  # as tokenizer_config says
    model = tmp_path / "model"
    model.mkdir()
    for file in tiny_model_dir.iterdir():
        (model / file.name).symlink_to(file)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").unlink()
    config["tokenizer_class"] = "GPT2Tokenizer"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    async with live_server(model, num_kv_blocks=BLOCKS) as server:
        info = (await server.http.get("/tokenizer_info")).json()
        assert info["tokenizer_class"] == "GPT2Tokenizer"


async def test_a_gguf_file_is_served_by_its_name_and_retrieved_by_name_or_path():
    """`nanoserve serve /abs/path/X.gguf` serves the id X; the openai client retrieves it by
    that name and by the path (/v1/models//abs/path/X.gguf, slashes kept), and a request may
    name the model either way."""
    path = default_model_path()
    name = path.name.removesuffix(".gguf")
    async with serve_command(path) as (proc, server):
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            assert [m.id for m in (await client.models.list()).data] == [name]
            assert (await client.models.retrieve(name)).id == name
            assert (await client.models.retrieve(str(path))).id == name
            assert (await client.models.retrieve(name)).model_extra["root"] == str(path)
            for model in (name, str(path)):
                r = await client.completions.create(model=model, prompt="Hi", max_tokens=1)
                assert r.model == name
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve(str(path)[1:])
            info = (await server.http.get("/tokenizer_info")).json()
            assert info["tokenizer_class"] == "PreTrainedTokenizerFast"  # a GGUF names none
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
