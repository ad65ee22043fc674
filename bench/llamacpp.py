"""llama.cpp on bench_engine.py's offline workload, for a column beside nanoserve and transformers.

`convert` writes the Hugging Face Llama checkpoint as an f32 GGUF file (llama.cpp's tensor names,
Q and K rows permuted from rotate-half RoPE to llama.cpp's interleaved pairs, llama3 RoPE scaling
as a `rope_freqs` tensor). `generate` loads it through llama-cpp-python's low-level API (one KV
stream per sequence; f32 KV cache and no flash attention unless exact=False) and runs every
request at once, continuous-batching style: each `llama_decode` call carries one token for every
decoding sequence plus prompt chunks of waiting ones, up to n_batch tokens, with logits only where
a next token is due; greedy argmax, EOS ignored, until each request has its output tokens. A
sequence that finishes frees its slot (at most 64) for the next request. Only that loop is timed;
conversion, loading and a warm-up prefill and decode step are not.

    python -m bench.llamacpp [--requests 8] [--threads 2] [--defaults] [--no-check]

The __main__ times a 25m float32 checkpoint and checks the greedy tokens against nanoserve's.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np

from nanoserve.testing.gguf_writer import write_gguf

Request = tuple[list[int], int]  # prompt token ids, output tokens wanted


def generate(
    model: Path,
    requests: list[Request],
    threads: int = 2,
    max_seqs: int = 64,
    exact: bool = True,
) -> tuple[float, list[list[int]]]:
    """Greedy outputs of all requests through llama.cpp: (seconds of the decode loop, token ids).
    `model`: a GGUF file, or a Hugging Face checkpoint directory (converted to an f32 GGUF).

    `exact`: an f32 KV cache and no flash attention, so logits match an f32 reference to ~1e-3 (on
    the 25m model; greedy tokens then agree with nanoserve's). Otherwise llama.cpp's defaults, an
    f16 KV cache and flash attention where it sees fit, which put logits ~0.3 off."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load chatter
    lc.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        path = model if model.suffix == ".gguf" else write_gguf(model, Path(tmp) / "model.gguf")
        loaded = lc.llama_model_load_from_file(str(path).encode(), _model_params())
    if not loaded:
        raise RuntimeError(f"llama.cpp could not load {model}")
    slots = min(len(requests), max_seqs)
    longest = max(len(p) + n for p, n in requests)
    params = lc.llama_context_default_params()
    params.n_seq_max = slots
    params.n_ctx = slots * (-(-longest // 256) * 256)  # one stream of `longest` tokens per slot
    params.n_batch = params.n_ubatch = 2048
    params.n_threads = params.n_threads_batch = threads
    if exact:
        params.type_k = params.type_v = lc.GGML_TYPE_F32
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(loaded, params)
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    try:
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(loaded))
        prompt = requests[0][0][: params.n_batch]
        _decode(ctx, batch, vocab, [(prompt, 0, 0)])  # warm-up: a prefill and a decode step,
        _decode(ctx, batch, vocab, [(prompt[:1], len(prompt), 0)])
        lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, -1, -1)  # then forgotten
        start = time.perf_counter()
        outputs = _run(ctx, batch, vocab, requests, slots, params.n_batch)
        return time.perf_counter() - start, outputs
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(loaded)


def _model_params() -> lc.llama_model_params:
    """llama.cpp's defaults, but for its AMX weight buffers: llama-cpp-python 0.3.36 segfaults in
    llama_decode with them on the development machine (a VM whose Xeon reports AMX)."""
    params = lc.llama_model_default_params()
    if "amx_int8" in Path("/proc/cpuinfo").read_text():
        params.use_extra_bufts = False
    return params


def run_llamacpp(
    model_dir: Path, requests: list[Request], threads: int = 2, exact: bool = True
) -> float:
    """Seconds llama.cpp takes to decode all `requests` (see `generate`)."""
    return generate(model_dir, requests, threads, exact=exact)[0]


def _run(
    ctx: lc.llama_context_p,
    batch: lc.llama_batch,
    vocab: int,
    requests: list[Request],
    slots: int,
    n_batch: int,
) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in requests]
    waiting = list(range(len(requests)))[::-1]  # pop() takes the next request
    feed: dict[int, tuple[int, list[int], int]] = {}  # slot -> (request, tokens to feed, position)
    free = list(range(slots))[::-1]
    while feed or waiting:
        while free and waiting:
            r = waiting.pop()
            feed[free.pop()] = (r, requests[r][0], 0)
        # Decoding sequences first (one token each), then prompt chunks in the room left.
        order = sorted(feed, key=lambda s: len(feed[s][1]) > 1)
        chunks, owners, room = [], [], n_batch
        for slot in order:
            r, tokens, pos = feed[slot]
            take = tokens[:room]
            if not take:
                break
            room -= len(take)
            done = len(take) == len(tokens)  # the last token of what it has to feed: logits due
            chunks.append((take, pos, slot, done))
            feed[slot] = (r, tokens[len(take) :], pos + len(take))
            if done:
                owners.append(slot)
        wants = [d for *_, d in chunks]
        next_tokens = _decode(ctx, batch, vocab, [(t, p, s) for t, p, s, _ in chunks], wants)
        for slot, token in zip(owners, next_tokens, strict=True):
            r, _, pos = feed[slot]
            outputs[r].append(token)
            if len(outputs[r]) < requests[r][1]:
                feed[slot] = (r, [token], pos)
            else:
                del feed[slot]
                lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), slot, -1, -1)
                free.append(slot)
    return outputs


