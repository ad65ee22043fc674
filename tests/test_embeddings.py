"""The pooling engine against sentence-transformers, the oracle: a BERT encoder's and a Qwen3
decoder's vectors for single and batched inputs of mixed lengths, batch invariance, the token
budget of a step, and the checkpoint keys and files refused by name."""

import json
import shutil

import pytest
import torch
from sentence_transformers import SentenceTransformer

from nanoserve.config import EngineConfig, SettingError
from nanoserve.engine import PoolingEngine, runs_pooling
from nanoserve.model import CheckpointError

TEXTS = [
    "the cat",
    "paris is the capital of france, a city on a river",
    "what is the tide of the sea when the moon is up? the tide is high when the moon is up",
    "a",
    "the dog and the bird and the fish in the house by the road " * 4,
]


def embed(engine: PoolingEngine, texts: list[str]) -> torch.Tensor:
    """The texts' vectors from one step (all fit its budget)."""
    for i, text in enumerate(texts):
        engine.add_request(str(i), engine.admit(engine.tokenizer.encode(text), "input"))
    outputs = engine.step()
    assert not engine.has_unfinished()
    return torch.tensor([o.data for o in outputs])


def oracle(path, texts: list[str]) -> torch.Tensor:
    return torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts))


def check_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    cosine = torch.nn.functional.cosine_similarity(ours, theirs)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", False)])
def test_bert_vectors_equal_sentence_transformers(embedding_model_factory, pooling, normalize):
    path = embedding_model_factory("bert", pooling=pooling, normalize=normalize)
    engine = PoolingEngine(path)
    expected = oracle(path, TEXTS)
    check_close(embed(engine, TEXTS), expected)  # one batch
    for i, text in enumerate(TEXTS):  # one at a time
        check_close(embed(engine, [text]), expected[i : i + 1])


