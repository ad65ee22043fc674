"""Tokenizer and incremental detokenizer, checked against transformers on a tiny checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer

# Characters outside the demo corpus come out as single byte tokens, splitting the character.
SAMPLE = "Hello café naïve 日本 中文 🎉 ünïcödé\nThe keeper <|eot_id|> wrote."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Où est le café ? 🎉 "},
    {"role": "assistant", "content": [{"type": "text", "text": "Ici."}]},
    {"role": "user", "content": "Merci", "name": None},
]
# Derandomized, as test_fuzz.py's: the same examples every run, so that CI passes or fails on the
# code alone (a random run found U+FFFD held back; test_a_replacement_character_... keeps it).
SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` one by one; returns the detokenizer and `text` after each token."""
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), **kwargs)
    texts = []
    for i in ids:
        stopped = detok.append(i)
        texts.append(detok.text)
        if stopped:
            break
    return detok, texts


def test_special_ids_and_vocab_match_transformers(tok, hf):
    assert tok.vocab_size == len(hf) == 1024
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_ids == {hf.eos_token_id} == {hf.convert_tokens_to_ids("<|eot_id|>")}
    assert tok.all_special_ids == set(hf.all_special_ids) | set(range(1019, 1024))


@SETTINGS
@given(text=st.text(max_size=60) | st.sampled_from([SAMPLE, "", " ", "<|eot_id|><|eot_id|>"]))
def test_encode_matches_transformers(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text)[0] == tok.bos_token_id


@SETTINGS
@given(ids=st.lists(st.integers(0, 1023), max_size=40))
def test_decode_matches_transformers(tok, hf, ids):
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_token_text_is_text_or_openai_bytes(tok):
    assert tok.token_text(tok.encode(" café", add_special_tokens=False)[0]) == " caf"
    assert tok.token_text(tok.bos_token_id) == "<|begin_of_text|>"
    first_byte_of_zhong = tok.encode("中", add_special_tokens=False)[0]
    assert tok.token_text(first_byte_of_zhong) == "bytes:\\xe4"
    assert tok.token_bytes(first_byte_of_zhong) == b"\xe4"


def test_chat_template_from_tokenizer_config_matches_transformers(tok, hf):
    for gen_prompt in (True, False):
        expected = hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen_prompt
        )
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt) == expected
    assert expected.startswith("<|begin_of_text|><|start_header_id|>system")


# Uses tojson, namespace, loop controls, raise_exception and {% generation %}, as Hub templates do.
JINJA_FILE_TEMPLATE = """\
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + m.role) }}
    {%- endif %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if m.role == 'assistant' %}{% generation %}{{ m.content | tojson }}{% endgeneration %}
    {%- else %}{{- ns.n ~ ' ' ~ m.role }}: {{ m.content | tojson }}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}{{ eos_token }}{% endif %}
"""


@pytest.fixture
def jinja_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(JINJA_FILE_TEMPLATE)
    return tmp_path


def test_chat_template_jinja_file_is_preferred_and_matches_transformers(jinja_dir):
    ours = Tokenizer.from_dir(jinja_dir).apply_chat_template(MESSAGES)
    hf = AutoTokenizer.from_pretrained(jinja_dir)
    assert ours == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.startswith('1 user: "Où est le café ? 🎉 "[{"type": "text", "text": "Ici."}]3 user')


def test_chat_template_error_is_a_value_error(jinja_dir):
    with pytest.raises(ValueError, match="unknown role tool"):
        Tokenizer.from_dir(jinja_dir).apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_list_form_uses_the_default(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools!"},
        {"name": "default", "template": "{{ messages[0].content }}"},
    ]
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES) == "Be brief."


def test_missing_chat_template_says_so(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)


@SETTINGS
@given(ids=st.lists(st.integers(0, 1023), max_size=40), skip=st.booleans())
def test_incremental_text_equals_one_shot_decode(tok, ids, skip):
    detok, texts = stream(tok, ids, skip_special_tokens=skip)
    detok.finish()
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    # Text only grows: nothing shown is ever taken back.
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


@SETTINGS
@given(text=st.text(max_size=40) | st.just(SAMPLE))
def test_valid_text_never_shows_a_broken_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok, texts = stream(tok, ids, skip_special_tokens=False)
    if "\ufffd" not in text:
        assert not any("\ufffd" in t for t in texts)
    assert all(text.startswith(t) for t in texts)
    assert detok.text == text


def test_a_replacement_character_in_the_text_is_not_held(tok):
    """U+FFFD spelled out whole is text; only bytes that stop inside a character are held."""
    for text in ("\ufffd", "a\ufffd", "\ufffd中"):
        detok, _ = stream(tok, tok.encode(text, add_special_tokens=False))
        assert detok.text == text


def test_split_character_is_held_until_complete(tok):
    ids = tok.encode("a中", add_special_tokens=False)
    assert len(ids) == 4  # "a" and the three bytes of 中
    _, texts = stream(tok, ids)
    assert texts == ["a", "a", "a", "a中"]


def test_incomplete_tail_is_released_by_finish(tok):
    ids = tok.encode("a中", add_special_tokens=False)[:-1]
    detok, _ = stream(tok, ids)
    assert detok.text == "a"
    detok.finish()
    assert detok.text == tok.decode(ids) == "a\ufffd"


@SETTINGS
@given(text=st.text(min_size=1, max_size=30) | st.just(SAMPLE), data=st.data())
def test_stop_string_is_cut_exactly(tok, text, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, len(text)))]
    ids = tok.encode(text, add_special_tokens=False)
    detok, _ = stream(tok, ids, stop=[stop], skip_special_tokens=False)
    expected = text[: text.find(stop)]
    assert detok.text == expected
    assert detok.visible_text() == expected


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("Hello café naïve world", add_special_tokens=False)
    detok, texts = stream(tok, ids, stop=["é na", "zzz"])
    assert len(texts) < len(ids)  # generation stopped early
    assert texts[-2:] == ["Hello café", "Hello caf"]  # " naïve" completed the stop
    assert detok.text == "Hello caf"


def test_check_stop_false_does_not_stop(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["caf"])
    results = [detok.append(i, check_stop=False) for i in tok.encode(" café!")]
    assert results == [None] * len(results)
    assert detok.text == " café!"


def test_visible_text_holds_back_a_possible_stop(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["café au lait"])
    seen = []
    for i in tok.encode("Hello café au", add_special_tokens=False):
        detok.append(i)
        seen.append(detok.visible_text())
    assert seen[-1] == "Hello "
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
    detok.finish()
    assert detok.visible_text() == "Hello café au"


def test_skip_special_tokens(tok):
    ids = tok.encode("Hi<|eot_id|>there<|end_of_text|>", add_special_tokens=True)
    skipped, _ = stream(tok, ids)
    kept, _ = stream(tok, ids, skip_special_tokens=False)
    assert skipped.text == "Hithere"
    assert kept.text == "<|begin_of_text|>Hi<|eot_id|>there<|end_of_text|>"


def test_decode_window_stays_short(tok, monkeypatch):
    calls = []
    decode = tok.decode
    monkeypatch.setattr(
        tok, "decode", lambda ids, skip=True: calls.append(len(ids)) or decode(ids, skip)
    )
    ids = tok.encode(SAMPLE * 20 + "<|eot_id|>" * 50 + SAMPLE * 20, add_special_tokens=False)
    detok, _ = stream(tok, ids)
    assert detok.text == SAMPLE.replace("<|eot_id|>", "") * 40
    assert max(calls) <= 10
