"""Structured outputs on the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF): what a
grammar costs.

- compile: seconds to compile typical constraints (the first includes building llguidance's view
  of the vocabulary), and a cache hit;
- mask: per step of a batch of constrained requests, the time spent filling and applying the
  token masks (EngineStats.mask_seconds), against the whole step;
- throughput: the same concurrent chat requests with a JSON schema and without one (output
  tokens per second), greedy, in one process, alternating to share the machine's noise.

    python -m bench.bench_structured [--requests 16] [--batch 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.machine import cpu_model
from nanoserve import LLM, SamplingParams
from nanoserve.default_model import default_model_path
from nanoserve.engine import StructuredOutputsParams

RESULTS = Path(__file__).parent / "results"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}  # fmt: skip
CONSTRAINTS = {
    "person schema": StructuredOutputsParams(json=PERSON),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex (date)": StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
}
PROMPT = "Invent a person and describe them as JSON with name, age, email, tags and address."


def compile_times(llm: LLM) -> dict[str, float]:
    grammars = llm.engine.grammars
    times = {}
    for name, constraint in CONSTRAINTS.items():
        start = time.perf_counter()
        grammars.compile(constraint)
        times[name] = time.perf_counter() - start
    start = time.perf_counter()
    grammars.compile(CONSTRAINTS["person schema"])
    times["cache hit"] = time.perf_counter() - start
    return times


def run(llm: LLM, n: int, constrained: bool) -> dict:
    """Output tok/s of `n` chat requests at once, and the mask's share of their decode steps."""
    tok = llm.engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    so = CONSTRAINTS["person schema"] if constrained else None
    params = [SamplingParams(temperature=0, seed=i, max_tokens=160, structured_outputs=so)
              for i in range(n)]  # fmt: skip
    steps: list[float] = []
    step = llm.engine.step

    def timed_step():
        start = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - start)
        return out

    llm.engine.step = timed_step  # type: ignore[method-assign]
    mask_before = llm.engine.stats().mask_seconds
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids}] * n, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.engine.step = step  # type: ignore[method-assign]
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    valid = sum(_valid(c.text) for o in outs for c in o.outputs) if constrained else None
    mask_s = llm.engine.stats().mask_seconds - mask_before
    return {
        "requests": n, "constrained": constrained, "tok_s": tokens / seconds,
        "output_tokens": tokens, "valid_json": valid, "steps": len(steps),
        "median_step_ms": statistics.median(steps) * 1e3,
        "mean_step_ms": statistics.mean(steps) * 1e3,
        "mean_mask_ms": mask_s / len(steps) * 1e3 if constrained else None,
    }  # fmt: skip


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32, help="rows of the masked decode steps")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(str(default_model_path()), max_num_seqs=max(args.batch, args.requests))
    result = {"machine": cpu_model(), "compile_s": compile_times(llm), "runs": []}
    for _ in range(args.rounds):
        for n in (args.requests, args.batch):
            for constrained in (False, True):
                result["runs"].append(run(llm, n, constrained))
    print("compile (s):", {k: round(v, 4) for k, v in result["compile_s"].items()})
    print(f"{'requests':>8} {'schema':>6} {'tok/s':>8} {'valid':>5} {'step ms':>8} {'mask ms':>8}")
    print("(means per step; the mask's time is part of the step's)")
    for r in result["runs"]:
        mask_ms = f"{r['mean_mask_ms']:.2f}" if r["mean_mask_ms"] else "-"
        print(f"{r['requests']:>8} {str(r['constrained']):>6} {r['tok_s']:>8.1f} "
              f"{str(r['valid_json']):>5} {r['mean_step_ms']:>8.2f} {mask_ms:>8}")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured_smollm2.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