def test_decoder_vectors_equal_sentence_transformers(embedding_model_factory):
    """A Qwen3 decoder saved as Qwen3-Embedding is: last-token pooling, normalized."""
    path = embedding_model_factory("decoder")
    engine = PoolingEngine(path)
    assert engine.pooling.mode == "lasttoken" and engine.pooling.normalize
    expected = oracle(path, TEXTS)
    batched = embed(engine, TEXTS)
    check_close(batched, expected)
    for i, text in enumerate(TEXTS):
        alone = embed(engine, [text])
        check_close(alone, expected[i : i + 1])
        # The decoder's matmuls are row invariant only up to a few rows (model.invariant_rows):
        # alone and in a batch agree to float32 rounding, not bitwise.
        torch.testing.assert_close(alone[0], batched[i], atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bert_vector_is_bitwise_the_same_alone_or_in_a_batch(embedding_model_factory, dtype):
    """Inputs longer and shorter than a matmul tile, in batches of different sizes."""
    engine = PoolingEngine(embedding_model_factory("bert"), EngineConfig(dtype=dtype))
    batched = embed(engine, TEXTS)
    for i, text in enumerate(TEXTS):
        assert torch.equal(embed(engine, [text])[0], batched[i]), text
    assert torch.equal(embed(engine, TEXTS[::-1]), batched.flip(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", ["bias", "residual", "activation"])
def test_a_tiled_rows_result_does_not_depend_on_its_place_or_neighbours(dtype, fused):
    """bert.py's tiles: a row gives the same bits wherever in a tile it lands (the packed
    sequences before it shift it) and whatever rows share the tile, with the bias, residual
    or activation fused into the matmul."""
    from nanoserve.model.bert import TILE_ROWS, _by_tiles, _tile
    from nanoserve.model.linear import Linear

    torch.manual_seed(0)
    weight, bias = Linear(torch.randn(96, 64, dtype=dtype)), torch.randn(96, dtype=dtype)
    x, r = torch.randn(3 * TILE_ROWS + 5, 64, dtype=dtype), torch.randn(3 * TILE_ROWS + 5, 96)
    r = r.to(dtype)

    def run(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if fused == "residual":
            return _by_tiles(lambda t, u: _tile(t, weight, bias, residual=u), x, r)
        act = ("gelu", "none") if fused == "activation" else None
        return _by_tiles(lambda t: _tile(t, weight, bias, act=act), x)

    alone = run(x, r)
    for shift in (1, 7, TILE_ROWS - 1, TILE_ROWS + 3):
        other = torch.randn(shift, 64, dtype=dtype), torch.randn(shift, 96).to(dtype)
        shifted = run(torch.cat([other[0], x]), torch.cat([other[1], r]))
        assert torch.equal(shifted[shift:], alone), shift
    assert torch.equal(run(x[:5], r[:5]), alone[:5])  # a tile of padding


def test_a_bert_vector_longer_than_a_tile_is_bitwise_the_same_at_any_offset(
    embedding_model_factory,
):
    """A text of more than TILE_ROWS tokens after 0 to 3 others: its rows start at another
    place in the tiles each time."""
    from nanoserve.model.bert import TILE_ROWS

    engine = PoolingEngine(embedding_model_factory("bert"))
    long = "the dog and the bird and the fish in the house by the road " * 7
    assert len(engine.tokenizer.encode(long)) > TILE_ROWS
    alone = embed(engine, [long])[0]
    for before in range(1, 4):
        assert torch.equal(embed(engine, [*TEXTS[:before], long])[before], alone), before


def test_a_step_takes_what_fits_its_token_budget(embedding_model_factory):
    path = embedding_model_factory("bert")
    engine = PoolingEngine(path, EngineConfig(max_num_batched_tokens=32))
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    for i, one in enumerate(ids):
        engine.add_request(str(i), engine.admit(one, "input"))
    steps = []
    while engine.has_unfinished():
        steps.append([o.request_id for o in engine.step()])
    assert [r for step in steps for r in step] == [str(i) for i in range(len(TEXTS))]
    for step in steps:  # a step over the budget holds one input alone
        tokens = sum(len(ids[int(r)]) for r in step)
        assert tokens <= 32 or len(step) == 1
    assert len(steps) > 1
    assert engine.abort("0") is None  # finished: nothing is kept


def test_admission_refuses_by_field(embedding_model_factory):
    engine = PoolingEngine(embedding_model_factory("bert"))
    too_long = [5] * (engine.max_model_len + 1)
    with pytest.raises(ValueError, match="context") as e:
        engine.admit(too_long, "input")
    assert e.value.param == "input"
    assert len(engine.admit(too_long, "input", truncate=10).token_ids) == 10
    assert len(engine.admit(too_long, "input", truncate=-1).token_ids) == engine.max_model_len
    with pytest.raises(ValueError, match="vocabulary"):
        engine.admit([engine.vocab_size], "input")
    with pytest.raises(ValueError, match="empty"):
        engine.admit([], "input")


def test_sentence_transformers_max_seq_length_is_the_context(embedding_model_factory, tmp_path):
    path = shutil.copytree(embedding_model_factory("bert"), tmp_path / "m")
    config = json.loads((path / "sentence_bert_config.json").read_text())
    (path / "sentence_bert_config.json").write_text(json.dumps({**config, "max_seq_length": 16}))
    assert PoolingEngine(path).max_model_len == 16


def _edited(path, tmp_path, file, **changes):
    copy = shutil.copytree(path, tmp_path / "edited")
    data = json.loads((copy / file).read_text())
    (copy / file).write_text(json.dumps({**data, **changes}))
    return copy


@pytest.mark.parametrize(
    ("file", "changes", "named"),
    [
        ("config.json", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ("config.json", {"hidden_act": "swish"}, "hidden_act"),
        ("config.json", {"is_decoder": True}, "is_decoder"),
        ("1_Pooling/config.json", {"pooling_mode": "max"}, "pooling_mode"),
        ("config.json", {"matryoshka_dimensions": [0]}, "matryoshka_dimensions"),
        ("1_Pooling/config.json", {"include_prompt": False}, "include_prompt"),
        ("config_sentence_transformers.json", {"default_prompt_name": "q"}, "default_prompt_name"),
        ("config_sentence_transformers.json", {"prompts": ["q"]}, "prompts"),
    ],
)
def test_what_would_change_the_vectors_is_refused_by_name(
    embedding_model_factory, tmp_path, file, changes, named
):
    path = _edited(embedding_model_factory("bert"), tmp_path, file, **changes)
    with pytest.raises(CheckpointError, match=named):
        PoolingEngine(path)


def test_a_module_beyond_pooling_and_normalize_is_refused(embedding_model_factory, tmp_path):
    path = shutil.copytree(embedding_model_factory("bert"), tmp_path / "m")
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="Dense"):
        PoolingEngine(path)


def test_the_runner_follows_the_model(embedding_model_factory, tiny_model_dir):
    bert = embedding_model_factory("bert")
    assert runs_pooling(bert, EngineConfig())
    assert not runs_pooling(tiny_model_dir, EngineConfig())
    assert runs_pooling(tiny_model_dir, EngineConfig(runner="pooling"))
    assert runs_pooling(tiny_model_dir, EngineConfig(convert="embed"))
    with pytest.raises(SettingError, match="runner"):
        runs_pooling(bert, EngineConfig(runner="generate"))
    with pytest.raises(SettingError, match="convert"):
        runs_pooling(tiny_model_dir, EngineConfig(runner="pooling", convert="none"))
    with pytest.raises(SettingError, match="convert"):
        runs_pooling(tiny_model_dir, EngineConfig(runner="generate", convert="embed"))


def test_a_decoder_without_sentence_transformers_files_pools_its_last_token(tiny_model_dir):
    """--runner pooling on a plain causal LM: the last token's final hidden state (after the
    final norm), normalized, as transformers' model computes it."""
    import transformers

    engine = PoolingEngine(tiny_model_dir, EngineConfig(runner="pooling"))
    assert (engine.pooling.mode, engine.pooling.normalize) == ("lasttoken", True)
    model = transformers.AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for text in TEXTS[:3]:
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0, -1]
        check_close(embed(engine, [text]), torch.nn.functional.normalize(h, dim=0)[None])


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("speculative_config", '{"method": "ngram", "num_speculative_tokens": 2}'),
        ("quantization", "q8_0"),
    ],
)
def test_settings_a_pooling_model_cannot_honour_are_refused(embedding_model_factory, setting,
                                                            value):  # fmt: skip
    config = EngineConfig(**{setting: value})
    with pytest.raises(SettingError, match=setting) as e:
        PoolingEngine(embedding_model_factory("bert"), config)
    assert e.value.name == setting
