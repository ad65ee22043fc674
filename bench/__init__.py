"""Benchmarks, run as modules from the repository root (`python -m bench.bench_engine`) or all at
once by `nox -s bench`; results and plots land in bench/results/."""
