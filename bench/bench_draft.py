"""Speculation by a draft model on bench_spec's tasks: SmolLM2-135M Q4_1, one stream, greedy, off
and with a draft (default: the model drafting for itself, every draft accepted: what the draft's
own k forwards a step cost), the fastest of `--rounds`; asserts identical output.

    python -m bench.bench_draft [--draft PATH] [--k 3] [--max-tokens 192] [--rounds 2]
"""

from __future__ import annotations

import argparse

from bench.bench_spec import TASKS, run
from nanoserve import LLM
from nanoserve.default_model import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=None, help="the draft's path (default: the model itself)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = str(default_model_path())
    spec = {"model": args.draft or path, "num_speculative_tokens": args.k}
    engines = {"off": LLM(path), "draft": LLM(path, speculative_config=spec)}
    tok = engines["off"].engine.tokenizer
    for llm in engines.values():  # warm-up
        run(llm, tok.encode("Hello"), 8)
    print(f"{'task':>13} {'off tok/s':>9} {'draft tok/s':>11} {'speed':>6} {'steps':>9} accepted")
    for name, text in TASKS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        rows = {}
        for mode, llm in engines.items():
            before = llm.engine.stats().spec_decode
            rounds = [run(llm, prompt, args.max_tokens) for _ in range(args.rounds)]
            after = llm.engine.stats().spec_decode
            ids, _, steps = rounds[0]
            assert all(r[0] == ids for r in rounds), f"{name}: {mode} not deterministic"
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            proposed = after.num_draft_tokens - before.num_draft_tokens
            rows[mode] = (ids, len(ids) / min(r[1] for r in rounds), steps, accepted, proposed)
        off, on = rows["off"], rows["draft"]
        assert on[0] == off[0], f"{name}: speculation changed the output"
        print(f"{name:>13} {off[1]:>9.1f} {on[1]:>11.1f} {on[1] / off[1]:>5.2f}x "
              f"{off[2]:>4}/{on[2]:<4} {on[3]} of {on[4]}")  # fmt: skip


if __name__ == "__main__":
    main()
