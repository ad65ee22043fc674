"""Host memory: what this process may still take, and the check that the KV cache fits in it.

What may be taken is the smaller of the kernel's MemAvailable (/proc/meminfo) and the headroom of
every cgroup that holds the process (its own and its ancestors', v1 or v2, found from
/proc/self/cgroup and /proc/self/mountinfo): the limit less the usage, where the usage leaves out
the inactive page cache that the kernel reclaims before it kills anything (what Docker and the
kubelet count too). NANOSERVE_MEMORY_LIMIT_BYTES stands in for all of it (env.py).

Before the weights load, a CPU model whose tensors would not fit in what may be taken is refused
(`check_weights_fit`, from engine/model_runner.py; for the tensor-parallel ranks spawned on
this machine, which each read the whole checkpoint at once, from parallel/tp.py), so that a
file too large is never half loaded and killed. The engine asks again after the weights are
loaded and before the KV pool is written (engine.py): the pool (every local rank's, and a draft
model's) and a working margin for the steps' activations must fit in what may be taken, or the
start is refused with the largest pool that would fit. Reads files only: no torch.
"""

from __future__ import annotations

import ctypes
import logging
import math
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanoserve import env
from nanoserve.config import EngineConfig, SettingError
from nanoserve.kernels import c_backend
from nanoserve.model import ModelConfig

log = logging.getLogger(__name__)

GiB = 2**30
MiB = 2**20
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Measured on SmolLM2-135M (9 heads, float32) as the peak RSS of one prompt above the ready
# state (README, "Memory"): 443 MB for a 2040-token prompt in one chunk, 809 MB for 4000 tokens
# and 1531 MB for 8100 tokens in chunks of 2048, 2.7 to 2.95 times heads x chunk x context x 4
# bytes: SDPA's math path on a CPU keeps the scores, their softmax and the mask's like alive.
ATTENTION_COPIES = 3
FIXED_MARGIN = 128 * MiB  # first steps' scratch, sampling, grammars, the HTTP side
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# v1 reports "no limit" as the largest page-aligned 63-bit value; anything near it is none.
V1_UNLIMITED = 2**62


class NotEnoughMemory(SettingError):
    """The KV cache asked for does not fit, beside the working margin, in what this process may
    still take: names the setting to lower and the largest value that fits."""


class ModelTooLarge(ValueError):
    """A checkpoint whose weights do not fit in what this process may take: names the file, the
    bytes its weights need and the bytes free."""


def check_weights_fit(path: Path, needed: int, room: Headroom, ranks: int = 1) -> None:
    """Raise ModelTooLarge unless `needed` bytes of weights (those of `ranks` tensor-parallel
    ranks on this machine, each reading the whole checkpoint) fit in `room`."""
    if needed > room.bytes:
        whose = f" ({ranks} ranks on this machine, each reading it whole)" if ranks > 1 else ""
        raise ModelTooLarge(
            f"{path.name}: its weights need {needed} bytes ({gib(needed)}){whose} in memory, but "
            f"{room.bytes} bytes ({gib(room.bytes)}) may be taken ({room.source}): refused "
            "before loading"
        )


