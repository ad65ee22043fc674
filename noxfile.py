"""Sessions: tests (the CI suite), lint (ruff + mypy), bench (benchmarks)."""

import nox

nox.options.sessions = ["tests"]
# A CPU build that lies on the development and CI machines; a bare "torch" may pull a CUDA build.
TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", "mypy")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "src")


@nox.session
def bench(session: nox.Session) -> None:
    """Kernel, engine and serving benchmarks; results and plots land in bench/results/."""
    session.install(TORCH)
    session.install("-e", ".[bench]")  # compiles llama-cpp-python the first time (minutes)
    session.run("python", "bench/bench_kernels.py", *session.posargs)
    session.run("python", "bench/bench_engine.py")
    session.run("python", "bench/bench_engine.py", "--dtype", "bfloat16", "--skip-serial")
    session.run("python", "bench/plot.py")  # bench_engine.py writes JSON only
    session.run("python", "bench/bench_serving.py")
    # Long prompts among short ones: inter-token latency with and without chunked prefill.
    mix = ["--rate", "4", "--concurrency", "--requests", "32", "--prompt-len", "16", "1800",
           "--max-num-batched-tokens", "256"]  # fmt: skip
    session.run("python", "bench/bench_serving.py", *mix, "--name", "chunked")
    session.run("python", "bench/bench_serving.py", *mix, "--no-chunked-prefill", "--name", "whole")


@nox.session
def soak(session: nox.Session) -> None:
    """Random clients against a live server for a few minutes (not in CI; `-- --seconds 60` for
    a shorter run). Fails on any 5xx or leaked KV block; writes bench/results/soak.json."""
    session.install(TORCH)
    session.install("-e", ".[bench]")
    session.run("python", "bench/soak.py", *session.posargs)
