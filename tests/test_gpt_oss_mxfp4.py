"""gpt-oss from a Hugging Face directory whose experts are MXFP4 (quantization_config
quant_method "mxfp4", NAME_blocks and NAME_scales as openai/gpt-oss-20b ships them): the random
checkpoint of test_gpt_oss with its experts quantized to MXFP4 here, beside the same checkpoint
with those experts de-quantized by transformers' own code (its mxfp4 integration). Floats read
from the blocks equal transformers' de-quantization bit for bit; kept in their blocks on the CPU,
the experts are GGUF's MXFP4 (no float copy), and greedy ids equal transformers' on the
de-quantized checkpoint; a broken pair of tensors, or another quantization, is refused by name.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families import _reference
from test_gpt_oss import gpt_oss_dir  # noqa: F401 (the fixture)
from test_oracle import _ours, _prompts

from nanoserve import LLM
from nanoserve.kernels import QuantizedWeight
from nanoserve.model.checkpoint import HFCheckpoint
from nanoserve.model.config import CheckpointError, ModelConfig

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (blocks, scales) of a float experts tensor [experts, K, rows]: each block of 32 values
    along K scaled by 2^e, e the least that brings its largest magnitude to 6 or under, each value
    the nearest FP4 code."""
    m = w.transpose(1, 2).float()
    b = m.reshape(*m.shape[:2], -1, 32)
    amax = b.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    scaled = b / torch.exp2(e).unsqueeze(-1)
    magnitudes = torch.tensor(mxfp4.FP4_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) | (scaled < 0).long() << 3
    code = code.to(torch.uint8)
    return (code[..., 0::2] | code[..., 1::2] << 4).contiguous(), (e + 127).to(torch.uint8)


def _copy(model_dir, path, tensors, **config_changes):
    path.mkdir()
    (path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **config_changes}))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def dirs(gpt_oss_dir, tmp_path_factory):  # noqa: F811
    """(the MXFP4 checkpoint, the same with its experts de-quantized by transformers)."""
    tensors = load_file(gpt_oss_dir / "model.safetensors")
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(EXPERTS):
            blocks, scales = to_mxfp4(w)
            del quantized[name]
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            dequantized[name] = mxfp4.convert_moe_packed_tensors(
                blocks, scales, dtype=torch.float32
            )
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    return (_copy(gpt_oss_dir, root / "mxfp4", quantized, **config),
            _copy(gpt_oss_dir, root / "dequantized", dequantized))  # fmt: skip


def test_floats_are_transformers_dequantization(dirs):
    blocks, floats = (HFCheckpoint(d) for d in dirs)
    assert blocks.block_formats() == ["mxfp4"] and floats.block_formats() == []
    ours = blocks.read_tensors(torch.float32, "cpu", keep_blocks=False)
    theirs = floats.read_tensors(torch.float32, "cpu")
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_kept_blocks_are_ggufs_mxfp4(dirs):
    checkpoint = HFCheckpoint(dirs[0])
    kept = checkpoint.read_tensors(torch.float32, "cpu", keep_blocks=True)
    floats = HFCheckpoint(dirs[1]).read_tensors(torch.float32, "cpu")
    from nanoserve.kernels import dequantize

    experts = [n for n, w in kept.items() if isinstance(w, QuantizedWeight)]
    assert len(experts) == 3 * ModelConfig.from_dir(dirs[0]).num_layers
    for name in experts:
        w = kept[name]
        assert w.qtype == "mxfp4"
        assert torch.equal(dequantize(w), floats[name].flatten(0, 1)), name
    stored = sum(t.numel() for n, t in load_file(dirs[0] / "model.safetensors").items()
                 if n.endswith(("_blocks", "_scales")))  # fmt: skip
    assert sum(kept[n].data.numel() for n in experts) == stored  # the file's bytes, no more
    assert checkpoint.weight_bytes(torch.float32, keep_blocks=True) < checkpoint.weight_bytes(
        torch.float32
    )


def test_greedy_equals_transformers_on_the_dequantized_checkpoint(dirs):
    """The engine keeps the experts in their blocks (and the one-call C step takes them)."""
    with LLM(str(dirs[0])) as llm:
        layer = llm.engine.runner.model.weights.layers[0]
        assert all(isinstance(e.weight, QuantizedWeight) and e.weight.qtype == "mxfp4"
                   for e in (layer.experts_gate, layer.experts_up, layer.experts_down))  # fmt: skip
        assert llm.engine.runner.cpu_step is not None
    prompts = _prompts(500)
    ours, _ = _ours(dirs[0], prompts)
    assert ours == _reference(dirs[1], prompts)


def test_floats_on_request_equal_transformers(dirs):
    prompts = _prompts(500)[:3]
    ours, _ = _ours(dirs[0], prompts, quantization="none")
    assert ours == _reference(dirs[1], prompts)


def _broken(dirs, tmp_path, edit):
    tensors = load_file(dirs[0] / "model.safetensors")
    edit(tensors)
    config = json.loads((dirs[0] / "config.json").read_text())
    return _copy(dirs[0], tmp_path / "broken", tensors, **config)


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
         "down_proj_blocks has no model.layers.1.mlp.experts.down_proj_scales"),
        (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_blocks"),
         "gate_up_proj_scales has no model.layers.0.mlp.experts.gate_up_proj_blocks"),
        (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_blocks":
                             t["model.layers.0.mlp.experts.down_proj_blocks"].float()}),
         "down_proj_blocks is F32 .* but an MXFP4 _blocks tensor is U8"),
        (lambda t: t.update({"model.layers.2.mlp.experts.down_proj_scales":
                             t["model.layers.2.mlp.experts.down_proj_scales"][:, :-1]
                             .contiguous()}),
         "down_proj_scales has shape .* but its blocks make it"),
    ],
    ids=["no-scales", "no-blocks", "float-blocks", "scales-shape"],
)  # fmt: skip
def test_a_broken_pair_is_refused_by_name(dirs, tmp_path, edit, words):
    with pytest.raises(CheckpointError, match=words):
        HFCheckpoint(_broken(dirs, tmp_path, edit))


def test_other_quantizations_are_refused_by_name(dirs, tmp_path):
    config = {"quantization_config": {"quant_method": "awq"}}
    path = _copy(dirs[0], tmp_path / "awq", load_file(dirs[0] / "model.safetensors"), **config)
    with pytest.raises(ValueError, match=r"quantization_config \(awq\) is not supported"):
        ModelConfig.from_dir(path)
