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
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import gguf
import llama_cpp as lc
import numpy as np
import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import read_checkpoint

Request = tuple[list[int], int]  # prompt token ids, output tokens wanted


def convert(model_dir: Path, out: Path) -> Path:
    """Write `model_dir` (a Hugging Face Llama checkpoint) to `out` as an f32 GGUF file."""
    cfg = ModelConfig.from_dir(model_dir)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, model_dir, cfg.vocab_size)

    hf = read_checkpoint(model_dir, torch.float32)
    tensors = {
        "token_embd": hf.pop("model.embed_tokens.weight"),
        "output_norm": hf.pop("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:  # tied: llama.cpp reuses token_embd as the output head
        tensors["output"] = hf.pop("lm_head.weight")
    if cfg.rope.rope_type == "llama3":
        tensors["rope_freqs"] = _llama3_rope_factors(cfg)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_layers):
        for hf_name, name in names.items():
            t = hf.pop(f"model.layers.{i}.{hf_name}.weight")
            if name == "attn_q":
                t = _interleave_rope_rows(t, cfg.num_heads)
            elif name == "attn_k":
                t = _interleave_rope_rows(t, cfg.num_kv_heads)
            tensors[f"blk.{i}.{name}"] = t
    if hf:
        raise ValueError(f"tensors left unconverted: {sorted(hf)}")
    for name, t in tensors.items():
        w.add_tensor(f"{name}.weight", t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotates the two halves of each head ([x0..x(d/2-1)] with [x(d/2)..]); llama.cpp rotates
    adjacent pairs. Reorder each head's output rows 0, d/2, 1, d/2+1, ... so they line up."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _llama3_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """Per-frequency divisors of Llama 3.1 RoPE scaling, as llama.cpp's `rope_freqs` tensor."""
    r = cfg.rope
    factors = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * r.theta ** (i / cfg.head_dim)
        if wavelen < r.original_max_position_embeddings / r.high_freq_factor:
            factors.append(1.0)
        elif wavelen > r.original_max_position_embeddings / r.low_freq_factor:
            factors.append(r.factor)
        else:
            smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
                r.high_freq_factor - r.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / r.factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """A "gpt2" (byte-level BPE) vocabulary from tokenizer.json, padded to the model's vocab."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        kind = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        tokens[added["id"]], types[added["id"]] = added["content"], kind
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("bos_token_id") is not None:
        w.add_bos_token_id(config["bos_token_id"])
    eos = config.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(eos if isinstance(eos, int) else eos[0])


def generate(
    model_dir: Path,
    requests: list[Request],
    threads: int = 2,
    max_seqs: int = 64,
    exact: bool = True,
) -> tuple[float, list[list[int]]]:
    """Greedy outputs of all requests through llama.cpp: (seconds of the decode loop, token ids).

    `exact`: an f32 KV cache and no flash attention, so logits match an f32 reference to ~1e-3 (on
    the 25m model; greedy tokens then agree with nanoserve's). Otherwise llama.cpp's defaults, an
    f16 KV cache and flash attention where it sees fit, which put logits ~0.3 off."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load chatter
    lc.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        path = convert(model_dir, Path(tmp) / "model.gguf")
        model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load the GGUF of {model_dir}")
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
    ctx = lc.llama_init_from_model(model, params)
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    try:
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
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
        lc.llama_model_free(model)


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
