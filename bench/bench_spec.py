"""Speculative decoding (n-gram prompt lookup) on the default model (SmolLM2-135M-Instruct, its
Q4_1 GGUF), one stream, greedy: tokens per second with and without it, on input-grounded tasks
(rewrite a given paragraph, edit given code: the output copies the input, so drafts are found and
accepted) and on free writing (few drafts), with the acceptance rate. Each output with
speculation must equal the one without, token for token; the runs alternate to share the
machine's noise, and each figure is the fastest round's (the least disturbed by other work on a
shared machine). The time is the whole request's (prompt too), one request at a time; `steps`
counts the engine steps (target-model forward passes) each request took.

    python -m bench.bench_spec [--k 3] [--max-tokens 192] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.machine import cpu_model
from nanoserve import LLM, SamplingParams
from nanoserve.default_model import default_model_path

RESULTS = Path(__file__).parent / "results"
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the great lamp and watched the ships pass "
    "safely through the rocks below. When the town built a new harbour with electric lights, "
    "the lighthouse was closed, but the people still walked up the hill on summer evenings to "
    "look at the sea and remember the keeper who never missed a single night."
)
CODE = """def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax
    return round(total, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""
TASKS = {
    "rewrite": "Rewrite the following text in the past perfect tense where it fits, keeping "
    f"every sentence otherwise the same:\n\n{PARAGRAPH}",
    "edit_code": "Rename the variable `total` to `amount` in this Python code and give the "
    f"whole code back:\n\n```python\n{CODE}```",
    "free_writing": "Write a short story about a cat who wants to become a sailor.",
}
GROUNDED = ("rewrite", "edit_code")


def run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """The output's token ids, the seconds it took and the engine steps."""
    engine, steps = llm.engine, 0
    engine.add_request("bench", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    return outputs[0].outputs[0].token_ids, seconds, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = str(default_model_path())
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    engines = {"off": LLM(path), "ngram": LLM(path, speculative_config=spec)}
    tok = engines["off"].engine.tokenizer
    for llm in engines.values():  # warm-up: the first request pays for one-time setup
        run(llm, tok.encode("Hello"), 8)
    result: dict = {"machine": cpu_model(), "speculative_config": spec, "tasks": {}}
    print(f"{'task':>13} {'tokens':>6} {'off tok/s':>9} {'ngram tok/s':>11} {'speed-up':>8} "
          f"{'accepted':>8} {'steps off/ngram':>15}")  # fmt: skip
    for name, text in TASKS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        times: dict[str, list[float]] = {"off": [], "ngram": []}
        steps: dict[str, int] = {}
        outputs: dict[str, list[int]] = {}
        before = engines["ngram"].engine.stats().spec_decode
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                ids, seconds, steps[mode] = run(llm, prompt, args.max_tokens)
                assert outputs.setdefault(mode, ids) == ids, f"{name}: {mode} not deterministic"
                times[mode].append(seconds)
        assert outputs["ngram"] == outputs["off"], f"{name}: speculation changed the output"
        after = engines["ngram"].engine.stats().spec_decode
        drafts = after.num_drafts - before.num_drafts
        proposed = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        n = len(outputs["off"])
        tok_s = {mode: n / min(t) for mode, t in times.items()}
        row = {
            "output_tokens": n,
            "tok_s": tok_s,
            "speedup": tok_s["ngram"] / tok_s["off"],
            "steps": steps,
            "rounds_s": times,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "drafts": drafts,
            "draft_tokens": proposed,
            "accepted_tokens": accepted,
            "identical_output": True,
        }
        result["tasks"][name] = row
        print(f"{name:>13} {n:>6} {tok_s['off']:>9.1f} {tok_s['ngram']:>11.1f} "
              f"{row['speedup']:>7.2f}x {row['acceptance_rate']:>8.2f} "
              f"{steps['off']:>7}/{steps['ngram']:<7}")  # fmt: skip
    print("(tok/s: output tokens over the fastest round's request time; accepted: of the draft "
          "tokens; steps: engine steps of the request)")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "spec_smollm2.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(len(tasks))
    for offset, mode in ((-0.2, "off"), (0.2, "ngram")):
        values = [t["tok_s"][mode] for t in tasks.values()]
        ax.bar([x + offset for x in xs], values, width=0.4, label=mode)
    for x, t in zip(xs, tasks.values(), strict=True):
        label = f"{t['speedup']:.2f}x, {t['acceptance_rate']:.0%} accepted"
        top = max(t["tok_s"].values())
        ax.annotate(label, (x, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), list(tasks))
    ax.set_ylabel("output tokens/s, one stream")
    ax.set_title("SmolLM2-135M Q4_1, greedy: n-gram speculation off and on", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
