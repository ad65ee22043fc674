"""The CPU model, for the machine description every benchmark writes into its JSON, and the CPU
timer the kernel benchmarks share."""

import platform
import statistics
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_ms(fn, budget_s: float = 0.25, max_calls: int = 200) -> float:
    """The median of warm calls of fn, in milliseconds: at least 3, more within budget_s."""
    fn()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget_s * 1e3 and len(times) < max_calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
