"""A mixture of experts with Qwen3-30B-A3B's or gpt-oss-20b's layer shapes, nanoserve and
llama.cpp on the same file, side by side in one run, on the machine it runs on.

The files (--family), each random, written by transformers (bfloat16) with 2 layers and SmolLM2's
vocabulary of 49152 (which llama.cpp's converter knows), converted to F16 by llama.cpp's converter
and quantized by its quantizer:
- qwen3moe: Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query and 4 KV heads of 128, 128
  experts of 768, top 8, norm_topk_prob; tied embeddings), Q4_K_M;
- gpt-oss: gpt-oss-20b's (hidden 2880, 64 query and 8 KV heads of 64, 32 experts of 2880, top 4,
  sliding and full layers, attention sinks, YaRN, biases), MXFP4_MOE (experts in MXFP4, the
  rest Q8_0), as gpt-oss ships.
Each is kept under the cache directory (NANOSERVE_CACHE/bench/moe-a3b, moe-gpt-oss-20b), so a
rerun skips the checkpoint.

Cases, as bench_context.py runs them (its engines' settings, both greedy, EOS ignored), the
best of --rounds rounds of them on each engine, nanoserve's rounds then llama.cpp's:
- one stream: a 32-token prompt, then 64 tokens, decode tokens per second;
- 8 sequences: 8 distinct 32-token prompts at once, decode tokens per second of the steps after
  every prompt is in (nanoserve's batch; llama.cpp's 8 KV streams in one llama_decode a step);
- pp512: one 512-token prompt, prompt tokens per second.
Recorded beside them: the CPU, its ISA flags, nanoserve's kernel path and threads, the resident
weight bytes against the file's tensor bytes, and the weight bytes one decode step reads (every
dense matrix, the router and the output projection, plus only the chosen experts' blocks: top 8
of 128 per layer for one stream, for 8 sequences the union the router chose, counted from its
routing in the 8-sequence run) against the measured read bandwidth: bytes / bandwidth is the
step's floor. Results: bench/results/moe_llamacpp.json (qwen3moe), moe_llamacpp_gpt_oss.json.

    python -m bench.bench_moe_llamacpp [--family qwen3moe|gpt-oss] [--rounds 3]
                                       [--skip-llamacpp] [--per-expert]

--per-expert also runs nanoserve's rounds again on the same engine with its experts' matmuls one
C call per chosen expert (sparse_moe's one_call=False, the path before kernels.expert_linear), so
that the two stand side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gguf
import torch
import transformers

from bench.bench_context import CASES as CONTEXT_CASES
from bench.bench_context import machine, nanoserve_case, prompts
from bench.bench_kquants import read_bandwidth
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.env import cache_dir
from nanoserve.kernels import QuantizedWeight
from nanoserve.model import gpt_oss, llama, moe
from nanoserve.testing.llamacpp_convert import (
    convert,
    fetch,
    quantize,
    smollm2_vocabulary,
    write_vocabulary,
)

RESULTS = Path(__file__).parent / "results"
CASES = ["short", "8x short", "pp512"]  # bench_context.CASES' names
QWEN3_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8,
                 norm_topk_prob=True, num_hidden_layers=2, intermediate_size=6144,
                 tie_word_embeddings=True, rope_theta=1e6)  # fmt: skip
GPT_OSS_20B = dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, intermediate_size=2880, num_experts_per_tok=4,
                   num_hidden_layers=2, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 4096})  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A benchmark file: its config class and shapes, the quantization, the cache folder, the
    routing function that chooses its experts (module, name: counted in union_of_experts), the
    results file."""

    name: str
    config: type
    shapes: dict
    quant: str
    folder: str
    router: tuple[object, str]
    results: str
    about: str

    @property
    def layers(self) -> int:
        return self.shapes["num_hidden_layers"]

    @property
    def top_k(self) -> int:
        return self.shapes["num_experts_per_tok"]

    @property
    def experts(self) -> int:
        return self.shapes.get("num_experts") or self.shapes["num_local_experts"]


FAMILIES = {
    "qwen3moe": Family("qwen3moe", transformers.Qwen3MoeConfig, QWEN3_A3B, "Q4_K_M", "moe-a3b",
                       (moe, "route_experts"), "moe_llamacpp.json", "random Qwen3-MoE, "
                       "Qwen3-30B-A3B's layer shapes, 2 layers, vocab 49152, Q4_K_M"),
    "gpt-oss": Family("gpt-oss", transformers.GptOssConfig, GPT_OSS_20B, "MXFP4_MOE",
                      "moe-gpt-oss-20b", (gpt_oss, "route"), "moe_llamacpp_gpt_oss.json",
                      "random gpt-oss, gpt-oss-20b's layer shapes, 2 layers, vocab 49152, "
                      "MXFP4_MOE"),
}  # fmt: skip


