"""Embedding models from GGUF files written by llama.cpp's own converter, against
sentence-transformers on the Hugging Face directory they were converted from: a BERT encoder
(F32, F16, Q8_0) and a Qwen3 decoder saved as Qwen3-Embedding (last-token pooling on an appended
EOS), their tokenizers' ids against transformers', the pooling read from the file's
pooling_type, which files the pooling runner takes, what is refused by name, and one live
/v1/embeddings. Skipped where the converter is not fetched."""

import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer

from nanoserve.config import EngineConfig, SettingError
from nanoserve.engine import PoolingEngine, runs_pooling
from nanoserve.model import CheckpointError, GGUFCheckpoint, gguf_pooling
from nanoserve.model.gguf_file import GGUFError
from nanoserve.testing import llamacpp_convert
from nanoserve.testing.gguf_writer import rewrite_gguf
from nanoserve.testing.harness import live_pooling_server

TEXTS = [
    "the cat",
    "Paris is the capital of France, a city on a river!",
    "what is the tide of the sea when the moon is up? the tide is high",
    "a",
    "The DOG and the bird and the fish in the house by the road " * 3,
]
# Beyond the vocabulary's words: case, accents, a word of letters, an unknown character, a
# special token written in the text.
ODD_TEXTS = ["Café naïve résumé", "xyzzy 東京 ok", "[CLS] the [SEP] moon", "  spaced\tout\n"]


@pytest.fixture(scope="module")
def gguf_factory(embedding_model_factory, tmp_path_factory):
    """`factory(kind, outtype, **kwargs) -> (directory, GGUF)`: an embedding_model_factory
    checkpoint converted by llama.cpp (kind decoder: with SmolLM2's tokenizer, which llama.cpp
    knows, plus Qwen3-Embedding's appended EOS)."""
    if llamacpp_convert.converter() is None:  # nothing is downloaded at test time
        pytest.skip("llama.cpp's converter is not fetched: python -m "
                    "nanoserve.testing.llamacpp_convert")  # fmt: skip
    files = {}

    def factory(kind, outtype="f32", **kwargs):
        key = repr((kind, outtype, sorted(kwargs.items())))
        if key not in files:
            pre = "bert-bge"  # a random WordPiece vocabulary: its hash is in no list
            if kind == "decoder":
                from nanoserve.default_model import default_model_path

                tok = GGUFCheckpoint(default_model_path()).tokenizer()
                kwargs = {"tokenizer_json": tok.backend_json(), "vocab_size": tok.vocab_size,
                          **kwargs}  # fmt: skip
                pre = "smollm"  # SmolLM2's, whose hash the EOS template changes
            path = embedding_model_factory(kind, **kwargs)
            out = tmp_path_factory.mktemp("gguf") / f"{kind}-{outtype}.gguf"
            files[key] = path, llamacpp_convert.convert(path, out, outtype, pre)
        return files[key]

    return factory


def embed(engine: PoolingEngine, texts: list[str]) -> torch.Tensor:
    for i, text in enumerate(texts):
        engine.add_request(str(i), engine.admit(engine.tokenizer.encode(text), "input"))
    outputs = engine.step()
    return torch.tensor([o.data for o in outputs])


def cosines(path, gguf, texts=TEXTS) -> torch.Tensor:
    """Our vectors from the GGUF against sentence-transformers' from the directory (float32
    activations, whatever this CPU multiplies natively)."""
    ours = embed(PoolingEngine(gguf, EngineConfig(dtype="float32")), texts)
    theirs = torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts))
    assert ours.shape == theirs.shape
    return torch.nn.functional.cosine_similarity(ours, theirs)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_bert_gguf_embeds_as_sentence_transformers(gguf_factory, pooling):
    path, gguf = gguf_factory("bert", pooling=pooling)
    engine = PoolingEngine(gguf)
    assert engine.pooling.mode == pooling and engine.encoder is not None
    assert cosines(path, gguf).min() >= 0.9999


def test_a_decoder_gguf_embeds_as_sentence_transformers(gguf_factory):
    """Qwen3-Embedding's layout: qwen3.pooling_type LAST, the text's EOS the pooled token."""
    path, gguf = gguf_factory("decoder")
    engine = PoolingEngine(gguf)
    assert engine.pooling.mode == "lasttoken" and engine.decoder is not None
    assert engine.tokenizer.encode("the cat")[-1] == engine.tokenizer.eos_token_ids.pop()
    assert cosines(path, gguf).min() >= 0.9999


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_an_f16_gguf_embeds_close_to_sentence_transformers(gguf_factory, kind):
    """Half-precision weights (BERT's de-quantized to float32 at load, the decoder's kept in
    F16 for the kernels): cosine >= 0.999 against the float32 checkpoint."""
    path, gguf = gguf_factory(kind, "f16")
    assert cosines(path, gguf).min() >= 0.999


