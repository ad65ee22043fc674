"""Benchmark of the paged-attention decode kernels (nanoserve.kernels), run by `nox -s bench`.

Times every backend available on the device over context lengths and batch sizes (GQA 32 query /
8 KV heads, head_dim 64, block 16, like Llama-3.2-1B), reports the KV bytes read per second against
the machine's measured copy bandwidth and the speed-up over the torch backend, prints a table, and
writes bench/results/kernels_<device>.json and .png. On CUDA it also times SDPA over a contiguous
cache and flex_attention with a paged block mask, as references; --sweep times Triton launch
configs instead. A sliding-window table times windows of 512-4096 tokens over an 8192-token
context against the same kernel over a context as long as the window.
"""

import argparse
import functools
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

import nanoserve.kernels as kernels
from bench.machine import cpu_model, median_ms
from nanoserve.kernels import c_backend

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16
GOALS = {  # the targets: (device, dtype, batch, context)
    "cpu": ("float32", 32, 2048),
    "cuda": ("bfloat16", 64, 4096),
}
RESULTS = Path(__file__).parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="a few points only (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG")
    p.add_argument("--sweep", action="store_true", help="CUDA: sweep Triton launch configs instead")
    p.add_argument("--references", action="store_true", help="time SDPA/flex on CPU too (slow)")
    return p.parse_args()


# ---------------------------------------------------------------- measurements


def timer(device: torch.device):
    """Returns time_ms(fn): the median time of fn, warm, in milliseconds."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    return functools.partial(median_ms, budget_s=0.25, max_calls=15)


def copy_bandwidth(device: torch.device, time_ms) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written (STREAM 'copy')."""
    nbytes = (2 << 30) if device.type == "cuda" else (512 << 20)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = min(time_ms(lambda: dst.copy_(src)) for _ in range(3))
    return 2 * nbytes / best / 1e6


def machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": cpu_model(),
    }
    if c_backend._C is not None:
        info["c_openmp_max_threads"] = c_backend._C.openmp_max_threads()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


# ---------------------------------------------------------------- inputs


