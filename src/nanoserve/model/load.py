"""A checkpoint loaded into a model on one rank, and every decision that takes: the dtype ("auto"),
where the weights live (a CPU's huge pages; a GPU; host memory cut into slices under tensor
parallelism), which matrices stay in GGUF blocks or are quantized at load, and whether the CPU's
one-call decode step applies. The engine's runner calls these and runs what they give it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from nanoserve.config import EngineConfig, SettingError
from nanoserve.kernels import SMALL_LINEAR_MAX_ROWS
from nanoserve.model import hugepages
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.cpu_step import CpuDecodeStep, not_in_c
from nanoserve.model.linear import onednn_packs
from nanoserve.model.llama import Llama
from nanoserve.model.loader import LlamaWeights, load_weights
from nanoserve.model.parallel import Parallel
from nanoserve.model.quantized import Blocks, formats, quantize_matrices
from nanoserve.model.weights import LAYER, matrices

log = logging.getLogger(__name__)


def resolve_dtype(config: EngineConfig, checkpoint: Checkpoint) -> EngineConfig:
    """dtype "auto": the fastest correct dtype for the device. CUDA: bfloat16. CPU: float32 when
    the weights are (or will be) GGUF blocks, whose kernels take float32 activations; else
    bfloat16 where oneDNN multiplies it natively (AVX-512 BF16, AMX), float32 elsewhere (an
    emulated bfloat16 matmul is slower than float32). Then kv_cache_dtype (`_kv_dtype`)."""
    blocks = config.quantization not in ("auto", "none") or (
        config.quantization == "auto" and bool(checkpoint.block_formats())
    )
    if config.dtype == "auto":
        if config.device.startswith("cuda"):
            dtype, why = "bfloat16", "a GPU"
        elif blocks:
            dtype, why = "float32", "weights in GGUF blocks take float32 activations"
        elif onednn_packs(torch.bfloat16):
            dtype, why = "bfloat16", "this CPU multiplies bfloat16 natively"
        else:
            dtype, why = "float32", "this CPU has no native bfloat16 matmul"
        log.info("dtype auto: %s (%s)", dtype, why)
        config = replace(config, dtype=dtype)
    return replace(config, kv_cache_dtype=_kv_dtype(config, blocks, checkpoint.config.head_dim))


def _kv_dtype(config: EngineConfig, blocks: bool, head_dim: int) -> str:
    """kv_cache_dtype "auto": the activations' dtype, but float16 for float32 activations of
    GGUF-block matrices on a CPU (llama.cpp's cache: half the bytes a token, and a quantized
    model's outputs already differ from its float32 ones by more than the rounding). A float32
    float model keeps a float32 cache, as transformers computes it. CUDA's Triton kernels read
    the cache in the activations' dtype: any other is refused, q8_0 too (its blocks are read by
    the CPU kernels only), as is q8_0 for heads not made of its blocks of 32."""
    kv = config.kv_cache_dtype
    if config.device.startswith("cuda") and kv not in ("auto", config.dtype):
        raise SettingError(
            "kv_cache_dtype", kv, f"auto or the activations' dtype ({config.dtype}) on CUDA, "
            "whose kernels read the cache in it",
        )  # fmt: skip
    if kv == "q8_0" and head_dim % 32:
        raise SettingError(
            "kv_cache_dtype", kv, f"auto or a float dtype for this model, whose head_dim "
            f"({head_dim}) is no multiple of q8_0's blocks of 32",
        )  # fmt: skip
    if kv != "auto":
        return kv
    kv = (
        "float16"
        if blocks and config.dtype == "float32" and config.device == "cpu"
        else config.dtype
    )
    log.info("kv_cache_dtype auto: %s", kv)
    return kv


def load_model(
    checkpoint: Checkpoint,
    config: EngineConfig,
    device: torch.device,
    parallel: Parallel,
    positions: int,
) -> Llama:
    """This rank's model on its device, with RoPE tables for `positions` positions."""
    if checkpoint.config.gpt_oss and device.type != "cpu":
        raise SettingError(
            "device", config.device, "cpu for gpt-oss, whose attention sinks have no Triton kernel"
        )
    return Llama(checkpoint.config, _weights(checkpoint, config, device, parallel), positions,
                 parallel)  # fmt: skip


def weight_bytes(checkpoint: Checkpoint, config: EngineConfig, parallel: Parallel) -> int:
    """The bytes this rank's load will read into host memory, as `_weights` keeps them: the whole
    checkpoint's tensors (under tensor parallelism too: each rank reads it whole, then cuts),
    matrices in their GGUF blocks where they stay so. Not oneDNN's packed copies of float
    matrices, which come after."""
    keep = _keeps_blocks(config, torch.device(config.device), parallel)
    return checkpoint.weight_bytes(config.torch_dtype, keep)


def _keeps_blocks(c: EngineConfig, device: torch.device, parallel: Parallel) -> bool:
    """Whether a GGUF's matrices stay in their blocks: on a CPU, in one process, in float32,
    unless quantization="none"."""
    whole = parallel.size == 1
    blocks = whole and device.type == "cpu" and c.dtype == "float32"
    return blocks and c.quantization != "none"