@pytest.mark.parametrize(
    ("kind", "logged"),
    [("bert", "de-quantized to torch.float32"), ("decoder", "kept in their formats: 15 q8_0")],
)
def test_a_q8_0_gguf_embeds_close_to_sentence_transformers(
    gguf_factory, tmp_path, caplog, kind, logged
):
    """llama.cpp's own Q8_0 quantizer: the encoder de-quantizes at load and says so, the
    decoder's matrices stay in their blocks (the CPU kernels'); cosine >= 0.99."""
    if not llamacpp_convert.quantizer_available():
        pytest.skip("llama-cpp-python (llama.cpp's quantizer) is not installed")
    path, f32 = gguf_factory(kind)
    q8 = llamacpp_convert.quantize(f32, tmp_path / "q8_0.gguf", "Q8_0")
    with caplog.at_level("INFO", logger="nanoserve.model"):
        values = cosines(path, q8)
    assert "q8_0" in caplog.text and logged in caplog.text, caplog.text
    assert values.min() >= 0.99


@pytest.mark.parametrize("kind", ["bert", "decoder"])
def test_a_gguf_tokenizer_gives_transformers_ids(gguf_factory, kind):
    path, gguf = gguf_factory(kind)
    ours = PoolingEngine(gguf).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS + ODD_TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    if kind == "bert":  # a pair: [CLS] A [SEP] B [SEP], B's token type 1
        pair = theirs("the cat", "a dog on the road")
        ids, types = ours.encode_pair("the cat", "a dog on the road")
        assert (ids, types) == (pair["input_ids"], pair["token_type_ids"])


def test_the_pooling_runner_takes_embedding_ggufs_and_not_generative_ones(gguf_factory):
    from nanoserve.default_model import default_model_path

    _, bert = gguf_factory("bert")
    _, decoder = gguf_factory("decoder")
    assert runs_pooling(bert, EngineConfig()) and runs_pooling(decoder, EngineConfig())
    assert not runs_pooling(decoder, EngineConfig(runner="generate"))  # a decoder generates too
    assert not runs_pooling(default_model_path(), EngineConfig())  # no pooling_type
    with pytest.raises(SettingError, match="runner"):
        runs_pooling(bert, EngineConfig(runner="generate"))


def test_a_cross_encoder_gguf_is_refused_by_name(gguf_factory):
    """The converter keeps the classifier (cls.output) but drops the pooler it reads."""
    _, gguf = gguf_factory("cross_encoder")
    with pytest.raises(GGUFError, match=r"cls\.output.*pooler"):
        PoolingEngine(gguf)


@pytest.mark.parametrize(
    ("kind", "changes", "error", "named"),
    [
        ("bert", {"bert.pooling_type": 4}, CheckpointError, r"bert\.pooling_type = 4, RANK"),
        ("decoder", {"qwen3.pooling_type": 0}, CheckpointError, r"qwen3\.pooling_type = 0, NONE"),
        ("bert", {"bert.attention.causal": True}, GGUFError, r"bert\.attention\.causal"),
        ("bert", {"tokenizer.ggml.model": "gpt2"}, GGUFError, r"tokenizer\.ggml\.model = 'gpt2'"),
    ],
)
def test_what_a_gguf_says_and_is_not_implemented_is_refused_by_name(
    gguf_factory, tmp_path, kind, changes, error, named
):
    _, gguf = gguf_factory(kind)
    changed = rewrite_gguf(gguf, tmp_path / "changed.gguf", changes)
    assert runs_pooling(changed, EngineConfig())
    with pytest.raises(error, match=named):
        PoolingEngine(changed)


def test_an_unknown_pooling_type_is_refused_and_none_is_the_default():
    meta = {"general.architecture": "qwen3", "qwen3.pooling_type": 9}
    with pytest.raises(CheckpointError, match=r"qwen3\.pooling_type = 9, unknown"):
        gguf_pooling(meta, "lasttoken", "m.gguf")
    assert gguf_pooling({"general.architecture": "bert"}, "cls", "m.gguf").mode == "cls"


async def test_a_bert_gguf_serves_embeddings(gguf_factory):
    path, gguf = gguf_factory("bert")
    async with live_pooling_server(gguf) as s:
        response = await s.http.post("/v1/embeddings", json={"input": TEXTS})
        assert response.status_code == 200, response.text
        got = torch.tensor([d["embedding"] for d in response.json()["data"]])
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-4)