class Pool:
    """One cache large enough for the biggest point; each point draws its blocks at random."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_tokens: int):
        self.num_blocks = max_tokens // BLOCK
        shape = (self.num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
        self.k = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
        self.v = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
        self.device, self.dtype = device, dtype

    def point(self, batch: int, context: int):
        blocks = math.ceil(context / BLOCK)
        order = torch.randperm(self.num_blocks, device=self.device)[: batch * blocks]
        tables = order.view(batch, blocks).to(torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
        q = torch.empty((batch, Q_HEADS, HEAD_DIM), dtype=self.dtype, device=self.device)
        return q.uniform_(-1, 1), tables, lens


def kv_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize


# ---------------------------------------------------------------- references (SDPA, flex)


def sdpa_fn(pool: Pool, batch: int, context: int):
    """SDPA over a contiguous cache holding the same number of KV bytes."""
    import torch.nn.functional as F

    shape = (batch, KV_HEADS, context, HEAD_DIM)
    k = torch.empty(shape, dtype=pool.dtype, device=pool.device).uniform_(-1, 1)
    v = torch.empty_like(k).uniform_(-1, 1)
    q = torch.empty((batch, Q_HEADS, 1, HEAD_DIM), dtype=pool.dtype, device=pool.device)
    q.uniform_(-1, 1)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def flex_fn(pool: Pool, batch: int, context: int):
    """flex_attention over a paged cache of 128-token pages (flex's block size), laid out as one
    [1, kv_heads, pages * 128, head_dim] tensor, with a block mask that lists each sequence's
    (shuffled) pages and masks the tokens past its length."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    page = 128
    pages = math.ceil(context / page)
    total = batch * pages
    dev, dtype = pool.device, pool.dtype
    k = torch.empty((1, KV_HEADS, total * page, HEAD_DIM), dtype=dtype, device=dev).uniform_(-1, 1)
    v = torch.empty_like(k).uniform_(-1, 1)
    q = torch.empty((batch, Q_HEADS, 1, HEAD_DIM), dtype=dtype, device=dev).uniform_(-1, 1)
    table = torch.randperm(total, device=dev).view(batch, pages).to(torch.int32)
    logical = torch.full((batch, total), -1, dtype=torch.int32, device=dev)
    logical.scatter_(
        1, table.long(), torch.arange(pages, device=dev, dtype=torch.int32).expand(batch, -1)
    )
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = logical[b, kv_idx // page] * page + kv_idx % page
        return (logical[b, kv_idx // page] >= 0) & (pos < lens[b])

    indices = torch.zeros((batch, 1, 1, total), dtype=torch.int32, device=dev)
    indices[:, 0, 0, :pages] = table  # flex wants one column per KV block of the whole cache
    mask = BlockMask.from_kv_blocks(
        torch.full((batch, 1, 1), pages, dtype=torch.int32, device=dev),
        indices,
        BLOCK_SIZE=page,
        mask_mod=mask_mod,
        seq_lengths=(1, total * page),
    )
    attend = torch.compile(flex_attention) if dev.type == "cuda" else flex_attention
    return lambda: attend(q, k, v, block_mask=mask, enable_gqa=True)


# ---------------------------------------------------------------- the run


def grid(device: torch.device, quick: bool) -> tuple[list[int], list[int], list[torch.dtype]]:
    if quick:
        return [1, 32], [512, 2048], [torch.float32 if device.type == "cpu" else torch.bfloat16]
    if device.type == "cuda":
        cuda_dtypes = [torch.bfloat16, torch.float16, torch.float32]  # every cache dtype it takes
        return [1, 8, 32, 64], [128, 512, 2048, 4096, 8192], cuda_dtypes
    return [1, 8, 32, 64], [128, 512, 2048, 8192], [torch.float32, torch.bfloat16]


def backends(device: torch.device) -> list[str]:
    names = [b for b in kernels.available_backends(device) if b != "torch"]
    if device.type == "cpu" and "triton" in names:
        names.remove("triton")  # only the interpreter runs it here: not worth timing
    return [*names, "torch"]


def torch_fits(device: torch.device, nbytes: int) -> bool:
    """The torch backend gathers the cache into new tensors: bound its time and memory on CPU."""
    return device.type == "cuda" or nbytes <= 300 << 20


def run(args: argparse.Namespace, device: torch.device) -> dict:
    time_ms = timer(device)
    copy_runs = [copy_bandwidth(device, time_ms)]
    copy_gbps = copy_runs[0]
    batches, contexts, dtypes = grid(device, args.quick)
    names = backends(device)
    refs = ["sdpa", "flex"] if device.type == "cuda" or args.references else []
    rows: list[dict] = []
    errors: list[str] = []
    for dtype in dtypes:
        pool = Pool(device, dtype, max(batches) * max(contexts))
        for batch in batches:
            for context in contexts:
                nbytes = kv_bytes(batch, context, dtype)
                q, tables, lens = pool.point(batch, context)
                out = torch.empty_like(q)
                times = {}
                for name in names:
                    if name == "torch" and not torch_fits(device, nbytes):
                        continue

                    def call(name=name, q=q, tables=tables, lens=lens, out=out, pool=pool):
                        kernels.paged_attention_decode(
                            q, pool.k, pool.v, tables, lens, HEAD_DIM**-0.5, out, backend=name
                        )

                    times[name] = time_ms(call)
                for ref in refs:
                    if ref == "flex" and (batch, context) not in flex_points(device, dtype):
                        continue
                    try:
                        fn = (sdpa_fn if ref == "sdpa" else flex_fn)(pool, batch, context)
                        times[ref] = time_ms(fn)
                    except Exception as e:  # a reference that cannot run here is reported
                        errors.append(f"{ref} {dtype} {batch}x{context}: {type(e).__name__}: {e}")
                for name, ms in times.items():
                    rows.append(row(name, dtype, batch, context, ms, nbytes, times))
                print_row(rows[len(rows) - len(times) :], copy_gbps)
    # A shared machine's bandwidth drifts: measure again and compare against the better of the two.
    copy_runs.append(copy_bandwidth(device, time_ms))
    copy_gbps = max(copy_runs)
    for r in rows:
        r["fraction_of_copy"] = round(r["kv_gbps"] / copy_gbps, 3)
    window_rows = windows(device, time_ms, names, dtypes[0], args.quick)
    for r in window_rows:
        r["fraction_of_copy"] = round(r["kv_gbps"] / copy_gbps, 3)
    result = {
        "benchmark": "paged_attention_decode",
        "shape": dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK),
        "machine": machine(device),
        "copy_gbps": round(copy_gbps, 2),
        "copy_gbps_runs": [round(c, 2) for c in copy_runs],
        "copy_gbps_counts": "bytes read + bytes written per second of a large tensor copy; the "
        "better of a run before and one after the kernels",
        "kv_gbps_counts": "K and V bytes of the attended tokens per second (q and out excluded)",
        "results": rows,
        "windows": window_rows,
        "windows_counts": "kv_gbps counts the K and V bytes of the tokens in the window only; "
        "same_bytes_ms is the kernel without a window over a context as long as the window",
        "reference_errors": errors,
        "goal": goal(rows, device),
    }
    return result


def windows(device: torch.device, time_ms, names: list[str], dtype: torch.dtype, quick: bool):
    """Sliding windows (Mistral's, Gemma 3's local layers) over a long context: a window should
    cost what a context of its length costs, since the kernel skips the blocks before it."""
    batch, context = GOALS[device.type][1], 8192
    sizes = [1024] if quick else [512, 1024, 4096]
    pool = Pool(device, dtype, batch * context)
    q, tables, lens = pool.point(batch, context)
    out = torch.empty_like(q)
    found = []
    for name in [n for n in names if n != "torch"]:
        for window in sizes:

            def call(window=window, name=name, lens=lens):
                kernels.paged_attention_decode(q, pool.k, pool.v, tables, lens, HEAD_DIM**-0.5,
                                               out, backend=name, window=window)  # fmt: skip

            short = torch.full_like(lens, window)
            ms, same_ms = time_ms(call), time_ms(functools.partial(call, 0, lens=short))
            r = row(name, dtype, batch, context, ms, kv_bytes(batch, window, dtype), {})
            found.append({**r, "window": window, "same_bytes_ms": round(same_ms, 4)})
            print(f"{name:>8} window {window:5d} of {context}: {ms:.3f} ms "
                  f"({r['kv_gbps']:.1f} GB/s over the window); no window over {window} "
                  f"tokens: {same_ms:.3f} ms", flush=True)  # fmt: skip
    return found


def flex_points(device: torch.device, dtype: torch.dtype) -> set[tuple[int, int]]:
    """flex compiles one kernel per shape: time it at a few points only."""
    if device.type != "cuda":
        return {(8, 512)}
    return {(64, 4096), (32, 2048)} if dtype == torch.bfloat16 else set()


def row(name, dtype, batch, context, ms, nbytes, times) -> dict:
    base = times.get("torch")
    return {
        "backend": name,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": context,
        "ms": round(ms, 4),
        "kv_gbps": round(nbytes / ms / 1e6, 2),
        "speedup_vs_torch": round(base / ms, 2) if base else None,
    }


HEADER = f"{'backend':>8} {'dtype':>9} {'batch':>5} {'context':>7} {'ms':>10} {'KV GB/s':>8} "
HEADER += f"{'of copy':>8} {'vs torch':>8}"


def print_row(rows: list[dict], copy_gbps: float) -> None:
    for r in rows:
        speedup = f"{r['speedup_vs_torch']:.2f}x" if r["speedup_vs_torch"] else "-"
        print(
            f"{r['backend']:>8} {r['dtype']:>9} {r['batch']:>5} {r['context']:>7} {r['ms']:>10.3f} "
            f"{r['kv_gbps']:>8.1f} {r['kv_gbps'] / copy_gbps:>8.1%} {speedup:>8}",
            flush=True,
        )


def goal(rows: list[dict], device: torch.device) -> dict:
    dtype, batch, context = GOALS[device.type]
    at = {
        r["backend"]: r
        for r in rows
        if (r["dtype"], r["batch"], r["context"]) == GOALS[device.type]
    }
    kernel = at.get("c" if device.type == "cpu" else "triton")
    report = {"dtype": dtype, "batch": batch, "context": context, "kernel": kernel}
    if kernel and device.type == "cpu":
        report["speedup_vs_torch (target 2x, goal 4x)"] = kernel["speedup_vs_torch"]
        report["fraction_of_copy (goal 0.5)"] = kernel["fraction_of_copy"]
    if kernel and device.type == "cuda":
        report["fraction_of_copy (target 0.8)"] = kernel["fraction_of_copy"]
        if "sdpa" in at:
            report["speedup_vs_sdpa (target >= 1)"] = round(at["sdpa"]["ms"] / kernel["ms"], 3)
    return report


def sweep(device: torch.device) -> dict:
    """Triton launch configs at the CUDA goal point, to choose the defaults in triton_decode.py."""
    from nanoserve.kernels import triton_decode

    time_ms = timer(device)
    copy_gbps = copy_bandwidth(device, time_ms)
    dtype, batch, context = torch.bfloat16, *GOALS["cuda"][1:]
    pool = Pool(torch.device("cuda"), dtype, batch * context)
    q, tables, lens = pool.point(batch, context)
    out = torch.empty_like(q)
    found = []
    for split in (256, 512, 1024):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    config = dict(tokens_per_split=split, block_n=block_n, num_warps=warps)
                    config["num_stages"] = stages

                    def call(config=config):
                        triton_decode.paged_attention_decode(
                            q, pool.k, pool.v, tables, lens, HEAD_DIM**-0.5, out, **config
                        )

                    try:
                        ms = time_ms(call)
                    except Exception as e:
                        found.append({**config, "error": f"{type(e).__name__}: {e}"[:300]})
                        continue
                    gbps = kv_bytes(batch, context, dtype) / ms / 1e6
                    found.append(
                        {**config, "ms": round(ms, 4), "fraction_of_copy": gbps / copy_gbps}
                    )
                    print(
                        f"sweep {config}: {ms:.4f} ms, {gbps / copy_gbps:.1%} of copy", flush=True
                    )
    defaults = dict(
        tokens_per_split=triton_decode.TOKENS_PER_SPLIT,
        block_n=triton_decode.BLOCK_N,
        num_warps=triton_decode.NUM_WARPS,
        num_stages=triton_decode.NUM_STAGES,
    )
    best = min((f for f in found if "ms" in f), key=lambda f: f["ms"], default=None)
    return {
        "machine": machine(device),
        "copy_gbps": round(copy_gbps, 2),
        "point": dict(dtype="bfloat16", batch=batch, context=context),
        "defaults": defaults,
        "best": best,
        "configs": found,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    names = sorted({r["backend"] for r in rows})
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    styles = ["-", "--", "-.", ":"]
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        batches = sorted({r["batch"] for r in rows if r["dtype"] == dtype})
        for name in names:
            for style, batch in zip(styles, batches, strict=False):
                pts = [
                    r
                    for r in rows
                    if (r["backend"], r["dtype"], r["batch"]) == (name, dtype, batch)
                ]
                if pts:
                    xs = [r["context"] for r in pts]
                    ys = [r["kv_gbps"] for r in pts]
                    ax.plot(
                        xs, ys, style, marker="o", color=colors[name], label=f"{name} b={batch}"
                    )
        ax.axhline(result["copy_gbps"], color="gray", linestyle=":", label="copy (read+write)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("KV read GB/s")
        ax.set_title(f"{dtype}, {result['machine']['device_name']}", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("paged_attention_decode: 32 q / 8 kv heads, head_dim 64, block 16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu"
    )
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        if device.type != "cuda":
            print("--sweep needs CUDA", file=sys.stderr)
            return 2
        result = sweep(device)
        (args.out / "kernels_cuda_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
        print("best:", result["best"], "defaults:", result["defaults"])
        return 0
    print(f"device {device}; backends {backends(device)}", flush=True)
    print(HEADER, flush=True)
    result = run(args, device)
    runs = ", ".join(f"{c:.1f}" for c in result["copy_gbps_runs"])
    print(f"copy bandwidth {result['copy_gbps']:.1f} GB/s (read+write; runs: {runs}); the table's")
    print("'of copy' column used the first run, the JSON uses the better one")
    print("goal:", json.dumps(result["goal"], indent=1))
    for error in result["reference_errors"]:
        print("reference error:", error, file=sys.stderr)
    stem = f"kernels_{device.type}" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, args.out / f"{stem}.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(f"wrote {args.out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
