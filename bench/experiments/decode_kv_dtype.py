"""The CPU decode kernel over a KV cache of float32, bfloat16, float16 or q8_0 with float32
queries, one sequence of a long context: this build's kernel against another build of the C
module (--old, e.g. main's), called in turn in one process with every cache dtype's kernels of a
shape, so that all see the same machine load.

Prints microseconds per call and GB/s of KV bytes read (2 * ctx * kv_heads * bytes of a row of
head_dim values / time; a q8_0 row: head_dim / 32 * 34 bytes); writes
bench/results/decode_kv_dtype_cpu.json (--out). The old module takes one dtype for q and the cache
(and no q8_0), so it is timed with q of the cache's dtype (what it could do); the new one with q
float32 and, where the cache is 16-bit, also with q of the cache's dtype. --caches picks the
cache dtypes.
"""

import argparse
import importlib.machinery
import importlib.util
import json
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from nanoserve.kernels import KV_Q8_0, c_backend, q8_0_quantize

SHAPES = {"llama-1b": (32, 8, 64), "smollm2": (9, 3, 64)}  # (q heads, kv heads, head_dim)
CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "q8_0": KV_Q8_0,
}
BLOCK = 16
RESULTS = Path(__file__).parents[1] / "results"


def load_module(path: str):
    loader = importlib.machinery.ExtensionFileLoader("nanoserve.kernels._C", path)
    spec = importlib.util.spec_from_file_location("nanoserve.kernels._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def make_inputs(shape: tuple[int, int, int], ctx: int, cache_dtype: torch.dtype) -> dict:
    q_heads, kv_heads, head_dim = shape
    num_blocks = -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(0)
    cache_shape = (num_blocks, kv_heads, BLOCK, head_dim)
    k, v = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen)
    if cache_dtype == KV_Q8_0:
        k, v = q8_0_quantize(k), q8_0_quantize(v)
    else:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]
    q = torch.randn((1, q_heads, head_dim), generator=gen)
    return dict(q=q, k=k, v=v, table=table, lens=torch.tensor([ctx], dtype=torch.int32))


def call(module, x: dict, q: torch.Tensor, new: bool):
    """A function that runs module's kernel once on x with query q."""
    out = torch.empty_like(q)
    num_blocks, kv_heads, _, _ = x["k"].shape
    head_dim = q.shape[2]
    kwargs = dict(
        out=out.data_ptr(),
        q=q.data_ptr(),
        k_cache=x["k"].data_ptr(),
        v_cache=x["v"].data_ptr(),
        block_tables=x["table"].data_ptr(),
        context_lens=x["lens"].data_ptr(),
        num_seqs=1,
        num_q_heads=q.shape[1],
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=BLOCK,
        num_blocks=num_blocks,
        max_blocks_per_seq=x["table"].shape[1],
        scale=head_dim**-0.5,
        dtype_code=c_backend.DTYPE_CODES[q.dtype],
        num_threads=torch.get_num_threads(),
    )
    if new:
        kwargs["cache_dtype_code"] = c_backend.DTYPE_CODES[x["k"].dtype]
    keep = (out, q, x)  # the tensors behind the pointers live as long as the function

    def run() -> None:
        module.paged_attention_decode(**kwargs)
        assert keep

    return run


def time_in_turn(fns: dict, rounds: int, calls: int) -> dict:
    """Microseconds per call of each fn, timed round-robin in batches of `calls`: the fastest
    batch, the least disturbed by other jobs on a shared machine (whose stalls of one of the
    threads hold up the whole call)."""
    samples: dict = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: min(s) for name, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", help="another build of the C module (_C*.so) to time beside this one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--caches", nargs="+", choices=list(CACHE_DTYPES), default=list(CACHE_DTYPES))
    p.add_argument("--out", type=Path, default=RESULTS / "decode_kv_dtype_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    old = load_module(args.old) if args.old else None
    rows = []
    print(f"{cpu_model()}, {args.threads} threads; us per call (GB/s of KV read)")
    for shape_name, shape in SHAPES.items():
        for ctx in args.contexts:
            # Every cache dtype's kernels of a shape timed in turn, so their ratios see one load.
            fns, kv_bytes = {}, {}
            for cache_name in args.caches:
                cache_dtype = CACHE_DTYPES[cache_name]
                x = make_inputs(shape, ctx, cache_dtype)
                kernels = {"new q=float32": call(c_backend._C, x, x["q"], True)}
                if cache_dtype in (torch.bfloat16, torch.float16):
                    q_same = x["q"].to(cache_dtype)
                    kernels[f"new q={cache_name}"] = call(c_backend._C, x, q_same, True)
                if old is not None and cache_dtype != KV_Q8_0:
                    q_same = x["q"].to(cache_dtype)
                    kernels[f"old q={cache_name}"] = call(old, x, q_same, False)
                for name, fn in kernels.items():
                    fns[cache_name, name] = fn
                    kv_bytes[cache_name] = 2 * ctx * shape[1] * x["k"].shape[3] * x["k"].itemsize
            us = time_in_turn(fns, args.rounds, max(2, int(4e4 / ctx)))
            for (cache_name, name), t in us.items():
                gbs = kv_bytes[cache_name] / t / 1e3
                rows.append(dict(shape=shape_name, ctx=ctx, cache=cache_name, kernel=name,
                                 us=round(t, 1), gb_s=round(gbs, 2)))  # fmt: skip
                print(f"{shape_name:9} ctx {ctx:5} cache {cache_name:8} {name:16} "
                      f"{t:9.1f} us {gbs:6.2f} GB/s")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = dict(cpu=cpu_model(), threads=args.threads)
    args.out.write_text(json.dumps(dict(machine=machine, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
