"""Demo checkpoints: deterministic, loadable by transformers in every layout, cached."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import demo
from nanoserve.demo import CORPUS, demo_model_dir, write_checkpoint

PROMPT = CORPUS[:400]


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def hf_logits(path: Path) -> torch.Tensor:
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(ids).logits[0].float()


def test_builds_are_identical_across_processes(tiny_model_dir, tmp_path):
    script = (
        "import sys; from nanoserve.demo import write_checkpoint; write_checkpoint(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)
    assert files(tmp_path) == files(tiny_model_dir)
    assert set(files(tmp_path)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_config_and_generation_config(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    tok = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert (config["rope_theta"], config["head_dim"], config["vocab_size"]) == (500000.0, 16, 1024)
    assert gen["eos_token_id"] == [1020, 1023]  # <|end_of_text|>, <|eot_id|>
    assert (tok["bos_token"], tok["eos_token"]) == ("<|begin_of_text|>", "<|eot_id|>")


@pytest.mark.parametrize("layout", ["rope_theta", "rope_parameters"])
@pytest.mark.parametrize("shard_bytes", [None, 40_000])
def test_transformers_loads_every_layout_identically(
    tiny_model_factory, tiny_model_dir, layout, shard_bytes
):
    path = tiny_model_factory(config_layout=layout, shard_bytes=shard_bytes)
    config = json.loads((path / "config.json").read_text())
    assert ("rope_parameters" in config) == (layout == "rope_parameters")
    assert ("rope_theta" in config) == (layout == "rope_theta")
    if shard_bytes:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        assert not (path / "model.safetensors").exists()
    assert torch.equal(hf_logits(path), hf_logits(tiny_model_dir))


def test_random_model_is_varied_and_has_no_near_ties(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tok("The keeper wrote", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)
        top2 = model(out).logits[0].topk(2, dim=-1).values
    assert len(set(out[0, ids.shape[1] :].tolist())) >= 20
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5


def test_rope_settings_change_the_logits(tiny_model_factory, tiny_model_dir):
    """So a model that ignores llama3 scaling or rope_theta fails a logits comparison."""
    base = hf_logits(tiny_model_dir)
    assert (hf_logits(tiny_model_factory(rope_scaling=None)) - base).abs().max() > 0.1
    assert (hf_logits(tiny_model_factory(rope_theta=10000.0)) - base).abs().max() > 0.1


def test_weight_options(tiny_model_factory):
    path = tiny_model_factory(dtype="bfloat16", tie_word_embeddings=False, vocab_size=1100)
    with safe_open(path / "model.safetensors", "pt") as f:
        head = f.get_tensor("lm_head.weight")
        assert head.dtype == torch.bfloat16 and head.shape == (1100, 64)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, head)


def test_tied_checkpoint_has_no_lm_head(tiny_model_dir):
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())


def test_demo_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    path = demo_model_dir()
    assert path.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [path.name]
    before = files(path)
    monkeypatch.setattr(demo, "write_checkpoint", lambda *a, **k: pytest.fail("rebuilt"))
    assert demo_model_dir() == path
    assert files(path) == before
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 256


def test_chat_template_file_option(tmp_path):
    write_checkpoint(tmp_path, chat_template_jinja=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (tmp_path / "chat_template.jinja").read_text() == config["chat_template"]
