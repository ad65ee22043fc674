"""Tensor parallelism end to end, two ranks on gloo: the same tokens as one process and as
transformers (greedy and seeded sampling, under preemption, chunked prefill and a prefix-cache hit;
a GGUF file), the same prompt logprobs, every rank's cache as large as the one allocator's pool;
and `nanoserve serve --tensor-parallel-size 2` failing cleanly when a worker dies (mid-generation
or idle) and stopping its worker on SIGTERM. The engines are spawned once per module."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
from test_engine import _mixed_requests
from test_oracle import _prompts, _reference

from nanoserve import LLM, SamplingParams
from nanoserve.engine import StructuredOutputsParams
from nanoserve.testing.gguf_writer import write_gguf
from nanoserve.testing.harness import WAIT_S, open_request, read_until, serve_command, sse_data

# Small enough to preempt the oracle's prompts; a token budget that chunks the longer ones.
POOL = dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(llm, prompts, params):
    """Token ids per prompt, the preemptions it took, and the pool checked afterwards (the
    ledger on rank 0, and the worker's cache as large as the pool it decides)."""
    before = llm.engine.stats().num_preemptions
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.audit()
    assert llm.engine.cache_blocks() == [16] * llm.engine.config.tensor_parallel_size
    assert llm.engine.stats().free_blocks == 16
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats().num_preemptions - before


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt) for one test, whatever this process
    inherited: a shell starts a background job with SIGINT ignored, and Python then installs
    none, so a test run with `&` would see no KeyboardInterrupt at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class TestTwoRanksAgreeWithOne:
    """One engine of each kind for the class (one tensor-parallel engine per process at a time:
    the later tests start their own)."""

    @pytest.fixture(scope="class")
    @classmethod
    def tp1(cls, tiny_model_dir):
        return LLM(str(tiny_model_dir), **POOL)

    @pytest.fixture(scope="class")
    @classmethod
    def tp2(cls, tiny_model_dir):
        with LLM(str(tiny_model_dir), tensor_parallel_size=2, **POOL) as llm:
            yield llm

    def test_greedy_ids_equal_one_process_and_transformers_under_preemption(
        self, tp1, tp2, tiny_model_dir
    ):
        prompts = _prompts(500)
        ours, preempted = _run(tp2, prompts, GREEDY)
        assert preempted > 0, "the pool was meant to be small enough to preempt"
        assert ours == _run(tp1, prompts, GREEDY)[0]
        assert ours == _reference(tiny_model_dir, prompts)

    def test_seeded_sampling_equals_one_process_under_preemption(self, tp1, tp2):
        """Top-k, top-p and temperature, each request with its seed (sampling runs on rank 0)."""
        requests = _mixed_requests(12)
        prompts = [p["prompt_token_ids"] for p, _ in requests]
        params = [s for _, s in requests]
        ours, preempted = _run(tp2, prompts, params)
        assert preempted > 0
        assert ours == _run(tp1, prompts, params)[0]

    def test_structured_outputs_equal_one_process(self, tp1, tp2):
        """The grammar lives on rank 0, which samples: the same constrained tokens at two ranks
        as in one process, and every one of them matches."""
        constraint = StructuredOutputsParams(regex="[a-d]{3}-[0-9]{2}")
        params = [SamplingParams(temperature=t, seed=i, max_tokens=40,
                                 structured_outputs=constraint)
                  for i, t in enumerate([0.0, 1.0, 1.0])]  # fmt: skip
        prompts = [list(range(5, 25 + 7 * i)) for i in range(3)]
        ours, _ = _run(tp2, prompts, params)
        assert ours == _run(tp1, prompts, params)[0]
        texts = [tp1.engine.tokenizer.decode(ids) for ids in ours]
        assert all(re.fullmatch("[a-d]{3}-[0-9]{2}", t) for t in texts), texts

    def test_a_prefix_hit_computes_less_and_changes_nothing(self, tp1, tp2):
        shared = list(range(100, 150))  # 6 full blocks of 8
        first, second = shared + [7, 8], shared + [9]
        _run(tp2, [first], GREEDY)
        before = tp2.engine.stats().num_prefix_hit_tokens
        ours = tp2.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
        assert ours.num_cached_tokens == 48
        assert tp2.engine.stats().num_prefix_hit_tokens - before == 48
        alone = tp1.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
        assert ours.outputs[0].token_ids == alone.outputs[0].token_ids

    def test_a_first_ctrl_c_waits_for_the_end_of_the_step(
        self, tp1, tp2, monkeypatch, python_sigint_handler
    ):
        """SIGINT arrives while rank 0 is in a step (here: once the workers have the step's
        inputs, before rank 0 runs its part): the forward pass runs to its end on both ranks,
        then KeyboardInterrupt; the ranks stay in step. `raise_signal` runs the handler before
        it returns, so the signal lands inside the step on every run."""
        engine = tp2.engine
        call, execute = engine.executor.channel.call, engine.runner.execute
        finished = []

        def call_then_interrupt(method, args):
            call(method, args)
            signal.raise_signal(signal.SIGINT)

        def execute_to_the_end(inputs):
            result = execute(inputs)
            finished.append(True)
            return result

        monkeypatch.setattr(engine.executor.channel, "call", call_then_interrupt)
        monkeypatch.setattr(engine.runner, "execute", execute_to_the_end)
        engine.add_request("interrupted", list(range(1, 40)), GREEDY)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        assert finished == [True], "rank 0's forward pass was cut short"
        engine.abort("interrupted")
        monkeypatch.setattr(engine.executor.channel, "call", call)
        monkeypatch.setattr(engine.runner, "execute", execute)
        prompts = _prompts(500)[:2]
        assert _run(tp2, prompts, GREEDY)[0] == _run(tp1, prompts, GREEDY)[0]

    def test_an_ignored_sigint_stays_ignored_in_a_step(self, tp2, monkeypatch):
        """A process that ignores SIGINT (a shell's background job starts so) keeps ignoring it
        in a step: the step leaves a handler it did not install alone."""
        engine, call = tp2.engine, tp2.engine.executor.channel.call

        def call_then_interrupt(method, args):
            call(method, args)
            signal.raise_signal(signal.SIGINT)

        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            monkeypatch.setattr(engine.executor.channel, "call", call_then_interrupt)
            engine.add_request("ignored", list(range(1, 40)), GREEDY)
            assert engine.step() == []  # a 39-token prompt in budgets of 32: no token yet
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        finally:
            monkeypatch.setattr(engine.executor.channel, "call", call)
            signal.signal(signal.SIGINT, previous)
            engine.abort("ignored")
        tp2.engine.audit()

    def test_prompt_logprobs_equal_one_process(self, tp1, tp2):
        """A 70-token prompt scored in chunks of the 32-token budget; the logits of the scored rows
        are gathered from both ranks. Partial sums added in another order: within test_scoring's
        tolerance against transformers."""
        prompt = {"prompt_token_ids": list(range(5, 75))}
        params = SamplingParams(prompt_logprobs=3, max_tokens=2, temperature=0, ignore_eos=True)
        ours = tp2.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
        alone = tp1.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
        assert ours[0] is None and len(ours) == len(alone) == 70
        for mine, theirs in zip(ours[1:], alone[1:], strict=True):
            assert set(mine) == set(theirs)
            for token, lp in mine.items():
                assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
                assert lp.rank == theirs[token].rank
        tp2.engine.audit()


