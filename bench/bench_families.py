"""Each family nanoserve runs, on one random checkpoint of the same size per family (SmolLM2-135M's
shapes: hidden 576, 9/3 heads, MLP 1536; a few layers), float32 on the CPU: offline throughput
batched and one stream for nanoserve and for transformers, the decode path nanoserve takes, and
whether the greedy ids are transformers' own. One run, side by side.

    python -m bench.bench_families [--layers 4] [--requests 16] [--serial 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_engine import run_transformers
from bench.machine import cpu_model
from bench.workloads import workload
from nanoserve import LLM, SamplingParams
from nanoserve.testing.hf_families import write_family_checkpoint

RESULTS = Path(__file__).parent / "results"
SIZES = dict(
    vocab_size=4096, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
    num_key_value_heads=3, bos_token_id=4093, eos_token_id=4094,
)  # fmt: skip
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=64)),
    "gemma3": ("gemma3_text", dict(head_dim=64, sliding_window=64)),
}


def run_ours(model_dir: Path, requests, serial: bool) -> tuple[float, list[list[int]], str]:
    llm = LLM(str(model_dir))
    path = "one-call C step" if llm.engine.runner.cpu_step is not None else "layer by layer"
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    if serial:
        outs = [
            llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(prompts, params, strict=True)
        ]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.close()
    return seconds, [list(o.outputs[0].token_ids) for o in outs], path


@torch.inference_mode()
def reference_ids(model_dir: Path, requests) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for prompt, n in requests:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, pad_token_id=0, eos_token_id=None)  # fmt: skip
        out.append(gen[0, len(prompt) :].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--serial", type=int, default=2, help="requests run one at a time")
    args = parser.parse_args()
    requests = workload(args.requests, vocab=4000, prompts=(16, 128), outputs=(16, 64))
    serial = requests[: args.serial]
    results = {}
    head = f"{'family':10} {'path':16} {'greedy = HF':>11}"
    print(f"{head} {'batched tok/s':>22} {'one stream tok/s':>22}")
    print(f"{'':10} {'':16} {'':>11} {'ours':>11}{'HF':>11} {'ours':>11}{'HF':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, extra) in FAMILIES.items():
            model_dir = write_family_checkpoint(
                Path(tmp) / name, family, num_hidden_layers=args.layers, **SIZES, **extra
            )
            tokens = sum(n for _, n in requests)
            ours_s, ids, path = run_ours(model_dir, requests, serial=False)
            hf_s = run_transformers(model_dir, requests, "float32", "cpu", batch_size=len(requests))
            one_s, _, _ = run_ours(model_dir, serial, serial=True)
            hf_one_s = run_transformers(model_dir, serial, "float32", "cpu", batch_size=1)
            same = ids[: len(serial)] == reference_ids(model_dir, serial)
            one_tokens = sum(n for _, n in serial)
            row = {
                "path": path,
                "greedy_equal_transformers": same,
                "batched_tok_s": {"nanoserve": tokens / ours_s, "transformers": tokens / hf_s},
                "one_stream_tok_s": {
                    "nanoserve": one_tokens / one_s, "transformers": one_tokens / hf_one_s,
                },
            }  # fmt: skip
            results[name] = row
            print(
                f"{name:10} {path:16} {str(same):>11} {tokens / ours_s:11.1f}{tokens / hf_s:11.1f} "
                f"{one_tokens / one_s:11.1f}{one_tokens / hf_one_s:11.1f}"
            )
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": cpu_model(), "layers": args.layers, "sizes": SIZES, "families": results}
    (RESULTS / "families.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