@dataclass(frozen=True)
class Pools:
    """What the engine is about to take on this host. `block_bytes`: one block of every pool
    (each local rank's share, a draft model's); `setting_block_bytes`: one block as
    kv_cache_memory_gb counts it (the target's, all ranks); `margin_at`: the working margin of
    every local rank at a context length (working_margin), `context` the engine's."""

    blocks: int
    block_bytes: int
    setting_block_bytes: int
    margin_at: Callable[[int], int]
    context: int
    weights: int  # already held: for the message
    dtype: str
    draft: bool

    @property
    def pool(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def margin(self) -> int:
        return self.margin_at(self.context)


@dataclass(frozen=True)
class Headroom:
    """Bytes this process may still take, and what says so (for the refusal's message)."""

    bytes: int
    source: str


def headroom(
    meminfo: Path = Path("/proc/meminfo"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    mountinfo: Path = Path("/proc/self/mountinfo"),
) -> Headroom:
    """The smallest of MemAvailable and the headroom of each cgroup that holds this process;
    NANOSERVE_MEMORY_LIMIT_BYTES, when set, instead (less what the process holds now)."""
    limit = env.memory_limit_bytes()
    if limit is not None:
        held = resident_bytes()
        return Headroom(limit - held, f"NANOSERVE_MEMORY_LIMIT_BYTES={limit} less {gib(held)} held")
    found = [Headroom(b, "MemAvailable") for b in [meminfo_available(meminfo)] if b is not None]
    for directory, version in cgroup_dirs(proc_cgroup, mountinfo):
        room = cgroup_headroom(directory, version)
        if room is not None:
            found.append(Headroom(room, f"cgroup {directory}"))
    if not found:  # no /proc (not Linux): nothing to go by, nothing refused
        return Headroom(2**63, "unknown (no /proc/meminfo)")
    return min(found, key=lambda h: h.bytes)


def meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None where the file or the line is missing."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def resident_bytes(status: Path = Path("/proc/self/status")) -> int:
    """VmRSS of this process (0 where /proc is missing)."""
    try:
        text = status.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cgroup_dirs(proc_cgroup: Path, mountinfo: Path) -> list[tuple[Path, int]]:
    """The memory cgroup directories that hold this process, its own first, then each ancestor
    up to the mount's root, with the cgroup version (1 or 2). A directory that is not there is
    skipped: a container that sees its own cgroup as the mount's root has its path from the
    host's view in /proc/self/cgroup."""
    try:
        lines, mounts = proc_cgroup.read_text().splitlines(), mountinfo.read_text().splitlines()
    except OSError:
        return []
    dirs: list[tuple[Path, int]] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = 2 if hierarchy == "0" and controllers == "" else 1
        if version == 1 and "memory" not in controllers.split(","):
            continue
        mount = _mount(mounts, version)
        if mount is None:
            continue
        root, point = mount
        relative = path[len(root) :] if path.startswith(root) else path
        here = point / relative.lstrip("/")
        inside = [d for d in [here, *here.parents] if d == point or point in d.parents]
        dirs += [(d, version) for d in inside if d.is_dir()]
    return dirs


def _mount(mounts: list[str], version: int) -> tuple[str, Path] | None:
    """(root within the hierarchy, mount point) of the cgroup2 mount, or of the v1 mount that
    has the memory controller."""
    for line in mounts:
        fields, _, after = line.partition(" - ")
        parts, rest = fields.split(), after.split()
        if len(parts) < 5 or len(rest) < 3:
            continue
        if version == 2 and rest[0] == "cgroup2":
            return parts[3], Path(parts[4])
        if version == 1 and rest[0] == "cgroup" and "memory" in rest[2].split(","):
            return parts[3], Path(parts[4])
    return None


def cgroup_headroom(directory: Path, version: int) -> int | None:
    """The limit less the usage (without inactive page cache) of one cgroup directory; None
    where it has no limit ("max", or v1's near 2**63) or no memory files."""
    names = ("memory.max", "memory.current") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes",
    )  # fmt: skip
    try:
        limit_text, usage_text = ((directory / n).read_text().strip() for n in names)
    except OSError:
        return None
    if limit_text == "max" or int(limit_text) >= V1_UNLIMITED:
        return None
    inactive = _stat(directory / "memory.stat", "inactive_file" if version == 2 else (
        "total_inactive_file"
    ))  # fmt: skip
    return int(limit_text) - max(0, int(usage_text) - inactive)


def _stat(path: Path, key: str) -> int:
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def gib(n: int) -> str:
    """Bytes as GiB with two decimals, for messages."""
    return f"{n / GiB:.2f} GiB"


def check_fits(config: EngineConfig, pools: Pools, room: Headroom) -> None:
    """Raise NotEnoughMemory unless the pools and the working margin fit in `room`. Named: the
    setting the pool was sized by (num_kv_blocks, or kv_cache_memory_gb), with its largest value
    that fits; or max_model_len, with the longest context that fits, where the margin at this
    context leaves no room for a block, or the largest pool that fits holds fewer tokens than
    the max_model_len asked for."""
    if pools.pool + pools.margin <= room.bytes:
        return
    block_size = config.block_size
    fit = max(0, (room.bytes - pools.margin) // pools.block_bytes)
    draft = ", a draft model's included" if pools.draft else ""
    figures = (
        f"the KV cache would take {gib(pools.pool)} ({pools.blocks} blocks of {block_size} "
        f"tokens, {pools.dtype}{draft}) and the working margin {gib(pools.margin)} (the largest "
        f"prefill step's, at context {pools.context}), beside {gib(pools.weights)} "
        f"of weights already loaded; {gib(room.bytes)} more may be taken ({room.source})"
    )
    if fit == 0 or (config.max_model_len is not None and fit * block_size < pools.context):
        longest = _longest_context(pools, room, block_size)
        pool = (room.bytes - pools.margin_at(longest)) // pools.block_bytes
        rule = (
            f"at most {longest} to fit in memory, with a KV cache of at most "
            f"{_floor(pool * pools.setting_block_bytes / GiB)} GiB"
            if longest else "smaller: not one block fits beside the working margin"
        )  # fmt: skip
        raise NotEnoughMemory("max_model_len", pools.context, f"{rule}: {figures}")
    if config.num_kv_blocks is not None:
        raise NotEnoughMemory("num_kv_blocks", config.num_kv_blocks, f"at most {fit} to fit "
                              f"in memory: {figures}")  # fmt: skip
    largest = _floor(fit * pools.setting_block_bytes / GiB)
    asked = config.kv_cache_memory_gb  # or the default's, as sized
    if asked is None:
        asked = float(_floor(pools.blocks * pools.setting_block_bytes / GiB))
    raise NotEnoughMemory(
        "kv_cache_memory_gb", asked, f"at most {largest} to fit in memory: {figures}"
    )


def _longest_context(pools: Pools, room: Headroom, block_size: int) -> int:
    """The longest context (a multiple of the block size, up to the engine's) whose working
    margin and one sequence's blocks fit in `room`; 0 if not even one block does."""

    def fits(blocks: int) -> bool:
        return pools.margin_at(blocks * block_size) + blocks * pools.block_bytes <= room.bytes

    low, high = 0, pools.context // block_size  # fits(low) unless low is 0; search the rest
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low * block_size


def _floor(gib: float) -> str:
    """GiB rounded down to two decimals (to four below 0.01), so that the value given fits."""
    digits = 2 if gib >= 0.01 else 4
    return f"{math.floor(gib * 10**digits) / 10**digits:.{digits}f}"


def working_margin(model: ModelConfig, config: EngineConfig, max_model_len: int) -> int:
    """The most one rank takes beyond its weights and KV pool while it serves: the largest step's
    activations, and a fixed part. A layer's activations for a step of max_num_batched_tokens,
    FIXED_MARGIN for the rest, and where prefill attention is torch SDPA over the chunk and its
    gathered context (model/attention.py: CUDA, the torch backend, the C kernels off) about
    ATTENTION_COPIES tensors of [heads, chunk, context] at once, most of it at a long context.
    The C prefill kernel holds a tile's scratch per thread (in FIXED_MARGIN)."""
    itemsize = DTYPE_BYTES.get(config.dtype, 4)  # the engine's config: "auto" is resolved
    tokens = min(config.max_num_batched_tokens, max_model_len)
    heads = model.num_heads // config.tensor_parallel_size
    scores = ATTENTION_COPIES * heads * tokens * max_model_len * itemsize
    if config.device == "cpu" and config.attention_backend in ("auto", "c") and c_backend.enabled():
        scores = 0
    layer = tokens * (8 * model.hidden_size + 4 * model.intermediate_size) * itemsize
    return scores + layer + FIXED_MARGIN


def keep_freed_memory(most: int) -> bool:
    """Have glibc's malloc keep freed blocks of up to `most` bytes for the next ones, where it
    would hand them back to the kernel (blocks past its mmap threshold, 32 MiB at most by default,
    and the heap's free top). A CPU step's activations are such blocks, and every step would
    fault their pages in and zero them again: on an AMD EPYC, 6% of a 512-token prompt's time in
    the kernel's page faults (README, "Memory"). What is kept stays within working_margin, which
    the pool's check reserved. False where the C library is not glibc or refuses the values."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    kept = mallopt(M_MMAP_THRESHOLD, most) == 1 and mallopt(M_TRIM_THRESHOLD, most) == 1
    log.debug("malloc keeps freed blocks of up to %d MiB: %s", most // MiB, kept)
    return kept
