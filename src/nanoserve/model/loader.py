"""From a checkpoint's tensors to the forward pass's weights, as model/weights.py describes them:
fuses q/k/v and gate/up into one matrix each (and their biases), checks each layer tensor's shape
and that every tensor is consumed, ties the output
projection to the embedding where the checkpoint does, keeps this rank's slices under tensor
parallelism (model/parallel.py), and wraps every matrix in a `Linear` (which packs it for the
device's fastest matmul) or, for a matrix kept in GGUF blocks, a `QuantLinear`. Where the weights
live is the caller's choice (`place`). Also reads a Hugging Face checkpoint's safetensors (single
file or shards), and checks their names, dtypes and shapes against the config from the files'
headers alone (`check_tensors`), before anything loads. Owns nothing after loading.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from nanoserve.kernels import QuantizedParts
from nanoserve.model import gpt_oss, hf_mxfp4
from nanoserve.model.config import CheckpointError, ModelConfig, read_json
from nanoserve.model.linear import Linear
from nanoserve.model.moe import Experts
from nanoserve.model.parallel import SINGLE, Parallel, held_experts, shard
from nanoserve.model.quantized import Blocks, QuantLinear, Weight, cat_rows, placed
from nanoserve.model.weights import (
    LAYER,
    MODEL,
    PER_EXPERT,
    LayerWeights,
    LlamaWeights,
    Tensor,
    listed,
    names,
    part_shapes,
)

Placement = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def load_weights(
    raw: dict[str, Weight],
    config: ModelConfig,
    place: Placement | None = None,
    parallel: Parallel = SINGLE,
) -> LlamaWeights:
    """The model's weights from its tensors under Hugging Face names (`raw` is emptied): fused,
    cut to this rank's slices, moved by `place` (copies of the tensors, in order; a tensor listed
    twice is the same copy twice), then packed."""
    tensors = shard(fuse(raw, config), config, parallel)
    if place is not None:
        tensors = placed(tensors, place)
    return pack(tensors, config, parallel)


def read_checkpoint(
    path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint under their Hugging Face names, the floats cast to `dtype` on
    `device`; MXFP4 blocks and scales (uint8, model/hf_mxfp4.py) as they are, on the CPU."""
    weights: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with _opened(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = f.get_tensor(name)
                weights[name] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t
    return weights


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """safe_open; a truncated or corrupt file is a CheckpointError naming it."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def tensor_bytes(path: str | Path, dtype: torch.dtype, keep_blocks: bool) -> int:
    """The bytes the checkpoint's tensors take in memory as read_tensors gives them, from the
    files' headers: floats in dtype, MXFP4 matrices in their bytes with keep_blocks (else as
    floats: two values a byte of their blocks)."""
    total = 0
    for file in checkpoint_files(path):
        with _opened(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                n = math.prod(f.get_slice(name).get_shape())
                mxfp4 = hf_mxfp4.part_of(name)
                if mxfp4 is None:
                    total += n * dtype.itemsize
                elif keep_blocks:
                    total += n
                elif mxfp4[1] == "_blocks":
                    total += 2 * n * dtype.itemsize
    return total


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: a single file, or the shards its index
    names (FileNotFoundError naming the directory or the missing shard)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map is missing or empty")
        files = [path / str(name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: missing (named in {index.name})")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json "
        "(nanoserve loads Hugging Face checkpoints in safetensors format)"
    )


def fuse(weights: dict[str, Weight], config: ModelConfig) -> list[Weight]:
    """Every tensor of the model in `listed` order (model/weights.py), a fused matrix's parts
    stacked by rows, each part's shape checked against the config; a tied output projection is
    the embedding itself. Takes the tensors out of `weights`, so that the separate matrices are
    freed once fused. A tensor the model has no use for is refused, naming it."""
    taken: dict[str, Weight] = {}
    out: list[Weight] = []
    for prefix, name, t in listed(config):
        keys = names(prefix, t, config)
        if t.tied_to is not None and keys[0] not in weights:
            if not config.tie_word_embeddings:
                raise ValueError(f"checkpoint has no {keys[0]} and tie_word_embeddings is false")
            out.append(taken[t.tied_to])
            continue
        if t.kind in PER_EXPERT:
            out.append(_experts(weights, prefix, t, config))
            continue
        parts = [weights.pop(key) for key in keys]
        if t.parts is not None:
            _check_shapes(keys, parts, t.parts(config))
        if t.kind == "norm" and config.norm_plus_one:
            # Gemma's RMSNorm scales by 1 + w in float32 (also in a bfloat16 model): kept in
            # float32, the same numbers (model/llama.py's norms take a float32 weight).
            parts = [p.float() + 1.0 for p in parts]
        taken[name] = parts[0] if len(parts) == 1 else cat_rows(parts)
        out.append(taken[name])
    unused = [key for key in weights if not key.endswith(IGNORED)]
    if unused:
        raise ValueError(f"checkpoint has tensor {unused[0]}, which this model does not use")
    return out


def _experts(weights: dict[str, Weight], prefix: str, t: Tensor, config: ModelConfig) -> Weight:
    """An experts tensor stacked: a checkpoint's matrix per expert stacked into [experts, rows,
    columns] (floats) or [experts * rows, columns] (blocks, one expert's rows after another's), or
    the stacked tensor a GGUF file has (under the name without the expert's index) as it is."""
    (shape,) = t.parts(config)  # type: ignore[misc]
    stacked = (config.num_experts, *shape)
    key = f"{prefix}{t.stacked_names(config)[0]}.{t.suffix}"
    if key in weights:
        w = weights.pop(key)
        want = (stacked[0] * stacked[1], stacked[2]) if isinstance(w, Blocks) else stacked
        if tuple(w.shape) != want:
            raise ValueError(f"{key} has shape {list(w.shape)}, but the config makes it {want}")
        return w
    keys = names(prefix, t, config)
    parts = [weights.pop(k) for k in keys]
    _check_shapes(keys, parts, part_shapes(t, config))
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.stack(parts)  # type: ignore[arg-type]
    return cat_rows(parts)


# Buffers some checkpoints save that the config already determines (RoPE's frequencies).
IGNORED = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F32", "F16", "BF16")


def check_tensors(path: str | Path, config: ModelConfig) -> list[str]:
    """Every tensor of a safetensors checkpoint is one the config's model has, in floats (or
    gpt-oss's experts in MXFP4, model/hf_mxfp4.py), of the shape the config makes it, and none is
    missing; CheckpointError naming the file and the first tensor at fault. Reads the files'
    headers only. Returns the block formats found: ["mxfp4"] or none."""
    expected: dict[str, tuple[int, ...] | None] = {}
    for prefix, _, t in listed(config):
        shapes = list(part_shapes(t, config)) if t.parts else [None] * len(t.hf)
        expected.update(zip(names(prefix, t, config), shapes, strict=True))
    tied = "lm_head.weight"
    mxfp4: dict[tuple[str, str], tuple[int, ...]] = {}  # (matrix, part): shape
    for file in checkpoint_files(path):
        with _opened(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(IGNORED):
                    continue
                info = f.get_slice(name)
                dtype, shape = info.get_dtype(), tuple(info.get_shape())
                part = hf_mxfp4.part_of(name) if config.gpt_oss else None
                if part is not None:
                    _check_mxfp4_part(file, name, dtype, shape)
                    mxfp4[part], dtype = shape, "F32"  # kept as the floats it holds
                kept = gpt_oss.kept_names(name, shape) if config.gpt_oss else [(name, shape)]
                for kept_name, kept_shape in kept:
                    _check_tensor(file, kept_name, dtype, kept_shape, expected, config)
                    expected.pop(kept_name, None)
    _check_mxfp4_pairs(path, mxfp4)
    if config.tie_word_embeddings:
        expected.pop(tied, None)
    if expected:
        missing = next(iter(expected))
        missing = gpt_oss.stored_name(missing) if config.gpt_oss else missing
        why = " and tie_word_embeddings is false" if missing == tied else ""
        raise CheckpointError(f"{path}: checkpoint has no tensor {missing}{why}")
    return ["mxfp4"] if mxfp4 else []


def _check_mxfp4_part(file: Path, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    rank = 4 if name.endswith("_blocks") else 3
    if dtype != "U8" or len(shape) != rank or (rank == 4 and shape[3] != 16):
        want = "[experts, rows, K / 32, 16]" if rank == 4 else "[experts, rows, K / 32]"
        raise CheckpointError(
            f"{file}: tensor {name} is {dtype} {list(shape)}, but an MXFP4 {name[-7:]} tensor "
            f"is U8 {want}"
        )


def _check_mxfp4_pairs(path: str | Path, parts: dict[tuple[str, str], tuple[int, ...]]) -> None:
    """Each MXFP4 matrix has its blocks and its scales, one scale a block."""
    for (matrix, part), shape in parts.items():
        other = "_scales" if part == "_blocks" else "_blocks"
        if (matrix, other) not in parts:
            raise CheckpointError(f"{path}: {matrix}{part} has no {matrix}{other}")
        blocks = shape if part == "_blocks" else parts[matrix, other]
        scales = parts[matrix, "_scales"]
        if blocks[:3] != scales:
            raise CheckpointError(
                f"{path}: {matrix}_scales has shape {list(scales)}, but its blocks make it "
                f"{list(blocks[:3])}"
            )


def _check_tensor(
    file: Path,
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    expected: dict[str, tuple[int, ...] | None],
    c: ModelConfig,
) -> None:
    if name not in expected:
        raise CheckpointError(
            f"{file}: tensor {name} is not part of a {c.family} model with this config.json "
            "(nanoserve refuses a checkpoint whose tensors it would not all use)"
        )
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name} is {dtype}: nanoserve loads float32, bfloat16 and float16 "
            "weights (no quantized safetensors layouts)"
        )
    want = expected[name]
    if want is None:  # an embedding or output projection: [vocab (maybe padded), hidden]
        if len(shape) != 2 or shape[1] != c.hidden_size or shape[0] < c.vocab_size:
            raise CheckpointError(
                f"{file}: tensor {name} has shape {list(shape)}, but the config makes it "
                f"[{c.vocab_size} or more, {c.hidden_size}]"
            )
    elif shape != want:
        raise CheckpointError(
            f"{file}: tensor {name} has shape {list(shape)}, but the config makes it {list(want)}"
        )


def _check_shapes(keys: list[str], parts: list[Weight], shapes: list[tuple[int, ...]]) -> None:
    for key, part, shape in zip(keys, parts, shapes, strict=True):
        if tuple(part.shape) != shape:
            raise ValueError(
                f"{key} has shape {list(part.shape)}, but the config makes it {list(shape)}"
            )


def pack(tensors: list[Weight], config: ModelConfig, parallel: Parallel = SINGLE) -> LlamaWeights:
    """The flat list from `fuse` (cut to `parallel`'s rank) as LlamaWeights: every matrix a
    Linear (or QuantLinear), experts the rank's Experts, an embedding as it is, a norm's weight
    or a bias a float tensor; an option the config's model has not stays None."""
    held = held_experts(config.num_experts, parallel.rank, parallel.size)
    it = iter(tensors)
    own = {name: _kept(t.kind, next(it), held) for name, t in MODEL}
    present = [name for name, t in LAYER if t.present(config)]
    kinds = dict((name, t.kind) for name, t in LAYER)
    layers = [
        LayerWeights(**{name: _kept(kinds[name], next(it), held) for name in present})
        for _ in range(config.num_layers)
    ]
    return LlamaWeights(**own, layers=layers)


def _kept(kind: str, w: Weight, held: range) -> Any:
    """w as LlamaWeights and LayerWeights keep a tensor of `kind` (model/weights.py); experts
    tensors hold the experts `held`."""
    if kind == "matrix":
        return QuantLinear(w) if isinstance(w, Blocks) else Linear(w)
    if kind == "experts":
        assert not isinstance(w, QuantizedParts), "one experts tensor is in one format"
        return Experts(w, held)
    assert kind == "embedding" or isinstance(w, torch.Tensor), "vectors are never quantized"
    return w
