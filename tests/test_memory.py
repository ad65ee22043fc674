"""The memory the server promises is memory it has: the KV pool is written before the server
says it is ready (its RSS holds it), a pool that does not fit in what the machine (or its
cgroup) has left is refused at start with the largest value that fits, and /metrics shows the
process's memory and the cache's configuration. What may be taken is read from /proc/meminfo
and the cgroup files, tested here on fixture files for cgroup v1 and v2."""

import mmap
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio

from nanoserve import LLM
from nanoserve.config import EngineConfig
from nanoserve.default_model import default_model_path
from nanoserve.engine import NotEnoughMemory
from nanoserve.engine.kv_cache import allocate_cache, take_cache
from nanoserve.engine.memory import (
    GiB,
    Headroom,
    MiB,
    Pools,
    cgroup_dirs,
    cgroup_headroom,
    check_fits,
    headroom,
    meminfo_available,
    resident_bytes,
)
from nanoserve.testing.harness import live_server, serve_command

LIMIT = "NANOSERVE_MEMORY_LIMIT_BYTES"


def _thp_mode() -> str:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.read_text() if thp.exists() else ""


def _rss(pid: int) -> int:
    return resident_bytes(Path(f"/proc/{pid}/status"))


# -- refused at start ----------------------------------------------------------------------------


async def test_a_pool_larger_than_the_memory_allowed_is_refused_at_start(
    tiny_model_dir, monkeypatch
):
    """Exit status 2, one line naming the flag, the figures, and a largest value that does
    start under the same limit."""
    monkeypatch.setenv(LIMIT, str(GiB))  # the servers started here inherit it
    command = [sys.executable, "-m", "nanoserve.cli", "serve", str(tiny_model_dir), "--port", "0"]
    with trio.fail_after(120):  # a server that starts instead never exits by itself
        result = await trio.run_process(
            [*command, "--kv-cache-memory", "2"], capture_stderr=True, check=False
        )
    assert result.returncode == 2, result.stderr.decode()
    message = result.stderr.decode().splitlines()[-1]
    assert message.startswith("nanoserve: --kv-cache-memory must be at most "), message
    assert re.search(r"KV cache would take 2\.00 GiB \(\d+ blocks of 16 tokens, float32\)", message)
    assert f"{LIMIT}={GiB}" in message and message.endswith("got 2.0")
    largest = message.split("at most ")[1].split()[0]
    assert 0.1 < float(largest) < 1
    async with serve_command(tiny_model_dir, "--kv-cache-memory", largest) as (proc, server):
        assert "KV cache written" in server.startup_log  # and ready: it fits


