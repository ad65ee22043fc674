"""Offline throughput: nanoserve's LLM.generate beside transformers' generate on the same requests.

Model: a random Llama of about 25M parameters (hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1536, vocab 4096). Workloads, greedy with EOS ignored: "uniform" (issue 2: 64
requests, prompts of 16-256 tokens, outputs of 16-128) and "chat" (conversations sharing a system
prompt, each turn's prompt extending the last; see chat_workload). transformers runs the requests
in static batches of 16 (left padded, each batch generating to its longest request); llama.cpp
(when llama-cpp-python is installed; float32 only) decodes them all in one batch on the same
checkpoint converted to GGUF f32 (bench/llamacpp.py). Output tokens/s counts only the tokens each
request asked for. Prints tables and writes bench/results/engine_<device>_<shape>_<dtype>.json,
with the floors the machine sets (see floors).

    python -m bench.bench_engine [--skip-serial] [--skip-llamacpp] [--dtype float32|bfloat16]
    python -m bench.bench_engine --device cuda --shape 1b --requests 256 --dtype bfloat16 \
        --skip-serial --out DIR          # the GPU run of bench/gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from bench.workloads import SHAPES, chat_workload, workload
from nanoserve import LLM, SamplingParams
from nanoserve.demo import write_checkpoint
from nanoserve.model.linear import Linear

RESULTS = Path(__file__).parent / "results"


def run_engine(model_dir: Path, requests, dtype: str, device: str, serial: bool = False) -> float:
    seqs = 256 if device == "cuda" else 64
    tokens = 8192 if device == "cuda" else 2048
    llm = LLM(
        str(model_dir), dtype=dtype, device=device, max_num_seqs=seqs, max_num_batched_tokens=tokens
    )
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    if serial:
        for p, s in zip(prompts, params, strict=True):
            llm.generate([p], [s], use_tqdm=False)
    else:
        llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run_transformers(
    model_dir: Path,
    requests,
    dtype: str,
    device: str,
    batch_size: int,
    gguf_file: str | None = None,
) -> float:
    """Seconds transformers takes for `requests` in static batches of `batch_size` (left padded),
    from a checkpoint directory or a GGUF file in it (de-quantized by transformers)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), gguf_file=gguf_file
    )
    model.to(device).eval()
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(n for _, n in batch)
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
    _sync(device)
    return time.perf_counter() - start


