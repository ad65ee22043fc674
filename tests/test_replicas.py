"""Data-parallel replicas behind smg: the load routers read at /v1/loads, and
`nanoserve serve --data-parallel-size 2` as a real process tree (two replicas and smg from PyPI)
on a tiny random model: answers equal to one server's, smg reading every replica's load, a
shared prefix kept on one replica, a killed replica restarted with no request lost, and SIGTERM
ending every process with the open stream closed by [DONE]."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from nanoserve import cli
from nanoserve.server import replicas
from nanoserve.testing.harness import hang_up, live_server, open_request, read_until

PROMPT = {"model": "tiny", "prompt": "The lighthouse keeper", "max_tokens": 12, "temperature": 0}
START_S = 180.0  # two replicas load one after the other on a busy 2-core machine


# -- /v1/loads -----------------------------------------------------------------------------------


async def test_loads_follow_a_held_request(tiny_model_dir):
    async with live_server(tiny_model_dir, kv_cache_memory_gb=0.05) as server:
        idle = (await server.http.get("/v1/loads?include=core,disagg,queues,memory")).json()
        (rank,) = idle["loads"]
        assert idle["dp_rank_count"] == 1 and rank["dp_rank"] == 0
        assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == rank["num_used_tokens"] == 0
        blocks, block_size = server.engine.num_blocks, server.engine.config.block_size
        assert rank["max_total_num_tokens"] == blocks * block_size
        assert rank["max_running_requests"] == server.engine.config.max_num_seqs
        body = {**PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        stream = await open_request(server, "/v1/completions", body)
        await read_until(stream, b"data: ")
        (busy,) = (await server.http.get("/v1/loads")).json()["loads"]
        assert busy["num_running_reqs"] == 1 and busy["num_total_reqs"] == 1
        assert 0 < busy["num_used_tokens"] <= busy["max_total_num_tokens"]
        assert busy["token_usage"] == busy["num_used_tokens"] / busy["max_total_num_tokens"]
        await hang_up(stream)
        await server.wait_idle()
        (after,) = (await server.http.get("/v1/loads")).json()["loads"]
        assert after["num_running_reqs"] == after["num_used_tokens"] == 0


# -- the launcher's parts ------------------------------------------------------------------------


def test_cpu_sets_are_disjoint_and_follow_numa_nodes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(replicas, "_numa_nodes", lambda: [{0, 1, 2, 3}, {4, 5, 6, 7}])
    assert replicas.cpu_sets(2) == [frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})]
    assert replicas.cpu_sets(4) == [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}),
                                    frozenset({6, 7})]  # fmt: skip
    monkeypatch.setattr(replicas, "_numa_nodes", lambda: [])
    assert replicas.cpu_sets(3) == [frozenset({0, 1}), frozenset({2, 3, 4}), frozenset({5, 6, 7})]
    with pytest.raises(ValueError, match="9: this process may run on 8 CPUs"):
        replicas.cpu_sets(9)
    assert replicas._cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


def test_replicas_get_the_flags_given_and_a_share_of_the_kv_memory():
    args = cli._parser().parse_args(
        ["serve", "demo", "-dp", "2", "--port", "9", "--kv-cache-memory", "1", "--max-num-seqs",
         "8", "--no-prefix-caching", "--router-policy", "round_robin"]
    )  # fmt: skip
    assert cli._forwarded(args) == ["--max-num-seqs", "8", "--no-prefix-caching"]


def test_a_missing_router_is_named_with_its_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["serve", "demo", "--data-parallel-size", "2", "--port", "0"]) == 2
    assert "pip install 'nanoserve[router]'" in capsys.readouterr().err


def test_tensor_parallel_replicas_are_refused_by_name(capsys):
    assert cli.main(["serve", "demo", "-dp", "2", "-tp", "2", "--port", "0"]) == 2
    assert "--data-parallel-size with --tensor-parallel-size" in capsys.readouterr().err


# -- the process tree ----------------------------------------------------------------------------


class Front:
    def __init__(self, process: subprocess.Popen, url: str, log: Path):
        self.process, self.url, self.log = process, url, log
        self.http = httpx.Client(base_url=url, timeout=60)

    def replicas(self) -> list[str]:
        return sorted(w["url"] for w in self.http.get("/workers").json()["workers"])

    def complete(self, url: str | None = None, **body) -> str:
        r = httpx.post(f"{url or self.url}/v1/completions", json={**PROMPT, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def streamed(self, url: str | None = None) -> str:
        text = ""
        body = {**PROMPT, "stream": True}
        with httpx.stream("POST", f"{url or self.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text


def _launch(model_dir: Path, log: Path, policy: str = "cache_aware") -> Front:
    port = _free_port()
    argv = [sys.executable, "-m", "nanoserve.cli", "serve", str(model_dir), "-dp", "2",
            "--port", str(port), "--kv-cache-memory", "0.1", "--served-model-name", "tiny",
            "--router-policy", policy]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    front = Front(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_S
    while not _ready(front):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return front


@pytest.fixture(scope="module")
def front(tiny_model_dir, tmp_path_factory):
    front = _launch(tiny_model_dir, tmp_path_factory.mktemp("dp") / "front.log")
    yield front
    if front.process.poll() is None:  # the SIGTERM test did not run: stop it as a user would
        front.process.terminate()
        front.process.wait(timeout=60)


def _ready(front: Front) -> bool:
    try:
        return front.http.get("/readiness").json().get("healthy_workers") == 2
    except (httpx.HTTPError, ValueError):
        return False


def test_answers_equal_one_servers(front):
    urls = front.replicas()
    assert len(urls) == 2
    alone = front.complete(urls[0])
    assert front.complete(urls[1]) == alone
    for _ in range(4):
        assert front.complete() == alone
        assert front.streamed() == alone


def test_the_router_passes_the_responses_and_messages_apis_through(front):
    """smg re-sends a Responses request with vLLM's extras (priority 0, top_k -1, min_p 0,
    repetition_penalty 1): they must not be refused; Messages passes as it is."""
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0}
    r = front.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]}  # fmt: skip
    r = front.http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"


def test_the_router_reads_each_replicas_load(front):
    workers = front.http.get("/workers").json()["workers"]
    # nanoserve answers vLLM's /version, so smg takes it for vLLM and still reads /v1/loads
    assert {w["runtime_type"] for w in workers} == {"vllm"}
    deadline = time.monotonic() + 30  # smg polls each replica's load once a second
    while len(loads := front.http.get("/get_loads").json()["loads"]) < 2:
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)
    assert all(rank["max_total_num_tokens"] > 0 for rank in loads)  # only /v1/loads says it


def test_a_shared_prefix_stays_on_one_replica(front):
    before = {url: _prefix_hits(url) for url in front.replicas()}
    prefix = "You are a careful assistant who answers in one short sentence. " * 8
    for question in ("Who?", "What?", "Where?", "When?", "Why?"):
        front.complete(prompt=prefix + question, max_tokens=2)
    gained = sorted(_prefix_hits(url) - before[url] for url in front.replicas())
    assert gained[0] == 0 and gained[1] > 0, gained


def _prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nanoserve:prefix_cache_hits_total")
    )


def test_a_killed_replica_costs_no_later_request_and_is_restarted(front):
    urls = front.replicas()
    pid = _pid_on(front, urls[0])
    os.kill(pid, signal.SIGKILL)
    for _ in range(6):
        front.complete()
    deadline = time.monotonic() + START_S
    while not _healthy(urls[0]):
        assert time.monotonic() < deadline, front.log.read_text()[-3000:]
        time.sleep(0.5)
    assert "starting it again" in front.log.read_text()


def _pid_on(front: Front, url: str) -> int:
    """The replica process serving `url`: a child of the front's whose command line has its port."""
    flag = ["--port", url.rsplit(":", 1)[1]]
    for pid in _descendants(front.process.pid):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if any(args[i : i + 2] == flag for i in range(len(args))):
            return pid
    raise AssertionError(f"no replica serves {url}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_least_load_sends_new_requests_past_a_busy_replica(tiny_model_dir, tmp_path):
    """One replica kept busy by a client of its own (long requests, one after another); requests
    through the router then go to the other. They end on a stop string, the busy replica's own
    on their length, so each replica's finished requests tell whose they were."""
    front = _launch(tiny_model_dir, tmp_path / "front.log", policy="least_load")
    busy, idle = front.replicas()
    stop = front.complete(idle)[:4]
    done = threading.Event()

    def keep_busy() -> None:
        body = {**PROMPT, "prompt": "Busy", "max_tokens": 400, "ignore_eos": True}
        while not done.is_set():
            httpx.post(f"{busy}/v1/completions", json=body, timeout=60)

    worker = threading.Thread(target=keep_busy, name="keep-busy", daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 30  # smg polls the loads once a second
        while not any(rank["num_running_reqs"] for rank in _loads(front)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        before = {url: _finished(url, "stop") for url in (busy, idle)}
        for _ in range(6):
            front.complete(stop=[stop])
        gained = {url: _finished(url, "stop") - before[url] for url in (busy, idle)}
        assert sum(gained.values()) == 6
        assert gained[busy] < gained[idle], gained
    finally:
        done.set()
        worker.join()
        front.process.terminate()
        assert front.process.wait(timeout=60) == 0


def _loads(front: Front) -> list[dict]:
    return front.http.get("/get_loads").json()["loads"]


def _finished(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    prefix = f'nanoserve:request_success_total{{finished_reason="{reason}"}}'
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_sigterm_ends_every_process_and_closes_streams(front):
    children = _descendants(front.process.pid)
    assert len(children) >= 3  # two replicas and the router
    body = {**PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        front.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert front.process.wait(timeout=30) == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _descendants(pid: int) -> list[int]:
    table = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    children = [child for child, parent in _pairs(table) if parent == pid]
    return children + [d for child in children for d in _descendants(child)]


def _pairs(table: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (line.split() for line in table.splitlines()[1:])]


# -- the several-machines recipe -----------------------------------------------------------------


def test_the_recipe_for_several_machines_with_an_api_key(tiny_model_dir, tmp_path):
    """The README's recipe, on one machine: two servers, smg launched in front by hand, one key."""
    key, ports = "sesame", [_free_port() for _ in range(3)]
    log = (tmp_path / "recipe.log").open("w")
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nanoserve.cli",
                "serve",
                str(tiny_model_dir),
                "--port",
                str(port),
                "--api-key",
                key,
                "--served-model-name",
                "tiny",
                "--kv-cache-memory",
                "0.05",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for port in ports[1:]
    ]
    router = [replicas.router_binary(), "launch", "--host", "127.0.0.1", "--port", str(ports[0]),
              "--policy", "cache_aware", "--api-key", key, "--prometheus-port", str(_free_port()),
              "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports[1:])]  # fmt: skip
    try:
        for port in ports[1:]:
            _wait(lambda port=port: _healthy(f"http://127.0.0.1:{port}"), tmp_path)
        processes = [*servers, subprocess.Popen(router, stdout=log, stderr=subprocess.STDOUT)]
        front = f"http://127.0.0.1:{ports[0]}"
        auth = {"Authorization": f"Bearer {key}"}
        _wait(lambda: _ready_at(front, auth), tmp_path)
        denied = httpx.post(f"{front}/v1/completions", json=PROMPT, timeout=60)
        assert denied.status_code == 401
        prefix = "You are a careful assistant who answers in one short sentence. " * 8
        for question in ("Who?", "What?", "Where?", "When?", "Why?", "Who?"):  # shared prefixes
            body = {**PROMPT, "prompt": prefix + question}
            direct = httpx.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json=body,
                                headers=auth, timeout=60).json()["choices"][0]["text"]  # fmt: skip
            r = httpx.post(f"{front}/v1/completions", json=body, headers=auth, timeout=60)
            assert r.json()["choices"][0]["text"] == direct
        _wait(lambda: len(httpx.get(f"{front}/get_loads", headers=auth).json()["loads"]) == 2,
              tmp_path)  # fmt: skip
    finally:
        for process in reversed(processes if "processes" in locals() else servers):
            process.terminate()
        for process in servers:
            assert process.wait(timeout=30) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready_at(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(f"{url}/readiness", headers=headers).json().get("healthy_workers") == 2
    except (httpx.HTTPError, ValueError):
        return False


def _wait(condition, tmp_path: Path) -> None:
    deadline = time.monotonic() + START_S
    while not condition():
        assert time.monotonic() < deadline, (tmp_path / "recipe.log").read_text()[-3000:]
        time.sleep(0.3)
