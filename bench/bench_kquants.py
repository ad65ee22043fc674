"""GGUF files as llama.cpp makes them, in its common quantizations, served by nanoserve and by
llama.cpp: for each file the formats nanoserve kept (the rest it de-quantized to float32), the
resident weights against the file's tensor bytes, the load time, one-stream and batched decode
throughput, and the weight bytes a decode step reads against the machine's measured read
bandwidth.

The files: llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist,
nanoserve.testing.llamacpp_convert) writes an F16 GGUF of each model, and llama.cpp's quantizer
(llama_cpp.llama_model_quantize) makes Q4_K_M, Q5_K_M, Q6_K and Q8_0 from it. The models:
SmolLM2-135M (its float checkpoint made by transformers from the default model's Q4_1 GGUF, so
the values are Q4_1's) and a random Llama with Llama-3.2-1B's layer shapes (hidden 2048, 32 heads,
8 KV heads, MLP 8192; SmolLM2's tokenizer; --layers of them).

    python -m bench.bench_kquants [--models smollm2,llama1b] [--quants F16,Q8_0,...]
        [--layers 2] [--tokens 32] [--batch 8] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import gguf
import torch
import transformers

from bench.machine import cpu_model
from nanoserve import LLM, SamplingParams
from nanoserve.default_model import default_model_path
from nanoserve.kernels import QuantizedParts, QuantizedWeight
from nanoserve.testing.hf_families import smollm2_checkpoint
from nanoserve.testing.llamacpp_convert import convert, quantize

RESULTS = Path(__file__).parent / "results"
QUANTS = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")


def llama1b_checkpoint(out: Path, layers: int, positions: int = 2048) -> Path:
    """A random Llama with Llama-3.2-1B's layer shapes and SmolLM2's tokenizer, of `positions`
    positions."""
    gguf_path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=positions, tie_word_embeddings=True,
        rope_theta=500000.0, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_files(model_dir: Path, out: Path, quants: list[str]) -> dict[str, Path]:
    """The model as llama.cpp writes it: F16 by its converter, the rest by its quantizer."""
    f16 = convert(model_dir, out / "F16.gguf", "f16")
    threads = torch.get_num_threads()
    return {q: f16 if q == "F16" else quantize(f16, out / f"{q}.gguf", q, threads) for q in quants}


def file_formats(path: Path) -> tuple[int, dict[str, int]]:
    """The file's tensor bytes, and its matrices' count per format."""
    reader = gguf.GGUFReader(path)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return sum(int(t.n_bytes) for t in reader.tensors), counts


def resident(llm: LLM) -> tuple[int, int, dict[str, int]]:
    """(bytes of all weights, bytes a decode step reads: every matrix, the output projection
    included, not the embedding but the rows it looks up, count of matrices per kept format, a
    fused matrix of parts in different formats counting each part)."""
    w = llm.engine.runner.model.weights

    def tensors(t: object) -> list[torch.Tensor]:
        if isinstance(t, QuantizedParts):
            return [p.data for p in t.parts]
        data = t.data if isinstance(t, QuantizedWeight) else t
        assert isinstance(data, torch.Tensor)
        return [data]

    def size(ts: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    matrices = [m.weight for x in w.layers for m in (x.qkv, x.o, x.gate_up, x.down)]
    matrices.append(w.lm_head.weight)
    kept: dict[str, int] = {}
    for m in matrices:
        for part in m.parts if isinstance(m, QuantizedParts) else (m,):
            key = part.qtype if isinstance(part, QuantizedWeight) else f"float ({part.dtype})"
            kept[key] = kept.get(key, 0) + 1
    step = sum(size(tensors(m)) for m in {id(m): m for m in matrices}.values())
    seen = {t.data_ptr(): size([t]) for m in [w.embed, *matrices] for t in tensors(m)}
    return sum(seen.values()), step, kept


def read_bandwidth() -> float:
    """GB/s of a sum over 512 MiB of float32 (the threads torch uses): memory's read speed."""
    x = torch.ones(128 << 20)
    x.sum()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def requests(count: int, tokens: int) -> list[tuple[list[int], int]]:
    return [(list(range(100 + 7 * i, 132 + 7 * i)), tokens) for i in range(count)]


