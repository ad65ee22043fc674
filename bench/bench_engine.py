"""Offline throughput: nanoserve's LLM.generate beside transformers' generate on the same requests.

Workload (issue 2): a random Llama of about 25M parameters (hidden 512, 8 layers, 8 heads, 2 KV
heads, intermediate 1536, vocab 4096), 64 requests, prompts of 16-256 tokens, outputs of 16-128
tokens, greedy, EOS ignored. transformers runs them in static batches of 16 (left padded, each
batch generating to its longest request). Output tokens/s counts only the tokens each request asked
for. Prints a table and writes bench/results/engine_cpu.json.

    python bench/bench_engine.py [--skip-serial] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.demo import write_checkpoint

RESULTS = Path(__file__).parent / "results"
MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536,
             vocab_size=4096, max_position_embeddings=1024)  # fmt: skip


def workload(count: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(count):
        prompt_len = int(torch.randint(16, 257, (1,), generator=g))
        output_len = int(torch.randint(16, 129, (1,), generator=g))
        requests.append((torch.randint(0, 4096, (prompt_len,), generator=g).tolist(), output_len))
    return requests


def run_engine(model_dir: Path, requests, dtype: str, serial: bool = False) -> float:
    llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=64, max_num_batched_tokens=2048)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    if serial:
        for p, s in zip(prompts, params, strict=True):
            llm.generate([p], [s], use_tqdm=False)
    else:
        llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


@torch.inference_mode()
def run_transformers(model_dir: Path, requests, dtype: str, batch_size: int = 16) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    )
    model.eval()
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
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                       min_new_tokens=new, pad_token_id=0)  # fmt: skip
    return time.perf_counter() - start


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-serial", action="store_true")
    args = parser.parse_args()
    requests = workload()
    output_tokens = sum(n for _, n in requests)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "m", **MODEL)
        rows["nanoserve LLM.generate"] = run_engine(model_dir, requests, args.dtype)
        rows["transformers generate, batches of 16"] = run_transformers(
            model_dir, requests, args.dtype
        )
        if not args.skip_serial:
            rows["nanoserve, one request at a time"] = run_engine(
                model_dir, requests, args.dtype, serial=True
            )
    base = rows["transformers generate, batches of 16"]
    print(f"\n{len(requests)} requests, {output_tokens} output tokens, {args.dtype}")
    print(f"{'':40} {'seconds':>8} {'out tok/s':>10} {'vs transformers':>16}")
    for name, seconds in rows.items():
        print(f"{name:40} {seconds:8.2f} {output_tokens / seconds:10.1f} {base / seconds:15.2f}x")
    RESULTS.mkdir(exist_ok=True)
    result = {
        "machine": machine(),
        "dtype": args.dtype,
        "requests": len(requests),
        "output_tokens": output_tokens,
        "seconds": rows,
        "output_tokens_per_s": {k: output_tokens / v for k, v in rows.items()},
    }
    (RESULTS / f"engine_cpu_{args.dtype}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
