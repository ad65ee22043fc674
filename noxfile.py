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
    """Kernel and engine benchmarks; results and plots land in bench/results/."""
    session.install(TORCH)
    session.install("-e", ".[bench]")
    session.run("python", "bench/bench_kernels.py", *session.posargs)
    session.run("python", "bench/bench_engine.py")