def bench_nanoserve(path: Path, reqs, batch: int) -> dict:
    """first_load_s: LLM() on a file never opened, which reads its header and builds its
    tokenizer into an index under the cache directory; load_s: LLM() again, from that index."""
    start = time.perf_counter()
    llm = LLM(str(path), dtype="float32")
    first = time.perf_counter() - start
    del llm
    gc.collect()
    start = time.perf_counter()
    llm = LLM(str(path), dtype="float32")
    load = time.perf_counter() - start
    total, step, kept = resident(llm)

    def run(rs) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in rs]
        prompts = [{"prompt_token_ids": p} for p, _ in rs]
        begin = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - begin

    run(reqs[:1])  # warm-up
    one = reqs[0][1] / run(reqs[:1])
    batched = sum(n for _, n in reqs[:batch]) / run(reqs[:batch])
    return {"first_load_s": first, "load_s": load, "resident": total, "step_bytes": step,
            "kept": kept, "one_tok_s": one, "batched_tok_s": batched}  # fmt: skip


def bench_llamacpp(path: Path, reqs, batch: int, threads: int) -> dict:
    import llama_cpp as lc

    from bench.llamacpp import _model_params, generate

    lc.llama_backend_init()
    start = time.perf_counter()
    model = lc.llama_model_load_from_file(str(path).encode(), _model_params())
    load = time.perf_counter() - start
    size = lc.llama_model_size(model)
    lc.llama_model_free(model)
    one = reqs[0][1] / generate(path, reqs[:1], threads, exact=False)[0]
    batched = (
        sum(n for _, n in reqs[:batch]) / generate(path, reqs[:batch], threads, exact=False)[0]
    )
    return {"load_s": load, "resident": size, "one_tok_s": one, "batched_tok_s": batched}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,llama1b")
    parser.add_argument("--quants", default=",".join(QUANTS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-llamacpp", action="store_true")
    args = parser.parse_args()
    quants = args.quants.split(",")
    reqs = requests(args.batch, args.tokens)
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            model_dir = Path(tmp) / model
            if model == "smollm2":
                smollm2_checkpoint(model_dir)
            else:
                llama1b_checkpoint(model_dir, args.layers)
            for quant, path in make_files(model_dir, Path(tmp), quants).items():
                file_bytes, formats = file_formats(path)
                ns = bench_nanoserve(path, reqs, args.batch)
                row = {"model": model, "file": quant, "file_bytes": file_bytes,
                       "file_formats": formats, "nanoserve": ns}  # fmt: skip
                used = ns["step_bytes"] * ns["one_tok_s"] / 1e9
                print(f"{model:8} {quant:7} file {file_bytes / 2**20:7.1f} MiB {formats}\n"
                      f"  nanoserve: kept {ns['kept']}, resident {ns['resident'] / 2**20:7.1f} "
                      f"MiB, load {ns['load_s']:5.2f} s (first {ns['first_load_s']:4.2f}), "
                      f"one stream {ns['one_tok_s']:6.1f} tok/s, "
                      f"batched {ns['batched_tok_s']:6.1f} tok/s, "
                      f"{ns['step_bytes'] / 2**20:.1f} MiB a step = {used:.1f} GB/s "
                      f"({100 * used / bandwidth:.0f}% of read bandwidth)", flush=True)  # fmt: skip
                if not args.skip_llamacpp:
                    lc = bench_llamacpp(path, reqs, args.batch, args.threads)
                    row["llamacpp"] = lc
                    print(f"  llama.cpp: resident {lc['resident'] / 2**20:7.1f} MiB, load "
                          f"{lc['load_s']:5.2f} s, one stream {lc['one_tok_s']:6.1f} tok/s, "
                          f"batched {lc['batched_tok_s']:6.1f} tok/s", flush=True)  # fmt: skip
                rows.append(row)
                path.unlink()
    RESULTS.mkdir(exist_ok=True)
    out = {"cpu": cpu_model(), "threads": args.threads, "bandwidth_gb_s": bandwidth,
           "tokens": args.tokens, "batch": args.batch, "rows": rows}  # fmt: skip
    (RESULTS / "kquants.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
