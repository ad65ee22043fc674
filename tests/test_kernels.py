"""Paged-attention kernels (nanoserve.kernels): every backend against a float64 reference, batch
invariance, store_kv, argument errors.

Inputs are drawn fresh each run; a failure prints the seed (NANOSERVE_KERNEL_SEED=n reproduces it).
The Triton kernels run compiled on CUDA tensors when there is a GPU, and on CPU tensors only in
Triton's interpreter, which must be switched on (TRITON_INTERPRET=1) before triton is imported:
without it, test_triton_on_cpu_in_interpreter runs those cases in a child process that sets it.
"""

import importlib.util
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch

import nanoserve.kernels as kernels
from nanoserve.kernels import c_backend, torch_ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from nanoserve.kernels import triton_decode

    TRITON_INTERPRETED = triton_decode.INTERPRETED
else:
    TRITON_INTERPRETED = False
# float32 runs with exact (ieee) products on every backend; bf16/fp16 round the output, and the
# Triton kernel also rounds the softmax weights to the cache dtype before its second tl.dot.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def backend_param(device: str, backend: str):
    """pytest.param(device, backend), skipped where that backend cannot run in this process."""
    reason = None
    if backend == "triton" and not HAS_TRITON:
        reason = "triton not installed"
    elif backend == "triton" and device == "cpu" and not TRITON_INTERPRETED:
        reason = "run by test_triton_on_cpu_in_interpreter (TRITON_INTERPRET=1 subprocess)"
    marks = pytest.mark.skip(reason=reason) if reason else ()
    return pytest.param(device, backend, marks=marks, id=f"{device}-{backend}")


