"""The environment variables nanoserve reads: each one's default and meaning, and the functions
that read those nanoserve reads itself. Imports nothing of nanoserve, and no torch.

NANOSERVE_CACHE (default ~/.cache/nanoserve): where the demo model and GGUF indexes are kept.
NANOSERVE_TP_TIMEOUT (default 60): seconds a tensor-parallel rank waits in a collective of a step
    before the step fails.
NANOSERVE_MEMORY_LIMIT_BYTES (default unset): the bytes this process may hold in all, in place
    of what MemAvailable and the cgroup limits leave it (engine/memory.py): the KV cache and the
    working margin must fit in this less what the process holds when it checks. For tests, or to
    count on memory the kernel does not report as available (swap).
GOMP_SPINCOUNT (set to 100000 on import, unless the user set it or OMP_WAIT_POLICY): how long an
    idle OpenMP thread spins before it sleeps; see set_openmp_defaults.
NANOSERVE_ISA (default: the best the CPU runs): caps the quantized matmuls' path at portable,
    avx2 or avx512. Read by the C kernels when they load (kernels/csrc/quant.c), since the
    kernels import nothing of nanoserve.
NANOSERVE_MARCH (default native): the -march the C kernels are built for. Read by setup.py at
    build time.
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK (default unset): torch.distributed's
    env:// rendezvous, for tensor-parallel ranks on several machines (`nanoserve worker`). Read
    by engine/parallel/tp.py, where the ranks join the group.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where nanoserve keeps what it builds once (the demo model, GGUF indexes)."""
    return Path(os.environ.get("NANOSERVE_CACHE") or Path.home() / ".cache" / "nanoserve")


def tp_timeout_s() -> float:
    """Seconds a tensor-parallel rank waits in a collective of a step: past it, another rank
    hung and the step fails."""
    text = os.environ.get("NANOSERVE_TP_TIMEOUT", "60")
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"NANOSERVE_TP_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return seconds


def memory_limit_bytes() -> int | None:
    """NANOSERVE_MEMORY_LIMIT_BYTES, or None when unset."""
    text = os.environ.get("NANOSERVE_MEMORY_LIMIT_BYTES")
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"NANOSERVE_MEMORY_LIMIT_BYTES must be a number of bytes, got {text!r}")
    return int(text)


def set_openmp_defaults() -> None:
    """Bound how long idle OpenMP threads spin, unless the user chose a policy.

    An OpenMP thread that spins while it waits for the next parallel region holds a core that
    other processes need, and a thread that waits at a barrier for a sibling descheduled by them
    spins through the sibling's turn: beside other work a decode step then takes several times
    its share. Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) share fairly but wake too
    slowly for the many short parallel regions of a decode step. A short spin keeps both:
    measured on a 2-core machine (README, "A busy machine"). libgomp reads this once, when torch
    loads it, so it must be set before anything imports torch.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "100000"