def _decode(
    ctx: lc.llama_context_p,
    batch: lc.llama_batch,
    vocab: int,
    chunks: list[tuple[list[int], int, int]],
    wants: list[bool] | None = None,
) -> list[int]:
    """One llama_decode of token chunks (tokens, first position, sequence); the argmax of the
    logits after each chunk whose `wants` flag is set (all by default), in chunk order."""
    n = 0
    for c, (tokens, pos, seq) in enumerate(chunks):
        for j, token in enumerate(tokens):
            batch.token[n] = token
            batch.pos[n] = pos + j
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = j == len(tokens) - 1 and (wants is None or wants[c])
            n += 1
    batch.n_tokens = n
    if (err := lc.llama_decode(ctx, batch)) != 0:
        raise RuntimeError(f"llama_decode returned {err}")
    rows = sum(wants) if wants is not None else len(chunks)
    logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(rows, vocab))
    return logits.argmax(axis=1).tolist()


def _nanoserve_outputs(model_dir: Path, requests: list[Request]) -> list[list[int]]:
    from nanoserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32")
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> None:
    from bench.workloads import SHAPES, workload
    from nanoserve.demo import write_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-check", action="store_true", help="skip the nanoserve comparison")
    parser.add_argument("--defaults", action="store_true", help="f16 KV cache, flash attention")
    args = parser.parse_args()
    requests = workload(args.requests)
    output_tokens = sum(n for _, n in requests)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "m", dtype="float32", **SHAPES["25m"])
        seconds, ours = generate(model_dir, requests, args.threads, exact=not args.defaults)
        print(
            f"llama.cpp {lc.__version__}: {len(requests)} requests, {output_tokens} output tokens"
        )
        print(f"{seconds:.2f} s, {output_tokens / seconds:.1f} output tok/s")
        if args.no_check:
            return
        theirs = _nanoserve_outputs(model_dir, requests)
    # Random weights leave near-ties, where f32 rounding may pick the other token.
    differ = {
        r: next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        for r, (a, b) in enumerate(zip(ours, theirs, strict=True))
        if a != b
    }
    same = len(requests) - len(differ)
    print(f"greedy tokens equal to nanoserve's: {same}/{len(requests)} requests entirely")
    for r, i in differ.items():
        print(f"  request {r}: first {i} of {requests[r][1]} tokens agree")


if __name__ == "__main__":
    main()