def test_a_rank_started_by_hand_meets_rank_0_at_env_variables(tiny_model_dir, monkeypatch):
    """`nanoserve worker` with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (as on another
    machine): it takes rank 0's settings, answers as a spawned worker does, and exits with 0
    when rank 0 closes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    command = [sys.executable, "-m", "nanoserve.cli", "worker", str(tiny_model_dir)]
    worker = subprocess.Popen(
        command, env={**os.environ, **env, "RANK": "1", "OMP_NUM_THREADS": "1"}, text=True,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for name, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        prompts = [{"prompt_token_ids": p} for p in _prompts(500)[:3]]
        with LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=64) as llm:
            assert llm.engine.worker_pids == [] and llm.engine.cache_blocks() == [64, 64]
            ours = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert worker.wait(timeout=WAIT_S) == 0, worker.stderr.read()
    finally:
        worker.kill()
    alone = LLM(str(tiny_model_dir)).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in alone]
    bare = {k: v for k, v in os.environ.items() if k not in (*env, "RANK")}
    missing = subprocess.run(command, env=bare, capture_output=True, text=True, timeout=WAIT_S)
    assert missing.returncode == 2
    assert missing.stderr == (
        "nanoserve: a worker needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK in its environment\n"
    )


def test_a_gguf_file_split_two_ways_gives_the_same_tokens(tiny_model_factory, tmp_path):
    """Each rank reads the file and keeps its slices (an untied output projection here). The
    300-token prompt makes a step whose message takes two broadcasts (more than FIRST values)."""
    path = write_gguf(tiny_model_factory(tie_word_embeddings=False), tmp_path / "tiny.gguf")
    prompts = [*_prompts(500)[:3], list(range(1, 301))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=2) as llm:
        ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = LLM(str(path)).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in alone]


def test_bfloat16_close_to_transformers(tiny_model_dir):
    """As in one process (test_oracle): bf16 rounding makes long runs a coin toss, and each
    rank's partial products are rounded before they are summed; the first tokens agree."""
    prompts = _prompts(500)[:3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_model_dir), dtype="bfloat16", tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    reference = _reference(tiny_model_dir, prompts, max_tokens=4, dtype=torch.bfloat16)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_threads_are_shared_and_given_back(tiny_model_dir):
    threads = torch.get_num_threads()
    with LLM(str(tiny_model_dir), tensor_parallel_size=2) as llm:
        assert torch.get_num_threads() == max(1, threads // 2)
        (pid,) = llm.engine.worker_pids
        assert _alive(pid)
    assert torch.get_num_threads() == threads
    assert not _alive(pid)


def test_a_start_that_fails_after_the_workers_stops_them(tiny_model_dir, monkeypatch):
    """An error once the group runs (here in the grammar compiler, built after the weights)
    stops the worker at once, while the error is still held, and frees torch.distributed's one
    process group for the next engine."""
    from nanoserve.engine import engine
    from nanoserve.engine.parallel import tp

    launched = []
    launch = tp.TensorParallelExecutor.launch
    monkeypatch.setattr(
        tp.TensorParallelExecutor,
        "launch",
        classmethod(lambda cls, *a: launched.append(launch(*a)) or launched[-1]),
    )

    def broken(*args):
        raise RuntimeError("the grammar compiler broke")

    monkeypatch.setattr(engine, "GrammarCompiler", broken)
    with pytest.raises(RuntimeError, match="the grammar compiler broke"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2)
    (pid,) = launched[0].pids
    assert not _alive(pid)
    monkeypatch.undo()
    with LLM(str(tiny_model_dir), tensor_parallel_size=2) as llm:
        assert llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)