def floors(model_dir: Path, requests, dtype: str) -> dict:
    """What the machine allows: a batch-1 decode step against weight bytes / read bandwidth, the
    workload's matmul FLOPs against the measured matmul rate, and the engine's own Python share
    of a batch-32 decode step (the step with the model replaced by ready-made logits).

    This machine's memory bandwidth drifts by tens of percent from one second to the next, so the
    batch-1 step is timed in rounds, each right after its own bandwidth measurement, and the
    ratio is given per round (median) as well as best step over best bandwidth."""
    torch_dtype = getattr(torch, dtype)
    big = torch.ones(2**27)  # 512 MiB, far past the caches
    a = torch.randn(2048, 2048, dtype=torch_dtype)
    packed = Linear(a)  # the engine's own matmul (oneDNN, prepacked); the faster of it and MKL
    matmul = 2 * 2048**3 / min(_best(lambda: a @ a), _best(lambda: packed(a)))
    llm = LLM(str(model_dir), dtype=dtype)
    engine, c = llm.engine, llm.engine.model_config
    weights = engine.runner.model.weights.layers
    tensors = [getattr(w, "weight", w) for layer in weights for w in vars(layer).values()
               if w is not None]  # a family's options the model lacks are None  # fmt: skip
    layer_params = sum(t.numel() for t in tensors)  # a Linear's .weight, or a norm's tensor
    head_params = c.vocab_size * c.hidden_size
    weight_bytes = (layer_params + head_params) * torch_dtype.itemsize
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    flops = 2 * layer_params * (prompt_tokens + output_tokens) + 2 * head_params * output_tokens
    bandwidths: list[float] = []  # bytes/s, one per round
    step1 = _decode_rounds(
        engine, 1, before_each=lambda: bandwidths.append(len(big) * 4 / _best(big.sum, 3))
    )
    pairs = zip(step1, bandwidths, strict=True)
    ratios = sorted(ms / (weight_bytes / bw * 1e3) for ms, bw in pairs)
    step32 = min(_decode_rounds(engine, 32))
    logits = torch.zeros(32, c.vocab_size)
    engine.runner.prepare = lambda batch: batch  # no packing, no forward pass
    engine.runner.execute = lambda batch: (logits[: len(batch)], {})
    python32 = min(_decode_rounds(engine, 32))
    return {
        "read_bandwidth_gb_s": max(bandwidths) / 1e9,
        "matmul_gflop_s": matmul / 1e9,
        "weight_bytes": weight_bytes,
        "batch1_step_ms": min(step1),
        "batch1_floor_ms": weight_bytes / max(bandwidths) * 1e3,
        "batch1_rounds": [
            {"step_ms": ms, "read_bandwidth_gb_s": bw / 1e9}
            for ms, bw in zip(step1, bandwidths, strict=True)
        ],
        "batch1_over_floor_median": ratios[len(ratios) // 2],
        "workload_matmul_gflop": flops / 1e9,
        "workload_floor_s": flops / matmul,
        "batch32_step_ms": step32,
        "batch32_engine_python_ms": python32,
    }


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _decode_rounds(
    engine, batch: int, steps: int = 20, rounds: int = 7, before_each=None
) -> list[float]:
    """Average milliseconds of a decode step of `batch` sequences in each of `rounds` rounds of
    `steps` steps; `before_each()` runs before each round, outside the timing."""
    params = SamplingParams(temperature=0, max_tokens=steps * rounds + 5, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"floor-{batch}-{i}", list(range(1, 129)), params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # warm-up
    averages = []
    for _ in range(rounds):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        averages.append((time.perf_counter() - start) / steps * 1e3)
    for i in range(batch):
        engine.abort(f"floor-{batch}-{i}")
    return averages


def machine() -> dict:
    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__, "gpu": gpu}


def run_workload(model_dir: Path, requests, args, serial: bool) -> dict:
    """Every system on one workload: seconds and output tokens/s per row, printed as a table."""
    rows = {"nanoserve LLM.generate": run_engine(model_dir, requests, args.dtype, args.device)}
    hf = f"transformers generate, batches of {args.hf_batch}"
    rows[hf] = run_transformers(model_dir, requests, args.dtype, args.device, args.hf_batch)
    if args.device == "cpu" and args.dtype == "float32" and not args.skip_llamacpp:
        try:
            from bench.llamacpp import run_llamacpp
        except ImportError as e:
            print(f"llama.cpp column skipped: {e} (pip install llama-cpp-python gguf)")
        else:
            threads = torch.get_num_threads()
            rows["llama.cpp f32, one batch"] = run_llamacpp(model_dir, requests, threads)
    if serial:
        rows["nanoserve, one request at a time"] = run_engine(
            model_dir, requests, args.dtype, args.device, serial=True
        )
    output_tokens = sum(n for _, n in requests)
    base = rows[hf]
    print(f"{'':40} {'seconds':>8} {'out tok/s':>10} {'vs transformers':>16}")
    for name, seconds in rows.items():
        print(f"{name:40} {seconds:8.2f} {output_tokens / seconds:10.1f} {base / seconds:15.2f}x")
    return {
        "requests": len(requests),
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": output_tokens,
        "seconds": rows,
        "output_tokens_per_s": {k: output_tokens / v for k, v in rows.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="25m", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-serial", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    workloads = {
        "uniform": workload(args.requests, vocab=shape["vocab_size"]),
        "chat": chat_workload(vocab=shape["vocab_size"]),
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "m", dtype=args.dtype, **shape)
        for name, requests in workloads.items():
            prompt_tokens = sum(len(p) for p, _ in requests)
            output_tokens = sum(n for _, n in requests)
            print(
                f"\n{name} workload: {len(requests)} requests, {prompt_tokens} prompt and "
                f"{output_tokens} output tokens, {args.shape} {args.dtype}"
            )
            serial = name == "uniform" and not args.skip_serial
            results[name] = run_workload(model_dir, requests, args, serial)
        limits = {}
        if args.device == "cpu":
            limits = floors(model_dir, workloads["uniform"], args.dtype)
    if limits:
        ceiling = results["uniform"]["output_tokens"] / limits["workload_floor_s"]
        print(
            f"\nfloor of the uniform workload by matmul FLOPs ({limits['matmul_gflop_s']:.0f} "
            f"GFLOP/s measured): {limits['workload_floor_s']:.2f} s, {ceiling:.0f} out tok/s"
        )
        print(
            f"batch-1 decode step {limits['batch1_step_ms']:.2f} ms; floor "
            f"{limits['batch1_floor_ms']:.2f} ms ({limits['weight_bytes'] / 1e6:.0f} MB of weights "
            f"at {limits['read_bandwidth_gb_s']:.1f} GB/s read): "
            f"{limits['batch1_step_ms'] / limits['batch1_floor_ms']:.2f}x the floor (best over "
            f"best); {limits['batch1_over_floor_median']:.2f}x (median of rounds each timed right "
            "after its own bandwidth measurement)"
        )
        print(
            f"batch-32 decode step {limits['batch32_step_ms']:.2f} ms, of which the engine's own "
            f"Python {limits['batch32_engine_python_ms']:.2f} ms "
            f"({limits['batch32_engine_python_ms'] / limits['batch32_step_ms']:.1%})"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "floors": limits,
        "machine": machine(),
        "device": args.device,
        "shape": args.shape,
        "dtype": args.dtype,
        "workloads": results,
    }
    name = f"engine_{args.device}_{args.shape}_{args.dtype}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