def family_file(family: Family) -> Path:
    """The family's file, made once under the cache directory."""
    folder = cache_dir() / "bench" / family.folder
    out = folder / f"{family.quant}.gguf"
    if out.is_file():
        return out

    fetch()
    vocab = smollm2_vocabulary()
    model_dir = folder / "hf"
    config = family.config(
        vocab_size=vocab.vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, **family.shapes,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        model_dir
    )
    write_vocabulary(model_dir, vocab)
    f16 = convert(model_dir, folder / "F16.gguf", "f16")
    partial = quantize(f16, folder / f"{family.quant}.partial", family.quant,
                       torch.get_num_threads())  # fmt: skip
    f16.unlink()  # the checkpoint and F16 file are not needed again
    for f in model_dir.iterdir():
        f.unlink()
    model_dir.rmdir()
    return partial.rename(out)


def weight_bytes(engine: Engine) -> tuple[int, int, int]:
    """(resident bytes of every weight, each storage once; the bytes a decode step reads besides
    the experts: every dense matrix, router, norm and the output projection; one expert's bytes
    in one layer: its gate, up and down blocks)."""
    w = engine.runner.model.weights
    seen: dict[int, int] = {}
    dense = expert = 0

    def held(t: object) -> int:
        t = t.data if isinstance(t, QuantizedWeight) else t
        if not isinstance(t, torch.Tensor):
            return 0
        size = t.numel() * t.element_size()
        seen[t.data_ptr() if t.layout == torch.strided else id(t)] = size
        return size

    for name, m in [("lm_head", w.lm_head), ("norm", w.norm), ("embed", w.embed)]:
        size = sum(held(t) for t in (getattr(m, "weight", m), getattr(m, "packed", None)))
        dense += 0 if name == "embed" else size
    for layer in w.layers:
        for m in vars(layer).values():
            if isinstance(m, moe.Experts):
                expert += held(m.weight) // m.num_experts
                for part in m.each:
                    held(part)  # views of the weight's bytes, or aligned copies
            elif m is not None:
                dense += sum(held(t) for t in (getattr(m, "weight", m), getattr(m, "packed", None)))
    return sum(seen.values()), dense, expert // len(w.layers)


def union_of_experts(engine: Engine, vocab: int, router: tuple[object, str]) -> float:
    """The mean count of distinct experts a layer's 8-token decode step chose, from the routing
    (`router`: a module and its routing function's name) of an 8-sequence run (untimed; its
    steps taken layer by layer, whose routing is the one-call C step's, bit for bit)."""
    counts: list[int] = []
    module, name = router
    route = getattr(module, name)
    step, engine.runner.cpu_step = engine.runner.cpu_step, None

    def counting(logits: torch.Tensor, *args):
        weights, experts = route(logits, *args)
        if logits.shape[0] == 8:
            counts.append(int(experts.unique().numel()))
        return weights, experts

    setattr(module, name, counting)
    try:
        nanoserve_case(engine, prompts(8, 32, vocab, 7), 16)
    finally:
        setattr(module, name, route)
        engine.runner.cpu_step = step
    return sum(counts) / len(counts)


class LlamaCpp:
    """llama.cpp on the file, loaded once, running bench_context's cases as its
    run_llamacpp does (8 KV streams; f16 KV cache, flash attention as llama.cpp decides)."""

    def __init__(self, path: Path, vocab: int, threads: int) -> None:
        import llama_cpp as lc

        from bench.llamacpp import _model_params

        lc.llama_backend_init()
        self.lc, self.vocab = lc, vocab
        self.model = lc.llama_model_load_from_file(str(path).encode(), _model_params())
        params = lc.llama_context_default_params()
        params.n_seq_max = 8
        params.n_ctx = 8 * 1024
        params.n_batch = 2048
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def case(self, batch_prompts: list[list[int]], out: int) -> tuple[float, int]:
        """(seconds, tokens) of the phase bench_context.nanoserve_case times."""
        from bench.llamacpp import _decode

        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        last = [_decode(self.ctx, self.batch, self.vocab, [(p, 0, s)])[0]
                for s, p in enumerate(batch_prompts)]  # fmt: skip
        if out == 1:
            return time.perf_counter() - start, sum(map(len, batch_prompts))
        start = time.perf_counter()
        positions = [len(p) for p in batch_prompts]
        for _ in range(out - 1):
            chunks = [([t], pos, s) for s, (t, pos) in enumerate(zip(last, positions, strict=True))]
            last = _decode(self.ctx, self.batch, self.vocab, chunks)
            positions = [pos + 1 for pos in positions]
        return time.perf_counter() - start, (out - 1) * len(batch_prompts)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def best_of(run, vocab: int, rounds: int) -> dict:
    """Each case's tokens per second through `run` (batch, out) -> (seconds, tokens): the best
    of `rounds` rounds of all the cases, after a warm-up, and every round's figure. The best, as
    read_bandwidth takes it: other work on the machine only ever slows a round down (one
    engine's round under a burst of it read 3x to 10x below its quiet rounds)."""
    for case in CASES:
        seqs, length, out = CONTEXT_CASES[case]
        run(prompts(1, length, vocab, 99), min(out, 4))
    figures: dict[str, list[float]] = {case: [] for case in CASES}
    for r in range(rounds):
        for seed, case in enumerate(CASES):
            seqs, length, out = CONTEXT_CASES[case]
            seconds, n = run(prompts(seqs, length, vocab, seed + 10 * r), out)
            figures[case].append(n / seconds)
    return {case: max(f) for case, f in figures.items()} | {"rounds": figures}