ALL_BACKENDS = [
    backend_param(device, backend)
    for device in DEVICES
    for backend in (["torch", "c", "triton"] if device == "cpu" else ["torch", "triton"])
]
KERNELS = [p for p in ALL_BACKENDS if p.values[1] != "torch"]
CPU_BACKENDS = [p for p in ALL_BACKENDS if p.values[0] == "cpu"]


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("NANOSERVE_KERNEL_SEED", random.SystemRandom().randrange(2**31)))
    print(f"NANOSERVE_KERNEL_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale

    def select(self, rows: list[int], own_blocks: bool = False) -> "Case":
        """The same sequences over the same cache: their q, table rows and lengths; own_blocks
        trims the table to the sequences' own blocks."""
        idx = torch.tensor(rows)
        width = self.block_tables.shape[1]
        if own_blocks:
            block_size = self.k_cache.shape[2]
            width = -(-int(self.context_lens[idx].max()) // block_size)
        return Case(
            self.q[idx].contiguous(),
            self.k_cache,
            self.v_cache,
            self.block_tables[idx, :width].contiguous(),
            self.context_lens[idx].contiguous(),
            self.scale,
        )


def make_case(
    gen: torch.Generator,
    lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    logit_scale: float = 1.0,
) -> Case:
    """Random cache and queries; each sequence's blocks are drawn from a shuffled pool, and its
    table row is padded with zeros like the engine's (plus one spare column)."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros((len(lens), max(blocks_per_seq) + 1), dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)])
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((len(lens), num_q_heads, head_dim), generator=gen).to(dtype)
    return Case(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        tables.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        logit_scale / head_dim**0.5,
    )


def reference(case: Case, window: int = 0) -> torch.Tensor:
    """float64 attention, token by token through the block table (no block gathering); window > 0
    attends to a sequence's last `window` tokens only."""
    q, k_cache, v_cache = (t.cpu().double() for t in (case.q, case.k_cache, case.v_cache))
    tables, lens = case.block_tables.cpu().tolist(), case.context_lens.cpu().tolist()
    block_size = k_cache.shape[2]
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for i, n in enumerate(lens):
        first = max(n - window, 0) if window else 0
        blocks = torch.tensor([tables[i][t // block_size] for t in range(first, n)])
        offsets = torch.arange(first, n) % block_size
        k = k_cache[blocks, :, offsets].repeat_interleave(group, dim=1)  # [n, q_heads, head_dim]
        v = v_cache[blocks, :, offsets].repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,thd->ht", q[i], k) * case.scale
        weights = (logits - logits.max(dim=1, keepdim=True).values).exp()
        weights /= weights.sum(dim=1, keepdim=True)
        out[i] = torch.einsum("ht,thd->hd", weights, v)
    return out


def random_lens(gen: torch.Generator, count: int, longest: int, block_size: int) -> list[int]:
    """Mostly odd lengths, plus 1 and an exact multiple of the block size."""
    lens = (torch.randint(1, longest // 2, (count,), generator=gen) * 2 + 1).tolist()
    return [1, block_size * 3, *lens][:count] if count >= 3 else lens


def run(case: Case, backend: str) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # an element the kernel fails to write stays NaN
    result = kernels.paged_attention_decode(*case.args(), out=out, backend=backend)
    assert result is out
    return out


CONFIGS = [  # (num_q_heads, num_kv_heads, head_dim, block_size)
    pytest.param(4, 4, 64, 16, id="mha-d64-b16"),
    pytest.param(8, 2, 128, 8, id="gqa4-d128-b8"),
    pytest.param(32, 8, 64, 32, id="gqa32x8-d64-b32"),
    pytest.param(6, 2, 80, 16, id="gqa3-d80-b16"),
    pytest.param(8, 1, 128, 16, id="mqa8-d128-b16"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", CONFIGS)
def test_decode_matches_float64_reference(
    gen, device, backend, dtype, num_q_heads, num_kv_heads, head_dim, block_size
):
    lens = random_lens(gen, 3, 200, block_size)
    case = make_case(gen, lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device)
    out = run(case, backend)
    torch.testing.assert_close(out.cpu().double(), reference(case), atol=ATOL[dtype], rtol=0)


WINDOW_CASES = [
    pytest.param(*p.values, dtype, marks=p.marks, id=f"{p.id}-{dtype}")
    for p in ALL_BACKENDS
    for dtype in DTYPES
    if p.id != "cpu-triton" or dtype == torch.bfloat16  # the interpreter is slow: one dtype
]


@pytest.mark.parametrize("device,backend,dtype", WINDOW_CASES)
@pytest.mark.parametrize("window", [1, 16, 100, 600])
def test_decode_sliding_window(gen, device, backend, dtype, window):
    """A window attends to the last `window` tokens: shorter, equal to and longer than the
    contexts, one token, a block's worth, and (600) past the Triton kernel's 256-token splits, so
    that whole splits before the window are skipped and the merge starts after them. Blocks wholly
    before the window are NaN: a kernel that read one would say so (a block the window starts in
    is read and masked, and 0 * NaN is NaN, so its tokens stay finite)."""
    lens = [1, 16, 17, 100, 255, 700, 1031]
    case = make_case(gen, lens, 8, 2, 64, 16, dtype, device)
    before = torch.zeros(case.k_cache.shape[0] * 16, dtype=torch.bool)
    for row, n in zip(case.block_tables.cpu().tolist(), lens, strict=True):
        for t in range(max(n - window, 0) // 16 * 16):
            before[row[t // 16] * 16 + t % 16] = True
    slots = before.view(-1, 1, 16, 1).to(device)
    poisoned = replace(
        case,
        k_cache=case.k_cache.masked_fill(slots, float("nan")),
        v_cache=case.v_cache.masked_fill(slots, float("nan")),
    )
    out = torch.full_like(case.q, float("nan"))
    kernels.paged_attention_decode(*poisoned.args(), out=out, backend=backend, window=window)
    expected = reference(case, window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
def test_decode_peaked_softmax(gen, device, backend):
    """Logits of hundreds: a kernel that skipped the running max would overflow exp."""
    case = make_case(gen, [77, 300], 8, 2, 64, 16, torch.float32, device, logit_scale=40.0)
    torch.testing.assert_close(
        run(case, backend).cpu().double(), reference(case), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("device,backend", [p for p in KERNELS if p.values[1] == "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_merges_many_splits(gen, device, backend, dtype):
    """Small splits so that a sequence spans many of them and the merge kernel does real work."""
    case = make_case(gen, [1, 33, 250, 129], 4, 1, 64, 16, dtype, device)
    out = torch.full_like(case.q, float("nan"))
    triton_decode.paged_attention_decode(*case.args(), out, tokens_per_split=32, block_n=16)
    torch.testing.assert_close(out.cpu().double(), reference(case), atol=ATOL[dtype], rtol=0)


INVARIANCE = [
    pytest.param(*p.values, dtype, marks=p.marks, id=f"{p.id}-{dtype}")
    for p in KERNELS
    for dtype in (torch.float32, torch.bfloat16)
    if p.id != "cpu-triton" or dtype == torch.bfloat16  # the interpreter is slow: one dtype
]


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
def test_slots_never_written_are_not_read(gen, device, backend):
    """The KV cache is uninitialized memory: NaN in every slot past a sequence's length (its last
    block's tail, the padding entries' block 0, blocks no one holds) changes nothing."""
    lens = [3, 40, 17]
    case = make_case(gen, lens, 4, 2, 64, 16, torch.float32, device)
    expected = run(case, backend)
    written = torch.zeros(case.k_cache.shape[0] * 16, dtype=torch.bool)
    for row, n in zip(case.block_tables.cpu().tolist(), lens, strict=True):
        for t in range(n):
            written[row[t // 16] * 16 + t % 16] = True
    slots = written.view(-1, 1, 16, 1).to(device)
    poisoned = replace(
        case,
        k_cache=case.k_cache.masked_fill(~slots, float("nan")),
        v_cache=case.v_cache.masked_fill(~slots, float("nan")),
    )
    got = run(poisoned, backend)
    assert torch.isfinite(got).all() and torch.equal(got, expected)


@pytest.mark.parametrize("device,backend", [p for p in KERNELS if p.values[1] == "triton"])
def test_triton_refuses_float32_q_over_a_16_bit_cache(gen, device, backend):
    """The torch and C backends take float32 q and keys with a bfloat16 cache; Triton's kernels
    take the cache's dtype only, and say so rather than convert."""
    case = make_case(gen, [5, 20], 4, 2, 64, 8, torch.bfloat16, device)
    q = case.q.float()
    with pytest.raises(TypeError, match="backend='triton' needs q of the kv cache dtype"):
        kernels.paged_attention_decode(q, *case.args()[1:], backend=backend)
    key = torch.zeros((2, 2, 64), device=device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(TypeError, match="backend='triton' needs key of the kv cache dtype"):
        kernels.store_kv(key, key, case.k_cache, case.v_cache, slots, backend=backend)


@pytest.mark.parametrize("device,backend,dtype", INVARIANCE)
def test_batch_invariance(gen, device, backend, dtype):
    """A sequence's output is bitwise the same alone (with its table trimmed to its own blocks) and
    inside a batch of 33."""
    longest = 2 * 256 + 77  # three of the Triton kernel's 256-token splits
    lens = (torch.randint(1, longest, (33,), generator=gen)).tolist()
    lens[5] = longest
    case = make_case(gen, lens, 4, 1, 64, 16, dtype, device)
    batch = run(case, backend)
    for i in (0, 5, 17, 32):
        alone = run(case.select([i], own_blocks=True), backend)
        assert torch.equal(alone[0], batch[i]), f"sequence {i} (context {lens[i]}) differs"
    pair = run(case.select([32, 5]), backend)
    assert torch.equal(pair, batch[[32, 5]])


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_store_kv_writes_exactly_the_named_slots(gen, device, backend, dtype, slot_dtype):
    num_blocks, num_kv_heads, block_size, head_dim = 6, 2, 8, 64
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[[2, 7]] = -1  # skipped
    key = torch.randn((10, num_kv_heads, head_dim), generator=gen).to(dtype).to(device)
    value = torch.randn((10, num_kv_heads, head_dim), generator=gen).to(dtype).to(device)
    kernels.store_kv(key, value, k_cache, v_cache, slots.to(slot_dtype).to(device), backend=backend)

    expect_k, expect_v = k_before.cpu(), v_before.cpu()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, :, slot % block_size] = key[i].cpu()
            expect_v[slot // block_size, :, slot % block_size] = value[i].cpu()
    assert torch.equal(k_cache.cpu(), expect_k)
    assert torch.equal(v_cache.cpu(), expect_v)


@pytest.mark.parametrize("device,backend", ALL_BACKENDS)
def test_store_then_decode(gen, device, backend):
    """Tokens stored through store_kv are the ones decode attends to."""
    case = make_case(gen, [5, 40], 4, 2, 64, 8, torch.float32, device)
    k_cache, v_cache = torch.zeros_like(case.k_cache), torch.zeros_like(case.v_cache)
    for i, n in enumerate(case.context_lens.tolist()):
        table = case.block_tables[i].cpu()
        slots = torch.tensor([table[t // 8] * 8 + t % 8 for t in range(n)], device=device)
        blocks, offsets = slots // 8, slots % 8
        key = case.k_cache[blocks, :, offsets].contiguous()
        value = case.v_cache[blocks, :, offsets].contiguous()
        kernels.store_kv(key, value, k_cache, v_cache, slots, backend=backend)
    stored = Case(case.q, k_cache, v_cache, case.block_tables, case.context_lens, case.scale)
    torch.testing.assert_close(run(stored, backend), run(case, backend), atol=1e-6, rtol=0)


def _good(gen: torch.Generator) -> dict:
    case = make_case(gen, [5, 20], 4, 2, 64, 8, torch.float32)
    return dict(
        zip(
            ("q", "k_cache", "v_cache", "block_tables", "context_lens", "scale"),
            case.args(),
            strict=True,
        )
    )


BAD_DECODE = [  # (argument, replacement, error, words in the message)
    ("q", lambda a: a["q"].double(), TypeError, "q dtype"),
    ("q", lambda a: a["q"][:, :3].contiguous(), ValueError, "num_q_heads"),
    (
        "q",
        lambda a: a["q"].transpose(0, 1).contiguous().transpose(0, 1),
        ValueError,
        "q must be contiguous",
    ),
    ("q", lambda a: a["q"][0], ValueError, "q must be [num_seqs"),
    ("q", lambda a: a["q"][:, :, :32].contiguous(), ValueError, "head_dim"),
    ("q", lambda a: a["q"].tolist(), TypeError, "q must be a torch.Tensor"),
    ("k_cache", lambda a: a["k_cache"].int(), TypeError, "k_cache dtype"),
    ("v_cache", lambda a: a["v_cache"][:-1].contiguous(), ValueError, "v_cache shape"),
    ("v_cache", lambda a: a["v_cache"].half(), TypeError, "v_cache dtype"),
    ("block_tables", lambda a: a["block_tables"].long(), TypeError, "block_tables dtype"),
    (
        "block_tables",
        lambda a: a["block_tables"][:1].contiguous(),
        ValueError,
        "block_tables has 1",
    ),
    (
        "block_tables",
        lambda a: a["block_tables"][:, :1].contiguous(),
        ValueError,
        "context_lens[1]",
    ),
    ("block_tables", lambda a: a["block_tables"] + 100, ValueError, "block_tables[0, 0]"),
    ("context_lens", lambda a: a["context_lens"].long(), TypeError, "context_lens dtype"),
    ("context_lens", lambda a: a["context_lens"] * 0, ValueError, "context_lens[0] = 0"),
    ("scale", lambda a: float("nan"), ValueError, "scale"),
    ("scale", lambda a: torch.tensor(0.1), TypeError, "scale"),
]


@pytest.mark.parametrize("device,backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "name,bad,error,words", BAD_DECODE, ids=[f"{b[0]}-{b[3]}" for b in BAD_DECODE]
)
def test_decode_rejects_bad_arguments(gen, device, backend, name, bad, error, words):
    args = _good(gen)
    args[name] = bad(args)
    with pytest.raises(error, match=re.escape(words)):
        kernels.paged_attention_decode(**args, backend=backend)


def test_decode_rejects_bad_out_and_backend(gen):
    args = _good(gen)
    with pytest.raises(TypeError, match="out dtype"):
        kernels.paged_attention_decode(**args, out=args["q"].half())
    with pytest.raises(ValueError, match="out shape"):
        kernels.paged_attention_decode(**args, out=args["q"][:1].clone())
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.paged_attention_decode(**args, backend="cuda")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="k_cache is on cuda"):
            kernels.paged_attention_decode(**{**args, "k_cache": args["k_cache"].cuda()})
        with pytest.raises(kernels.BackendUnavailableError, match="needs CPU tensors"):
            cuda_args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
            kernels.paged_attention_decode(**cuda_args, backend="c")


@pytest.mark.parametrize("device,backend", CPU_BACKENDS)
def test_store_kv_rejects_bad_arguments(device, backend):
    cache = torch.zeros((4, 2, 8, 64))
    key = torch.zeros((3, 2, 64))
    slots = torch.tensor([0, 5, -1])
    cases = [
        (dict(key=key.half()), TypeError, "key dtype"),
        (dict(value=key[:, :1].contiguous()), ValueError, "value shape"),
        (dict(slot_mapping=slots.float()), TypeError, "slot_mapping dtype"),
        (dict(slot_mapping=slots[:2]), ValueError, "slot_mapping has 2"),
        (dict(slot_mapping=torch.tensor([0, 32, 1])), ValueError, r"slot_mapping\[1\] = 32"),
        (dict(k_cache=cache[:, :, :, :32]), ValueError, "k_cache must be contiguous"),
    ]
    for change, error, words in cases:
        args = dict(key=key, value=key, k_cache=cache, v_cache=cache.clone(), slot_mapping=slots)
        with pytest.raises(error, match=words):
            kernels.store_kv(**{**args, **change}, backend=backend)


def test_missing_c_module_is_an_error_not_a_fallback(gen, monkeypatch):
    """A source tree whose C kernels were never built: every CPU call says how to build them."""
    monkeypatch.setattr(c_backend, "_C", None)
    case = make_case(gen, [9, 30], 4, 2, 64, 8, torch.float32)
    for backend in ("c", "auto"):
        with pytest.raises(kernels.BackendUnavailableError, match="pip install -e ."):
            kernels.paged_attention_decode(*case.args(), backend=backend)
    x, w = linear_case(gen, 2, 19, 45, torch.float32)
    with pytest.raises(kernels.BackendUnavailableError, match="not built"):
        kernels.small_linear(x, w)
    assert "c" not in kernels.available_backends("cpu")
    out = kernels.paged_attention_decode(*case.args(), backend="torch")  # explicit torch works
    torch.testing.assert_close(out.double(), reference(case), atol=ATOL[torch.float32], rtol=0)


def test_c_kernel_uses_torch_thread_count(gen):
    """The kernel takes torch's thread setting; results do not depend on it."""
    case = make_case(gen, [100, 7, 64, 300], 8, 2, 64, 16, torch.bfloat16)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(run(case, "c"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.skipif(TRITON_INTERPRETED, reason="this process already interprets: ran in-process")
def test_triton_on_cpu_in_interpreter():
    """The Triton kernels on CPU tensors, in a child process where TRITON_INTERPRET=1 is set before
    triton's import (which is when triton decides); this process keeps compiled Triton for CUDA."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # Only these tests, without the project's conftest and pytest settings: they need neither.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "--noconftest"]
    cmd += ["-c", os.devnull, "--rootdir", root, "-k", "cpu-triton"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout


# small_linear: F.linear for M <= 4 rows (the CPU decode GEMV).

LINEAR_SHAPES = [(1, 1), (7, 13), (33, 100), (130, 517), (5, 16), (4, 0), (257, 1536)]


def linear_case(gen, m, n, k, dtype):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return x, w


def assert_linear_close(out, x, w):
    """Within float32 summation error of the float64 reference, plus the output's rounding."""
    ref = x.double() @ w.double().T
    bound = 2e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float((err - bound).max())} over the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
def test_small_linear_matches_float64_reference(gen, dtype, m, n, k):
    x, w = linear_case(gen, m, n, k, dtype)
    assert_linear_close(kernels.small_linear(x, w), x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 5])
def test_small_linear_fills_poisoned_out(gen, dtype, m):
    x, w = linear_case(gen, m, 37, 131, dtype)
    out = torch.full((m, 37), float("nan"), dtype=dtype)
    result = kernels.small_linear(x, w, out=out)
    assert result is out and bool(out.isfinite().all())
    assert_linear_close(out, x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_linear_is_deterministic_and_batch_invariant(gen, dtype):
    """One summation order per out[m, n]: the same bits for any M, row block or thread count."""
    x, w = linear_case(gen, 4, 263, 777, dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.small_linear(x, w)
        torch.set_num_threads(2)
        two = kernels.small_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for m in range(1, 4):
        assert torch.equal(kernels.small_linear(x[:m], w), one[:m])
    for i in range(4):
        assert torch.equal(kernels.small_linear(x[i : i + 1], w), one[i : i + 1])
    assert torch.equal(kernels.small_linear(x[:1], w[5:100]), one[:1, 5:100])


def test_small_linear_with_c_switched_off(gen, monkeypatch):
    monkeypatch.setattr(c_backend, "ENABLED", False)
    x, w = linear_case(gen, 2, 19, 45, torch.float32)
    assert_linear_close(kernels.small_linear(x, w), x, w)


def _linear_args(gen) -> dict:
    x, w = linear_case(gen, 2, 6, 8, torch.float32)
    return dict(x=x, w=w, out=torch.empty(2, 6))


@pytest.mark.parametrize(
    "name,bad,error,words",
    [
        ("x", [[1.0]], TypeError, "x must be a torch.Tensor"),
        ("x", torch.zeros(2, 8, 1), ValueError, r"x must be \[M, K\]"),
        ("x", torch.zeros(8, 2).T, ValueError, "x must be contiguous"),
        ("x", torch.zeros(2, 8, dtype=torch.float16), TypeError, "x dtype must be one of"),
        ("w", torch.zeros(6, 8, dtype=torch.bfloat16), TypeError, "w dtype .* differs from x"),
        ("w", torch.zeros(6), ValueError, r"w must be \[N, K\]"),
        ("w", torch.zeros(8, 6).T, ValueError, "w must be contiguous"),
        ("w", torch.zeros(6, 9), ValueError, "w has K = 9 columns, x has K = 8"),
        ("w", torch.zeros(6, 8, device="meta"), ValueError, "w must be a CPU tensor"),
        ("out", torch.zeros(2, 7), ValueError, "out shape"),
        ("out", torch.zeros(2, 6, dtype=torch.bfloat16), TypeError, "out dtype"),
        ("out", torch.zeros(6, 2).T, ValueError, "out must be contiguous"),
    ],
)
def test_small_linear_rejects_bad_arguments(gen, name, bad, error, words):
    args = _linear_args(gen)
    args[name] = bad
    with pytest.raises(error, match=words):
        kernels.small_linear(**args)


# rms_norm and rope_: one C call each on the CPU, checked against the torch reference.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 37), (40, 512)])
def test_rms_norm_matches_torch(gen, dtype, rows, hidden):
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    expected = torch.empty_like(x)
    torch_ref.rms_norm(x, weight, 1e-5, expected)
    out = torch.full_like(x, float("nan"))
    assert kernels.rms_norm(x, weight, 1e-5, out=out) is out
    # Only the order of the sum of squares differs: float32 agrees to rounding, bf16 to one ulp.
    tol = dict(rtol=2**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_rope_matches_torch_in_place_on_a_column_slice(gen, dtype, rows):
    """RoPE of the q and k heads of a fused q/k/v row (the v heads after them untouched)."""
    heads, kv_heads, head_dim, table = 4, 2, 16, 100
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, table, (rows,), generator=gen)
    angles = torch.rand(table, head_dim // 2, generator=gen) * 6
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    expected = qkv.clone()
    torch_ref.rope_(expected, heads + kv_heads, positions, cos, sin)
    got = qkv.clone()
    q_and_k = got[:, : (heads + kv_heads) * head_dim + 3]  # rows strided, wider than the heads
    kernels.rope_(q_and_k, heads + kv_heads, positions, cos, sin)
    assert torch.equal(got, expected)  # rounded where torch rounds, no fused multiply-adds
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(got[:, v], qkv[:, v])


def test_norm_and_rope_do_not_depend_on_rows_or_threads(gen):
    x = torch.randn(40, 96, generator=gen)
    weight, positions = torch.randn(96, generator=gen), torch.arange(40)
    cos, sin = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            roped = kernels.rope_(x.clone(), 3, positions, cos, sin)
            results.append((kernels.rms_norm(x, weight, 1e-6), roped))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kernels.rms_norm(x[7:8], weight, 1e-6), results[0][0][7:8])
    one_row = kernels.rope_(x[7:8].clone(), 3, positions[7:8], cos, sin)
    assert torch.equal(one_row, results[0][1][7:8])


@pytest.mark.parametrize("with_c", [True, False])
@pytest.mark.parametrize("bad", [8, -1])
def test_rope_rejects_a_position_outside_the_table(gen, monkeypatch, with_c, bad):
    monkeypatch.setattr(c_backend, "ENABLED", with_c)
    qk = torch.randn(2, 32, generator=gen)
    cos = sin = torch.ones(8, 16)
    with pytest.raises(ValueError, match=rf"positions\[1\] = {bad} is outside \[0, 8\)"):
        kernels.rope_(qk, 2, torch.tensor([3, bad]), cos, sin)


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: kernels.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5), "weight must be"),
        (lambda: kernels.rms_norm(torch.zeros(8), torch.zeros(8), 1e-5), r"x must be \[rows"),
        (lambda: kernels.rope_(torch.zeros(2, 8).T, 1, torch.arange(8), *_tables(4)), "qk must"),
        (lambda: kernels.rope_(torch.zeros(2, 8), 3, torch.arange(2), *_tables(4)), "must hold 3"),
        (lambda: kernels.rope_(torch.zeros(2, 8), 2, torch.arange(2.0), *_tables(4)), "positions"),
        (lambda: kernels.rope_(torch.zeros(2, 8), 0, torch.arange(2), *_tables(4)), "at least one"),
        (
            lambda: kernels.rope_(torch.zeros(1, 8).expand(2, 8), 2, torch.arange(2), *_tables(4)),
            "rows overlap",
        ),
        (lambda: kernels.rope_(torch.zeros(2, 8), 1, torch.arange(2), *_tables(3)), "even"),
        (
            lambda: kernels.rope_(torch.zeros(2, 8).double(), 1, torch.arange(2), *_tables(4)),
            "of qk's dtype",
        ),
        (
            lambda: kernels.rms_norm(
                torch.zeros(2, 8), torch.zeros(8), 1e-5, out=torch.zeros(2, 8, device="meta")
            ),
            "out must be",
        ),
    ],
)
def test_norm_and_rope_reject_bad_arguments(call, words):
    with pytest.raises((ValueError, TypeError), match=words):
        call()


def _tables(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(16, head_dim), torch.zeros(16, head_dim)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mul_is_torchs_but_for_the_last_bit(dtype, activation):
    """The C kernel (libm's expf and tanhf) against F.silu(gate) * up and F.gelu(gate,
    approximate="tanh") * up (torch's vectorised exp and tanh)."""
    gate_up = (torch.randn(37, 2 * 300, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    f = torch.nn.functional
    expected = (f.silu(gate) if activation == "silu" else f.gelu(gate, approximate="tanh")) * up
    got = kernels.gated_mul(gate_up, activation)
    assert got.shape == expected.shape and got.dtype == dtype
    # atol: GELU's 1 + tanh cancels for very negative gates, where the two tanh differ most
    torch.testing.assert_close(
        got, expected, rtol=2**-20 if dtype == torch.float32 else 2**-7, atol=2**-16
    )
    row = kernels.gated_mul(gate_up[:1].contiguous(), activation)[0]
    assert torch.equal(row, got[0])  # row invariant
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.gated_mul(gate_up, "relu")
