"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model == "llama"`: Mistral, Llama 2,
TinyLlama): the tokenizer rebuilt from the tokens, scores and types gives SentencePiece's own ids
on random text (spaces, newlines, characters only its byte fallback spells), decodes them back,
streams them, keeps control and user-defined tokens whole with the space prefix after them as
llama.cpp puts it; and a Mistral checkpoint written by llama.cpp's own converter loads and
decodes as transformers does the Hugging Face original."""

import io
import random
import shutil

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.demo import CORPUS
from nanoserve.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    tokenizer_from_gguf,
)
from nanoserve.model.gguf_file import GGUFCheckpoint
from nanoserve.testing.hf_families import write_family_checkpoint
from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer

spm = pytest.importorskip("sentencepiece")

WORDS = [
    *CORPUS.split(" "),
    "  ",
    "\n",
    "\t",
    "ünïcode",
    "🦀",
    "Über",
    "1234567",
    " x",
    "é",
    "東京",
]
WORDS += ["def f(x):\n    return x[0]", "    "]


@pytest.fixture(scope="module")
def sp_model():
    """A SentencePiece BPE model trained on the demo corpus as Llama's and Mistral's were: no
    normalization, whitespace kept, digits split, byte fallback."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model, vocab_size=520,
        model_type="bpe", byte_fallback=True, hard_vocab_limit=False, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, minloglevel=2,
        control_symbols=["[INST]", "[/INST]"], user_defined_symbols=["<tool>"],
    )  # fmt: skip
    return model.getvalue()


def _metadata(sp, **extra):
    """What llama.cpp's converter writes of a SentencePiece model."""
    n = sp.vocab_size()

    def kind(i):
        if sp.IsUnknown(i):
            return UNKNOWN
        if sp.IsControl(i):
            return CONTROL
        if sp.IsByte(i):
            return BYTE
        return USER_DEFINED if sp.IdToPiece(i) == "<tool>" else NORMAL

    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.IdToPiece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.GetScore(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def _texts(count, seed=0):
    rng = random.Random(seed)
    for _ in range(count):
        parts = rng.randint(1, 12)
        yield "".join(rng.choice(WORDS) + rng.choice(["", " ", "  ", "\n"]) for _ in range(parts))


@pytest.fixture(scope="module")
def sp(sp_model):
    return spm.SentencePieceProcessor(model_proto=sp_model)


@pytest.fixture(scope="module")
def ours(sp):
    tok, config, template = tokenizer_from_gguf(_metadata(sp))
    return Tokenizer(tok, config, template)


def test_ids_equal_sentencepiece_and_decode_back(sp, ours):
    for text in _texts(1500):
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert ours.decode(ids) == text


def test_bos_goes_first_unless_the_file_says_not_to(sp):
    assert Tokenizer(*tokenizer_from_gguf(_metadata(sp))).encode("the bay")[0] == 1
    off = _metadata(sp, **{"tokenizer.ggml.add_bos_token": False})
    assert Tokenizer(*tokenizer_from_gguf(off)).encode("the bay") == sp.encode("the bay")


def test_control_and_user_defined_tokens_stay_whole_with_the_prefix_after_them(sp, ours):
    """llama.cpp puts the space prefix before the text and after each special token."""
    inst, end, tool = (sp.PieceToId(t) for t in ("[INST]", "[/INST]", "<tool>"))
    ids = ours.encode("[INST] the bay[/INST]<tool>boats")
    assert ids == [1, inst, *sp.encode(" the bay"), end, tool, *sp.encode("boats")]
    assert ours.decode(ids, skip_special_tokens=False).endswith("[/INST]<tool> boats")


def test_without_the_space_prefix(sp):
    tok = Tokenizer(
        *tokenizer_from_gguf(_metadata(sp, **{"tokenizer.ggml.add_space_prefix": False}))
    )
    ids = tok.encode("the bay", add_special_tokens=False)
    assert not tok.token_text(ids[0]).startswith(" ")
    assert tok.decode(ids) == "the bay"


def test_streamed_text_equals_the_whole_decode(sp, ours):
    for text in _texts(200, seed=1):
        ids = ours.encode(text, add_special_tokens=False)
        stream = IncrementalDetokenizer(ours, [1])
        for i in ids:
            stream.append(i)
        stream.finish()
        assert stream.text == text


def test_token_bytes_spell_the_text(sp, ours):
    """What logprobs and structured outputs read: each token's bytes, joined, are the text (the
    prefix space first)."""
    for text in _texts(200, seed=2):
        ids = ours.encode(text, add_special_tokens=False)
        assert b"".join(ours.token_bytes(i) for i in ids).decode() == " " + text


@pytest.fixture(scope="module")
def converted_mistral(tmp_path_factory, sp_model):
    """A random Mistral (v0.3's shape: no sliding window) with the SentencePiece tokenizer, and
    the GGUF llama.cpp's own converter writes of it."""
    from nanoserve.testing import llamacpp_convert

    if llamacpp_convert.converter() is None:  # nothing is downloaded at test time
        pytest.skip(
            "llama.cpp's converter is not fetched: python -m nanoserve.testing.llamacpp_convert"
        )
    model_dir = tmp_path_factory.mktemp("mistral")
    write_family_checkpoint(
        model_dir, "mistral", vocab_size=520, bos_token_id=1, eos_token_id=2, sliding_window=None
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model_dir / name).unlink(missing_ok=True)
    (model_dir / "tokenizer.model").write_bytes(sp_model)
    out = llamacpp_convert.convert(model_dir, model_dir.parent / "mistral.gguf")
    yield model_dir, out
    shutil.rmtree(model_dir)


def test_ids_equal_transformers_reading_the_converted_file(converted_mistral, sp):
    """transformers' own GGUF tokenizer agrees but where the text starts with a space: its
    Metaspace adds no prefix there, llama.cpp and SentencePiece do (and so does nanoserve)."""
    import transformers

    _, path = converted_mistral
    checkpoint = GGUFCheckpoint(path)
    ours = checkpoint.tokenizer()
    assert checkpoint.index["tokenizer"]["vocab_size"] == ours.vocab_size  # the config's fallback
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in _texts(500, seed=3):
        if text[0].isspace():
            assert ours.encode(text) == [1, *sp.encode(text)]
        else:
            assert ours.encode(text) == theirs.encode(text), text


@torch.inference_mode()
def test_a_mistral_converted_by_llama_cpp_equals_transformers(converted_mistral, sp):
    import transformers

    model_dir, path = converted_mistral
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.config.family == "llama"  # llama.cpp writes Mistral as a llama
    llm = LLM(str(path))
    texts = ["The lighthouse keeper woke", "  two spaces, ünïcode 🦀", "ferry\nleaving 2024"]
    prompts = [llm.engine.tokenizer.encode(t) for t in texts]
    assert prompts == [[1, *sp.encode(t)] for t in texts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=16, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt) :].tolist()
