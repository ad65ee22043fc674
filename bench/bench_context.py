"""Long contexts and prompt processing: nanoserve and llama.cpp on the same GGUF files, side by
side in one run, on the machine it runs on.

Each file is measured by both engines, one case after the other:
- pp512, pp4096: one prompt of that many tokens, prompt tokens per second (to its first token);
- decode at depth 4096 and 8192: one sequence whose context reaches the depth over its last 32
  tokens, decode tokens per second;
- 8 sequences at depth 4096 (distinct prompts), decode tokens per second of the steps after every
  prompt is in;
- short prompts (32 tokens), 64 tokens each: one stream, and 8 at once.
Both engines run greedy, EOS ignored, their default KV cache (nanoserve's auto: float16 for GGUF
blocks; llama.cpp's f16, flash attention as it decides), the same thread count, no prefix reuse.
Only the forward passes are timed, after a warm-up; loading is bench/bench_load.py's.

The files: SmolLM2-135M Q4_K_M and a random Llama with Llama-3.2-1B's layer shapes (4 layers)
Q4_K_M, both made by llama.cpp's converter and quantizer (as bench_kquants.py makes them), and
the default model (SmolLM2-135M-Instruct Q4_1). Results: bench/results/context.json, with the
CPU's model and flags, the kernel path nanoserve took and the KV bytes a decode step reads.

    python -m bench.bench_context [--files smollm2,llama1b,default] [--cases pp512,...] [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_kquants import llama1b_checkpoint, make_files, read_bandwidth
from bench.machine import cpu_model
from nanoserve.config import EngineConfig
from nanoserve.default_model import default_model_path
from nanoserve.engine import Engine, SamplingParams
from nanoserve.testing.hf_families import smollm2_checkpoint

RESULTS = Path(__file__).parent / "results"
# Wall-clock; --cpu-time: one thread each, timed by this process's CPU time, which holds up where
# other work shares the cores (the engines run in this process one after the other).
CLOCK = time.perf_counter
# name: (sequences, prompt tokens, output tokens); pp cases report prompt tokens per second.
CASES = {
    "pp512": (1, 512, 1),
    "pp4096": (1, 4096, 1),
    "decode@4096": (1, 4096 - 32, 32),
    "decode@8192": (1, 8192 - 32, 32),
    "8x decode@4096": (8, 4096 - 32, 32),
    "short": (1, 32, 64),
    "8x short": (8, 32, 64),
}


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (no two share a prefix block), clear of the lowest ids (control
    tokens in most vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(count)]


def nanoserve_case(engine: Engine, batch: list[list[int]], out: int) -> tuple[float, int]:
    """(seconds, tokens) of the phase the case measures: every prompt up to its first token when
    out == 1 (prompt tokens), else the decode steps after every sequence has its first token
    (output tokens made in them)."""
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    made = dict.fromkeys(range(len(batch)), 0)
    start, decode_start, decoded = CLOCK(), None, 0
    while engine.has_unfinished():
        for o in engine.step():
            i = int(o.request_id[1:])
            new = len(o.outputs[0].token_ids) - made[i]
            made[i] += new
            if decode_start is not None:
                decoded += new
        if decode_start is None and all(made.values()):
            if out == 1:
                return CLOCK() - start, sum(map(len, batch))
            decode_start = CLOCK()
    assert decode_start is not None
    return CLOCK() - decode_start, decoded


def run_nanoserve(path: Path, cases: list[str], vocab: int, kv: str) -> dict:
    longest = max(CASES[c][1] + CASES[c][2] for c in cases)
    tokens = max(CASES[c][0] * (CASES[c][1] + CASES[c][2] + 32) for c in cases)
    config = EngineConfig(
        max_model_len=longest, num_kv_blocks=tokens // 16 + 64, enable_prefix_caching=False,
        max_num_seqs=8, kv_cache_dtype=kv,
    )  # fmt: skip
    engine = Engine(path, config)
    nanoserve_case(engine, prompts(1, 64, vocab, 99), 4)  # warm-up
    results = {}
    for seed, case in enumerate(cases):
        seqs, length, out = CASES[case]
        seconds, n = nanoserve_case(engine, prompts(seqs, length, vocab, seed), out)
        results[case] = n / seconds
    results["kv_cache_dtype"] = engine.config.kv_cache_dtype
    results["kv_bytes_per_token"] = engine.runner.block_bytes // engine.config.block_size
    engine.close()
    return results


def run_llamacpp(path: Path, cases: list[str], vocab: int, threads: int) -> dict:
    import llama_cpp as lc

    from bench.llamacpp import _decode, _model_params

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), _model_params())
    params = lc.llama_context_default_params()
    params.n_seq_max = 8
    longest = max(CASES[c][1] + CASES[c][2] for c in cases)
    params.n_ctx = 8 * (-(-longest // 256) * 256)
    params.n_batch = 2048
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    memory = lc.llama_get_memory(ctx)

    def run(batch_prompts: list[list[int]], out: int) -> tuple[float, int]:
        lc.llama_memory_clear(memory, True)
        start = CLOCK()
        last = []
        for s, p in enumerate(batch_prompts):
            for a in range(0, len(p), params.n_batch):
                chunk = p[a : a + params.n_batch]
                token = _decode(ctx, batch, vocab, [(chunk, a, s)])
            last.append(token[0])
        if out == 1:
            return CLOCK() - start, sum(map(len, batch_prompts))
        start = CLOCK()
        positions = [len(p) for p in batch_prompts]
        for _ in range(out - 1):
            chunks = [([t], pos, s) for s, (t, pos) in enumerate(zip(last, positions, strict=True))]
            last = _decode(ctx, batch, vocab, chunks)
            positions = [pos + 1 for pos in positions]
        return CLOCK() - start, (out - 1) * len(batch_prompts)

    try:
        run(prompts(1, 64, vocab, 99), 4)  # warm-up
        results = {}
        for seed, case in enumerate(cases):
            seqs, length, out = CASES[case]
            seconds, n = run(prompts(seqs, length, vocab, seed), out)
            results[case] = n / seconds
        return results
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def files(names: list[str], tmp: Path) -> dict[str, Path]:
    out = {}
    for folder in ("sq", "lq"):
        (tmp / folder).mkdir()
    if "smollm2" in names:
        out["smollm2 Q4_K_M"] = make_files(smollm2_checkpoint(tmp / "s"), tmp / "sq", ["Q4_K_M"])
    if "llama1b" in names:
        model = llama1b_checkpoint(tmp / "l", 4, positions=8192)
        out["llama1b (4 layers) Q4_K_M"] = make_files(model, tmp / "lq", ["Q4_K_M"])
    if "default" in names:
        out["default Q4_1"] = {"Q4_1": default_model_path()}
    return {name: next(iter(f.values())) for name, f in out.items()}


def machine() -> dict:
    from nanoserve.kernels.quant import cpu_isa, uses_amx, uses_vnni

    flags = Path("/proc/cpuinfo").read_text().split("flags\t\t: ", 1)[-1].split("\n", 1)[0]
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "f16c")
    path = cpu_isa() + (" + VNNI" if uses_vnni() else "") + (" + AMX GEMM" if uses_amx() else "")
    return {"cpu": cpu_model(), "flags": [f for f in wanted if f in flags.split()],
            "kernel_path": path, "threads": torch.get_num_threads()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", default="smollm2,llama1b,default")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--kv-cache-dtype", default="auto", help="nanoserve's")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--cpu-time", action="store_true", help="one thread each, CPU time")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
        torch.set_num_threads(1)
    cases = args.cases.split(",")
    info = machine() | {"bandwidth_gb_s": read_bandwidth()}
    print(json.dumps(info), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in files(args.files.split(","), Path(tmp)).items():
            vocab = _vocab(path)
            row = {
                "file": name,
                "nanoserve": run_nanoserve(path, cases, vocab, args.kv_cache_dtype),
            }
            if not args.skip_llamacpp:
                row["llamacpp"] = run_llamacpp(path, cases, vocab, info["threads"])
            rows.append(row)
            _print(row, cases)
    RESULTS.mkdir(exist_ok=True)
    name = "context_cpu_time.json" if args.cpu_time else "context.json"
    info["clock"] = "process_time" if args.cpu_time else "wall"
    (RESULTS / name).write_text(json.dumps(info | {"rows": rows}, indent=2) + "\n")


def _vocab(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(path)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _print(row: dict, cases: list[str]) -> None:
    ns, lc = row["nanoserve"], row.get("llamacpp", {})
    print(f"{row['file']} (KV {ns['kv_cache_dtype']}, {ns['kv_bytes_per_token']} B/token)")
    for case in cases:
        theirs = f"{lc[case]:8.1f}   {ns[case] / lc[case]:5.2f}x" if case in lc else ""
        print(f"  {case:15} nanoserve {ns[case]:8.1f}   llama.cpp {theirs}", flush=True)


if __name__ == "__main__":
    main()
