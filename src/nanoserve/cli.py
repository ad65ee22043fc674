"""Command line: `nanoserve serve [MODEL_DIR]` (the OpenAI-compatible server) and
`nanoserve generate [MODEL_DIR] --prompt TEXT` (offline). Without a model directory both run the
built-in demo model (a small random Llama built on first use, no download).
"""

from __future__ import annotations

import argparse
import logging
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
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu", help="cpu, or cuda[:N]")
    _add_serve(commands)
    args = parser.parse_args(argv)
    return _serve(args) if args.command == "serve" else _generate(args)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    from nanoserve.server import DEFAULT_MAX_BODY_BYTES

    srv = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    srv.add_argument("model", nargs="?", help="Hugging Face checkpoint directory (default: demo)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    srv.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (weights in bf16/fp16)")
    srv.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: share of device memory for weights and KV cache",
    )
    srv.add_argument("--block-size", type=int, default=16)
    srv.add_argument("--num-kv-blocks", type=int, default=None, help="overrides the memory size")
    srv.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the KV cache")
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--max-num-batched-tokens", type=int, default=2048)
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--max-queue", type=int, default=None, help="503 past this many waiting")
    srv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    srv.add_argument("--served-model-name", default=None, help="default: MODEL_DIR as given")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _serve(args: argparse.Namespace) -> int:
    import trio

    from nanoserve.config import EngineConfig
    from nanoserve.demo import demo_model_dir
    from nanoserve.engine import Engine
    from nanoserve.server import create_app, serve
    from nanoserve.serving import Serving

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = args.served_model_name or args.model or "demo"
    try:
        config = EngineConfig(
            dtype=args.dtype, device=args.device, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )  # fmt: skip
        if args.max_queue is not None and args.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
        engine = Engine(args.model or demo_model_dir(), config)
    except (ValueError, FileNotFoundError) as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 2
    serving = Serving(engine, max_queue=args.max_queue)
    app = create_app(serving, name, api_key=args.api_key, max_body_bytes=args.max_request_bytes)
    logging.getLogger("nanoserve").info(
        "model %r: %d KV blocks of %d tokens, context %d tokens",
        name, engine.num_blocks, config.block_size, engine.max_model_len,
    )  # fmt: skip
    trio.run(serve, app, serving, args.host, args.port)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from nanoserve.demo import demo_model_dir
    from nanoserve.llm import LLM

    model = args.model or str(demo_model_dir())
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed,
        )  # fmt: skip
        llm = LLM(model, dtype=args.dtype, device=args.device)
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(prompt + out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