# -- `nanoserve serve --tensor-parallel-size 2`: failures and shutdown -------------------------

C = "/v1/completions"
LONG = {"prompt": "She wrote the weather", "ignore_eos": True, "temperature": 0}
# An engine that died stops the server at once (its requests have failed already): Hypercorn's
# grace (3 s) and the watchdog's 2 s bound it, then stopping the workers (5 s, then a kill).
EXIT_BOUND_S = 3.0 + 2.0 + 5.0


def _worker_pid(server) -> int:
    line = next(line for line in server.startup_log.splitlines() if "worker pids" in line)
    (pid,) = [int(p) for p in line.rsplit("worker pids ", 1)[1].split(", ")]
    return pid


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def _rest_of_log(proc) -> str:
    log = b""
    while chunk := await proc.stderr.receive_some():
        log += chunk
    return log.decode(errors="replace")


async def test_a_worker_killed_mid_generation_fails_the_requests_and_the_server_exits(
    tiny_model_dir,
):
    """SIGKILL to the worker while a stream and a unary request run: the stream ends with an
    error event and [DONE], the unary request gets a 500, both naming the dead rank; the server
    exits with status 1 by itself, and no worker process is left."""
    async with serve_command(tiny_model_dir, "--tensor-parallel-size", "2") as (proc, server):
        pid = _worker_pid(server)
        stream = await open_request(server, C, {**LONG, "stream": True, "max_tokens": 1800})
        await read_until(stream, b"data: ")
        unary = {}

        async def post_unary():
            unary["r"] = await server.http.post(C, json={**LONG, "max_tokens": 1800})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post_unary)
            await server.wait_until(lambda h: h["running"] == 2)
            os.kill(pid, signal.SIGKILL)
            killed = trio.current_time()
        events = sse_data(await read_until(stream, b"data: [DONE]\n\n"))
        with trio.fail_after(EXIT_BOUND_S):
            code = await proc.wait()
        exit_s = trio.current_time() - killed
        log = await _rest_of_log(proc)
    print(f"\n[tp kill] server exited with {code} {exit_s:.2f} s after the kill")
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "worker rank 1" in error["message"]
    assert unary["r"].status_code == 500 and "worker rank 1" in unary["r"].text
    assert code == 1 and "the engine died" in log and "killed by SIGKILL" in log
    assert not _alive(pid)


async def test_a_worker_that_dies_while_the_server_idles_stops_it(tiny_model_dir):
    """No request runs, so no step notices: the idle engine task's health check (every second)
    does, and the server exits with status 1."""
    async with serve_command(tiny_model_dir, "-tp", "2") as (proc, server):
        pid = _worker_pid(server)
        answer = await server.http.post(C, json={**LONG, "max_tokens": 4})
        assert answer.status_code == 200
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(1.0 + EXIT_BOUND_S):
            code = await proc.wait()
        log = await _rest_of_log(proc)
    assert code == 1 and "worker rank 1" in log and "health check failed" in log


async def test_sigterm_stops_the_server_and_its_worker(tiny_model_dir):
    async with serve_command(tiny_model_dir, "-tp", "2") as (proc, server):
        pid = _worker_pid(server)
        assert _alive(pid)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(WAIT_S):
            code = await proc.wait()
        log = await _rest_of_log(proc)
    assert code == 0, log
    assert not _alive(pid)