def decode_step(model: Llama, device: torch.device, parallel: Parallel) -> CpuDecodeStep | None:
    """The one-call C decode step, where it applies: on a CPU, in one process (it cannot stop
    mid-step to all-reduce), for layers it has the fields of."""
    if device.type != "cpu" or parallel.size != 1:
        return None
    layers = model.weights.layers
    if CpuDecodeStep.supported(layers, model.config):
        return CpuDecodeStep(layers, model.config)
    if not_in_c(layers):
        log.info("decode: layer by layer (the one-call C step: %s)", not_in_c(layers))
    return None


def invariant_rows(model: Llama, device: torch.device) -> int | None:
    """The most rows of a matmul whose each row's result does not depend on the others': any
    number (None) where every matrix is in GGUF blocks (their kernels take each row on its own);
    else, on a CPU, the C GEMV's rows (oneDNN, which takes more, is not row invariant). On CUDA
    no matmul is row invariant at any size: None, and greedy output is as batch invariant as the
    argmax of cuBLAS's rows."""
    if device.type == "cuda":
        return None
    ms = [m for layer in model.weights.layers for m in matrices(layer)]
    ms.append(model.weights.lm_head)
    if all(isinstance(m.weight, Blocks) for m in ms):
        return None
    return SMALL_LINEAR_MAX_ROWS


def held_bytes(model: Llama) -> int:
    """Bytes the model's tensors hold: each storage once (a huge-page arena is one), and oneDNN's
    packed matrices (opaque tensors, without a storage to ask)."""
    sizes: dict[int, int] = {}
    for t in _tensors(vars(model), set()):
        if t.is_mkldnn:
            sizes[id(t)] = t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def _weights(
    checkpoint: Checkpoint, c: EngineConfig, device: torch.device, parallel: Parallel
) -> LlamaWeights:
    """This rank's weights on its device. Under tensor parallelism the checkpoint is read into
    host memory and cut there, so that a device holds only its slices. On a CPU, in one
    process and in float32, matrices may stay in GGUF blocks: a GGUF's own (unless
    quantization="none"), or a float checkpoint's quantized at load (quantization="q8_0"...)."""
    whole = parallel.size == 1
    blocks = whole and device.type == "cpu" and c.dtype == "float32"
    if c.quantization not in ("auto", "none") and not blocks:
        raise ValueError(
            f"quantization={c.quantization!r} needs dtype float32 on a CPU in one process "
            f"(here dtype {c.dtype}, device {device}, {parallel.size} processes)"
        )
    keep = _keeps_blocks(c, device, parallel)
    raw = checkpoint.read_tensors(c.torch_dtype, device if whole else "cpu", keep)
    if c.quantization not in ("auto", "none"):
        blocked = sorted(n for n, t in raw.items() if not isinstance(t, torch.Tensor))
        if blocked:  # a quantized GGUF: its blocks are not quantized a second time
            raise SettingError(
                "quantization", c.quantization, f"auto or none for a file whose matrices are "
                f"already in blocks ({len(blocked)} of them, e.g. {blocked[0]})",
            )  # fmt: skip
        raw = quantize_matrices(raw, c.quantization)  # type: ignore[arg-type]
    place = _to(device) if not whole else None
    if device.type == "cpu":
        place = hugepages.pack
    weights = load_weights(raw, checkpoint.config, place, parallel)
    log.info("weights: %s", _describe(weights, c.dtype))
    return weights


def _to(device: torch.device) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    def place(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        copies = {id(t): t.to(device) for t in tensors}  # a tied matrix stays one copy
        return [copies[id(t)] for t in tensors]

    return place


def _describe(weights: LlamaWeights, dtype: str) -> str:
    """How the matrices are kept, e.g. '120 matrices in q4_1 blocks, 1 in q8_0 blocks', and a
    mixture's experts tensors (each a 3-D stack of every expert's matrix) likewise."""
    layers = weights.layers
    ms = [m.weight for x in layers for m in matrices(x)]
    counts = formats([*ms, weights.lm_head.weight])
    text = f"{sum(counts.values())} matrices: " + _listed(counts, dtype)
    experts = [getattr(x, n) for x in layers for n, t in LAYER if t.kind == "experts"]
    if any(e is not None for e in experts):
        counts = formats([e.weight if isinstance(e.weight, Blocks) else e.weight[0]
                          for e in experts])  # fmt: skip
        text += f"; {sum(counts.values())} experts tensors: " + _listed(counts, dtype)
    return text


def _listed(counts: dict[str, int], dtype: str) -> str:
    return ", ".join(f"{n} in {k} blocks" if k != "float" else f"{n} in {dtype}"
                     for k, n in counts.items())  # fmt: skip


def _tensors(obj: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """The tensors reachable from `obj` through dicts, lists, tuples and objects' attributes."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, seen)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from _tensors(vars(obj), seen)
