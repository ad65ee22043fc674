"""Command line: `nanoserve generate [MODEL_DIR] --prompt TEXT`. Without a model directory it
runs the built-in demo model (a small random Llama built on first use, no download).
"""

from __future__ import annotations

import argparse
import sys

from nanoserve.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoserve")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete a prompt offline and print the text")
    gen.add_argument("model", nargs="?", help="Hugging Face checkpoint directory (default: demo)")
    gen.add_argument("--prompt", action="append", required=True, help="may be given repeatedly")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from nanoserve.demo import demo_model_dir
    from nanoserve.llm import LLM

    model = args.model or str(demo_model_dir())
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed,
        )  # fmt: skip
        llm = LLM(model, dtype=args.dtype)
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(prompt + out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