def test_the_offline_llm_raises_naming_the_setting(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(LIMIT, str(resident_bytes() + 512 * MiB))
    with pytest.raises(NotEnoughMemory, match=r"^kv_cache_memory_gb must be at most 0\.\d+ to fit"):
        LLM(str(tiny_model_dir), kv_cache_memory_gb=2)


def test_ranks_spawned_on_this_machine_are_refused_if_their_whole_reads_do_not_fit(
    tiny_model_dir, monkeypatch
):
    """Under tensor parallelism every rank reads the whole checkpoint before it cuts its slice,
    the spawned ranks at the same time as rank 0: two must fit twice the weights, or the start
    is refused (ModelTooLarge) before any rank is spawned."""
    from nanoserve.engine import ModelTooLarge
    from nanoserve.engine.parallel import tp
    from nanoserve.model import open_checkpoint

    once = open_checkpoint(tiny_model_dir).weight_bytes(torch.float32)
    monkeypatch.setattr(tp, "headroom", lambda: Headroom(2 * once - 1, "test"))

    def not_spawned(*args, **kwargs):
        raise AssertionError("the ranks were being spawned")

    monkeypatch.setattr(tp, "_spawn", not_spawned)
    with pytest.raises(ModelTooLarge, match=f"need {2 * once} bytes .*2 ranks on this machine"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2, dtype="float32")


def _pools(blocks=1000, margin_per_token=10 * 1024):
    """Pools of 1 MiB blocks (of 16 tokens) at a context of 9000, with a margin of 10 KiB a
    token of context (90 MiB here)."""
    return Pools(
        blocks=blocks, block_bytes=MiB, setting_block_bytes=MiB,
        margin_at=lambda context: context * margin_per_token, context=9000,
        weights=50 * MiB, dtype="float32", draft=False,
    )  # fmt: skip


def test_the_setting_named_is_the_one_that_sized_the_pool_or_the_context_that_cannot_fit():
    room = Headroom(590 * MiB, "MemAvailable")
    margin = 9000 * 10 * 1024
    check_fits(EngineConfig(), _pools(blocks=(room.bytes - margin) // MiB), room)  # just fits
    with pytest.raises(NotEnoughMemory, match=r"^kv_cache_memory_gb must be at most 0\.49 ") as e:
        check_fits(EngineConfig(), _pools(), room)  # 502 blocks fit: 0.4902 GiB
    assert "would take 0.98 GiB (1000 blocks of 16 tokens, float32)" in str(e.value)
    assert "working margin 0.09 GiB (the largest prefill step's, at context 9000)" in str(e.value)
    with pytest.raises(NotEnoughMemory, match=r"^num_kv_blocks must be at most 502 "):
        check_fits(EngineConfig(num_kv_blocks=1000), _pools(), room)
    # max_model_len: where even the largest pool that fits holds fewer tokens (502 * 16 = 8032),
    # or where the margin at this context leaves no room for a block.
    context_rule = r"^max_model_len must be at most (\d+) to fit in memory, with a KV cache of"
    with pytest.raises(NotEnoughMemory, match=context_rule) as e:
        check_fits(EngineConfig(max_model_len=9000), _pools(), room)
    longest = int(re.match(context_rule, str(e.value))[1])
    assert longest % 16 == 0 and longest * 10 * 1024 + longest // 16 * MiB <= room.bytes
    assert (longest + 16) * 10 * 1024 + (longest // 16 + 1) * MiB > room.bytes
    with pytest.raises(NotEnoughMemory, match=r"^max_model_len must be at most \d+ .*got 9000$"):
        check_fits(EngineConfig(), _pools(margin_per_token=70 * 1024), room)
    with pytest.raises(NotEnoughMemory, match="smaller: not one block fits"):
        check_fits(EngineConfig(), _pools(margin_per_token=70 * 1024), Headroom(MiB, "x"))


# -- taken at start ------------------------------------------------------------------------------


async def test_rss_when_ready_holds_the_pool_and_the_weights():
    pool, weights = 0.5 * GiB, default_model_path().stat().st_size
    async with serve_command(None, "--kv-cache-memory", "0.5") as (proc, server):
        assert _rss(proc.pid) >= 0.9 * (pool + weights)
        assert "KV blocks of 16 tokens (0.50 GiB, float16)" in server.startup_log


def test_the_offline_llm_holds_its_pool_once_built(tiny_model_dir):
    """In a fresh process: one that ran other tests holds freed pages that a new pool may reuse
    without its RSS growing."""
    script = (
        "import sys\n"
        "from nanoserve import LLM\n"
        "from nanoserve.engine.memory import resident_bytes\n"
        "before = resident_bytes()\n"
        "llm = LLM(sys.argv[1], kv_cache_memory_gb=0.25)\n"
        "print(resident_bytes() - before, llm.engine.kv_cache_bytes)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    grew, pool = map(int, done.stdout.split())
    assert pool > 0.99 * 0.25 * GiB
    assert grew >= 0.9 * 0.25 * GiB


def _pool() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """64 MiB: 2 layers of keys and values, 1024 blocks of 4 heads x 16 tokens x 64, float32."""
    return allocate_cache(2, 1024, 4, 16, 64, torch.float32, "cpu")


def test_a_cpu_pool_is_one_mapping_taken_by_a_write_a_page(monkeypatch):
    """The kernel hands the mapping's pages out as zeros: one zero written at the start of each
    page holds the pool, every byte of it zeros."""
    caches = _pool()
    assert len({t.untyped_storage().data_ptr() for pair in caches for t in pair}) == 1
    written, zero = [], torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: written.append(t.numel()) or zero(t))
    before = resident_bytes()
    take_cache(caches)
    assert resident_bytes() - before >= 0.95 * 64 * MiB
    assert written == [64 * MiB // mmap.PAGESIZE]
    assert all(not t.any() for pair in caches for t in pair)


@pytest.mark.skipif(
    Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2",
    reason="strict overcommit: the kernel charges every mapping, reserved or not",
)
def test_a_pool_larger_than_the_machine_is_mapped_so_that_the_check_can_refuse_it():
    """Twice the machine's memory maps (nothing is written yet), so that the start is refused by
    check_fits naming the setting, not by the kernel's OSError for a mapping that large."""
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    blocks = 2 * total // (2 * 16 * 64 * 4)  # one layer, one head of 64, float32
    caches = allocate_cache(1, blocks, 1, 16, 64, torch.float32, "cpu")
    assert caches[0][0].shape == (blocks, 1, 16, 64)
    del caches


def test_a_pool_not_fresh_from_allocate_cache_is_written_whole_with_zeros():
    """Tensors of torch's allocator, and a pool taken once and used since: every byte."""
    for caches in (
        [(torch.ones(1024, 4, 16, 64), torch.ones(1024, 4, 16, 64)) for _ in range(2)],
        _pool(),
    ):
        take_cache(caches)
        for pair in caches:
            for t in pair:
                t.fill_(1.0)
        take_cache(caches)
        assert all(not t.any() for pair in caches for t in pair)


def test_by_default_a_small_model_holds_only_what_its_sequences_can_fill(tiny_model_factory):
    """Without kv_cache_memory_gb the pool is 1 GiB, or every sequence at max_model_len where that
    is less: a tiny model's pages are all written at start, and none is idle forever."""
    model_dir = tiny_model_factory(max_position_embeddings=256)
    llm = LLM(str(model_dir), max_num_seqs=8)
    assert llm.engine.num_blocks == 8 * 256 // 16
    assert llm.engine.max_model_len == 256
    bigger = LLM(str(model_dir), max_num_seqs=8, kv_cache_memory_gb=0.01)
    assert bigger.engine.num_blocks > 8 * 256 // 16  # given: as asked, for the prefix cache


# -- /metrics ------------------------------------------------------------------------------------


async def test_metrics_show_the_process_memory_and_the_cache_config(tiny_model_dir):
    async with live_server(tiny_model_dir, num_kv_blocks=64) as server:
        assert await server.metric("process_resident_memory_bytes") > 0
        assert await server.metric("process_virtual_memory_bytes") > 0
        text = (await server.http.get("/metrics")).text
        bytes_ = server.engine.kv_cache_bytes
        assert (
            f'nanoserve:cache_config_info{{block_size="16",cache_bytes="{bytes_}",'
            'cache_dtype="float32",num_gpu_blocks="64"} 1.0' in text
        )


# -- what may be taken: /proc/meminfo and the cgroup files ----------------------------------------


def test_meminfo_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683664 kB\nMemAvailable:   22346068 kB\n")
    assert meminfo_available(meminfo) == 22346068 * 1024
    assert meminfo_available(tmp_path / "absent") is None


def _files(directory: Path, **files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)
    return directory


def test_cgroup_v2_limit_less_usage_without_inactive_page_cache(tmp_path):
    d = _files(tmp_path / "v2", memory_max="4294967296\n", memory_current="1073741824\n",
               memory_stat="anon 536870912\ninactive_file 268435456\nactive_file 1\n")  # fmt: skip
    assert cgroup_headroom(d, 2) == 4 * GiB - (GiB - 256 * MiB)
    _files(d, memory_max="max\n")
    assert cgroup_headroom(d, 2) is None
    assert cgroup_headroom(tmp_path / "absent", 2) is None


def test_cgroup_v1_limit_less_usage_and_its_unlimited_value(tmp_path):
    stat = "cache 100\ninactive_file 7\ntotal_inactive_file 536870912\n"  # hierarchical: total_
    d = _files(tmp_path / "v1", memory_limit_in_bytes="2147483648\n",
               memory_usage_in_bytes="1610612736\n", memory_stat=stat)  # fmt: skip
    assert cgroup_headroom(d, 1) == 2 * GiB - GiB
    _files(d, memory_limit_in_bytes="9223372036854771712\n")
    assert cgroup_headroom(d, 1) is None


def _host(tmp_path: Path, cgroup: str, mounts: list[str]) -> tuple[Path, Path]:
    proc_cgroup, mountinfo = tmp_path / "self_cgroup", tmp_path / "mountinfo"
    proc_cgroup.write_text(cgroup)
    mountinfo.write_text("".join(m.replace("ROOT", str(tmp_path)) + "\n" for m in mounts))
    return proc_cgroup, mountinfo


def test_the_cgroups_that_hold_the_process_own_first_then_its_ancestors(tmp_path):
    """v2: its own directory and each ancestor's up to the mount (a limit may be a parent
    slice's); the tightest one is what may be taken."""
    proc_cgroup, mountinfo = _host(tmp_path, "0::/app.slice/server\n", [
        "31 23 0:28 / ROOT/fs/cgroup rw,relatime - cgroup2 cgroup2 rw",
    ])  # fmt: skip
    mount = tmp_path / "fs" / "cgroup"
    leaf = _files(mount / "app.slice" / "server", memory_max="max\n", memory_current="5\n")
    _files(mount / "app.slice", memory_max=f"{3 * GiB}\n", memory_current=f"{GiB}\n")
    assert cgroup_dirs(proc_cgroup, mountinfo) == [
        (leaf, 2), (mount / "app.slice", 2), (mount, 2),
    ]  # fmt: skip
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {10 * GiB // 1024} kB\n")
    room = headroom(meminfo, proc_cgroup, mountinfo)
    assert room == Headroom(2 * GiB, f"cgroup {mount / 'app.slice'}")


def test_cgroup_v1_memory_hierarchy_and_a_container_that_sees_its_own_as_the_root(tmp_path):
    """v1 is the hierarchy mounted with the memory controller; a container whose mount root is
    its own cgroup (the path in /proc/self/cgroup is the host's) reads the mount itself."""
    proc_cgroup, mountinfo = _host(tmp_path, "5:devices:/docker/abc\n4:memory:/docker/abc\n", [
        "32 31 0:29 / ROOT/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu",
        "35 31 0:32 /docker/abc ROOT/cgroup/memory rw,relatime - cgroup cgroup rw,memory",
    ])  # fmt: skip
    mount = _files(tmp_path / "cgroup" / "memory", memory_limit_in_bytes=f"{GiB}\n",
                   memory_usage_in_bytes=f"{256 * MiB}\n")  # fmt: skip
    assert cgroup_dirs(proc_cgroup, mountinfo) == [(mount, 1)]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {10 * GiB // 1024} kB\n")
    assert headroom(meminfo, proc_cgroup, mountinfo).bytes == 768 * MiB


def test_an_injected_limit_stands_in_for_the_machine(monkeypatch):
    monkeypatch.setenv(LIMIT, str(64 * GiB))
    held = resident_bytes()
    room = headroom()
    assert abs(room.bytes - (64 * GiB - held)) < 64 * MiB  # the limit less what is held now
    assert room.source.startswith(f"{LIMIT}={64 * GiB}")


# A step's activations are freed blocks that glibc's malloc would map afresh each step.
_REUSE = """
import resource, torch
from nanoserve.engine.memory import keep_freed_memory

def faults_of_a_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(10 << 20)  # 40 MiB, freed at once: past glibc's largest mmap threshold
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_a_step()
default = faults_of_a_step()
print(keep_freed_memory(64 << 20))
# The first steps settle the heap: a small block malloc places just past a freed activation
# keeps it from the heap's free top, and the next step's (a little larger, for its alignment)
# grows the heap once more (1 run in 4 here). From then on every step reuses what it freed.
for _ in range(3):
    faults_of_a_step()
print(default, max(faults_of_a_step() for _ in range(3)))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "[always]" in _thp_mode(), reason="glibc, 4 KiB pages"
)
def test_a_steps_freed_activations_are_reused_not_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", _REUSE], capture_output=True, text=True, check=True)
    kept, counts = out.stdout.split("\n", 1)
    default, kept_faults = map(int, counts.split())
    assert kept == "True"
    assert default > 5000  # 10240 pages of 4 KiB, each faulted in again
    assert kept_faults < default / 10
