"""A GGUF file's load, nanoserve against llama.cpp: what a user waits for before a first token
can be computed. Each load runs in a fresh process that imports torch, nanoserve and llama_cpp
before the clock starts, and the engines take turns, so that they share the machine's noise; the
median and the fastest of --repeats loads are kept.

- nanoserve: `LLM(path)` until it returns, its KV pool written whole (as it is before serving).
  "first": an empty cache directory, the file's first load (its header parsed, its tokenizer
  built); "again": the cache the first load left. With its default pool (1 GiB, float32), and
  with one of max_model_len tokens (`num_kv_blocks`), llama.cpp's at that n_ctx.
- llama.cpp: `Llama(model_path=path, n_ctx=N, verbose=False)` (llama-cpp-python; its AMX weight
  buffers off where the CPU has AMX, as bench/llamacpp.py explains), with N its default (512),
  nanoserve's max_model_len (the ratios' reference) and the tokens nanoserve's default pool
  holds (llama.cpp's KV cache in float16, nanoserve's in float32); and the model alone
  (`llama_model_load_from_file`: the file mapped, no context, no KV cache).

The files: the default model (SmolLM2-135M-Instruct, Q4_1) and, unless --skip-kquants, SmolLM2
as llama.cpp's own converter and quantizer write it in Q4_K_M (bench_kquants.py's way).

    python -m bench.bench_load [--repeats 7] [--skip-kquants]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import cpu_model

RESULTS = Path(__file__).parent / "results"
LLAMA_DEFAULT_N_CTX = 512  # llama-cpp-python's Llama() without n_ctx
MODEL_ONLY = 0  # n_ctx for llama.cpp's model without a context


def child(engine: str, path: str, tokens: int) -> dict:
    """One load in this process, timed from the constructor's call to its return. `tokens`:
    nanoserve's KV pool (0: its default), llama.cpp's n_ctx (0: the model alone)."""
    import torch  # noqa: F401  (imported before the clock, as a user's program has it)

    if engine == "nanoserve":
        from nanoserve import LLM
        from nanoserve.config import EngineConfig

        blocks = {"num_kv_blocks": tokens // EngineConfig().block_size} if tokens else {}
        start = time.perf_counter()
        llm = LLM(path, **blocks)
        seconds = time.perf_counter() - start
        e = llm.engine
        return {"seconds": seconds, "max_model_len": e.max_model_len,
                "kv_tokens": e.num_blocks * e.config.block_size}  # fmt: skip
    import llama_cpp

    amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    start = time.perf_counter()
    if tokens == MODEL_ONLY:
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = not amx
        llama_cpp.llama_backend_init()
        llama_cpp.llama_model_load_from_file(path.encode(), params)
    else:
        extra = {"use_extra_bufts": False} if amx else {}
        llama_cpp.Llama(model_path=path, n_ctx=tokens, verbose=False, **extra)
    return {"seconds": time.perf_counter() - start}


def load_once(engine: str, path: Path, tokens: int = 0, cache: Path | None = None) -> dict:
    """A load in a fresh process (`child`); `cache`: nanoserve's cache directory."""
    env = dict(os.environ, **({"NANOSERVE_CACHE": str(cache)} if cache else {}))
    command = [sys.executable, "-m", "bench.bench_load", "--child", engine, str(path),
               str(tokens)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{engine} failed to load {path}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_file(path: Path, repeats: int, tmp: Path) -> dict:
    """Every engine's loads of one file, taking turns."""
    shape = load_once("nanoserve", path, cache=tmp / "shape")  # the pool's size, for n_ctx
    context, pool = shape["max_model_len"], shape["kv_tokens"]
    runs = {  # name -> (engine, tokens, nanoserve's cache: "first" or "again"; None)
        "nanoserve first": ("nanoserve", 0, "first"),
        "nanoserve again": ("nanoserve", 0, "again"),
        f"nanoserve again, pool {context} tokens": ("nanoserve", context, "again"),
        "llama.cpp model only": ("llama.cpp", MODEL_ONLY, None),
        **{f"llama.cpp n_ctx={n}": ("llama.cpp", n, None)
           for n in sorted({LLAMA_DEFAULT_N_CTX, context, pool})},
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name, (engine, tokens, cache) in runs.items():
            # "first" meets an empty directory, the nanoserve loads after it the cache it left
            where = tmp / f"cache{r}" if cache else None
            times[name].append(load_once(engine, path, tokens, where)["seconds"])
    rows = {name: {"median_s": statistics.median(ts), "min_s": min(ts), "all_s": ts}
            for name, ts in times.items()}  # fmt: skip
    llama = rows[f"llama.cpp n_ctx={context}"]["median_s"]
    return {"file": path.name, "bytes": path.stat().st_size, **shape, "rows": rows,
            "first_over_llamacpp": rows["nanoserve first"]["median_s"] / llama,
            "again_over_llamacpp": rows["nanoserve again"]["median_s"] / llama,
            "same_pool_over_llamacpp":
                rows[f"nanoserve again, pool {context} tokens"]["median_s"] / llama}  # fmt: skip


def kquant_file(tmp: Path) -> Path:
    """SmolLM2 in Q4_K_M, as llama.cpp's converter and quantizer write it."""
    from nanoserve.testing.hf_families import smollm2_checkpoint
    from nanoserve.testing.llamacpp_convert import convert, fetch, quantize

    fetch()
    f16 = convert(smollm2_checkpoint(tmp / "smollm2"), tmp / "F16.gguf", "f16")
    return quantize(f16, tmp / "SmolLM2-135M-Instruct.Q4_K_M.gguf", "Q4_K_M")


def print_table(result: dict) -> None:
    print(f"\n{result['file']} ({result['bytes'] / 2**20:.0f} MiB; nanoserve's KV pool "
          f"{result['kv_tokens']} tokens, max_model_len {result['max_model_len']})")  # fmt: skip
    for name, row in result["rows"].items():
        print(f"  {name:36} median {row['median_s']:6.3f} s   fastest {row['min_s']:6.3f} s")
    print(
        f"  nanoserve / llama.cpp (n_ctx={result['max_model_len']}, medians): first load "
        f"{result['first_over_llamacpp']:.2f}x, again {result['again_over_llamacpp']:.2f}x, "
        f"pool of as many tokens {result['same_pool_over_llamacpp']:.2f}x"
    )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        names = list(result["rows"])
        medians = [result["rows"][n]["median_s"] for n in names]
        fastest = [result["rows"][n]["min_s"] for n in names]
        ax.barh(names, medians, color="tab:blue", label="median")
        ax.plot(fastest, names, "k|", markersize=14, label="fastest")
        ax.invert_yaxis()
        ax.set_xlabel("seconds to load")
        ax.set_title(result["file"], fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-kquants", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("ENGINE", "PATH", "TOKENS"))
    args = parser.parse_args()
    if args.child:
        engine, path, tokens = args.child
        print(json.dumps(child(engine, path, int(tokens))))
        return
    from nanoserve.default_model import default_model_path

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [default_model_path()]
        if not args.skip_kquants:
            files.append(kquant_file(Path(tmp)))
        for i, path in enumerate(files):
            results.append(bench_file(path, args.repeats, Path(tmp) / f"cache{i}"))
            print_table(results[-1])
    RESULTS.mkdir(exist_ok=True)
    out = {"cpu": cpu_model(), "repeats": args.repeats, "files": results}
    (RESULTS / "load.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, RESULTS / "load.png")


if __name__ == "__main__":
    main()