def per_expert(engine: Engine, vocab: int, rounds: int) -> dict:
    """best_of with the model's MoE blocks making one C call per chosen expert."""
    one_call = llama.sparse_moe
    llama.sparse_moe = partial(moe.sparse_moe, one_call=False)
    try:
        return best_of(partial(nanoserve_case, engine), vocab, rounds)
    finally:
        llama.sparse_moe = one_call


def side_by_side(
    path: Path, vocab: int, threads: int, rounds: int, skip: bool, router, old: bool = False
) -> dict:
    """nanoserve's figures, weight bytes and routing, then llama.cpp's figures, one engine loaded
    at a time: with both loaded in one process and alternating, nanoserve ran at a third of its
    speed (llama.cpp's threads, which spin a while after each of its steps, are the likely cause;
    not measured apart)."""
    config = EngineConfig(max_model_len=1024, num_kv_blocks=256, enable_prefix_caching=False,
                          max_num_seqs=8)  # fmt: skip
    engine = Engine(path, config)
    ours = best_of(partial(nanoserve_case, engine), vocab, rounds)
    if old:
        ours["per_expert"] = per_expert(engine, vocab, rounds)
    resident, dense, expert = weight_bytes(engine)
    ours |= {"resident": resident, "dense_step_bytes": dense, "expert_bytes": expert,
             "experts_chosen_8x": union_of_experts(engine, vocab, router)}  # fmt: skip
    engine.close()
    if skip:
        return {"nanoserve": ours, "llamacpp": {}}
    theirs = LlamaCpp(path, vocab, threads)
    try:
        return {"nanoserve": ours, "llamacpp": best_of(theirs.case, vocab, rounds)}
    finally:
        theirs.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3moe", choices=sorted(FAMILIES))
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-expert", action="store_true", help="also the per-expert calls")
    args = parser.parse_args()
    info = machine() | {"bandwidth_gb_s": read_bandwidth(), "load_average": os.getloadavg()}
    print(json.dumps(info), flush=True)
    start = time.perf_counter()
    family = FAMILIES[args.family]
    path = family_file(family)
    print(f"file: {path} ({time.perf_counter() - start:.0f} s)", flush=True)
    reader = gguf.GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    formats = sorted({f"{t.name.split('.', 2)[-1]}: {t.tensor_type.name}" for t in reader.tensors})
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    both = side_by_side(
        path, vocab, info["threads"], args.rounds, args.skip_llamacpp, family.router,
        args.per_expert,
    )  # fmt: skip
    ns, lc = both["nanoserve"], both["llamacpp"]
    layers, top_k = family.layers, family.top_k
    step = {
        "1 stream": ns["dense_step_bytes"] + layers * top_k * ns["expert_bytes"],
        "8 sequences": ns["dense_step_bytes"]
        + layers * ns["experts_chosen_8x"] * ns["expert_bytes"],
    }
    floor_ms = {k: v / (info["bandwidth_gb_s"] * 1e9) * 1e3 for k, v in step.items()}
    result = info | {
        "file": family.about,
        "file_bytes": file_bytes, "formats": formats, "nanoserve": ns, "llamacpp": lc,
        "resident_over_file": ns["resident"] / file_bytes, "step_bytes": step,
        "step_floor_ms": floor_ms,
    }  # fmt: skip
    print(f"file {file_bytes / 2**20:.1f} MiB, resident {ns['resident'] / 2**20:.1f} MiB "
          f"({ns['resident'] / file_bytes:.3f}x); experts chosen by 8 tokens a layer: "
          f"{ns['experts_chosen_8x']:.1f} of {family.experts}")  # fmt: skip
    for case, (label, key) in zip(CASES, [("1 stream", "1 stream"), ("8 sequences", "8 sequences"),
                                          ("pp512", None)], strict=True):  # fmt: skip
        theirs = f"llama.cpp {lc[case]:8.1f}   {ns[case] / lc[case]:5.2f}x" if case in lc else ""
        floor = (f"  step reads {step[key] / 2**20:.1f} MiB, floor {floor_ms[key]:.2f} ms"
                 if key else "")  # fmt: skip
        print(f"  {label:12} nanoserve {ns[case]:8.1f} tok/s   {theirs}{floor}", flush=True)
        if "per_expert" in ns:
            old = ns["per_expert"][case]
            print(f"  {'':12} per expert {old:7.1f} tok/s   one call / per expert "
                  f"{ns[case] / old:5.2f}x", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / family.results).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
