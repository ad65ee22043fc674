"""Embedding throughput: nanoserve's pooling engine, sentence-transformers and llama.cpp on the
same random weights, side by side in one run, the same thread count each.

Two models, random, with real models' shapes: BERT-base (12 layers, hidden 768, 12 heads, MLP
3072, vocabulary 30522; mean pooling, normalized) and Qwen3-Embedding-0.6B (28 layers, hidden
1024, 16 query and 8 KV heads of 128, MLP 3072, vocabulary 151669; last-token pooling,
normalized), written by transformers and sentence-transformers (nanoserve.testing); the layer
counts can be cut for time (--bert-layers, --qwen3-layers: the output and JSON say so, and all
engines run the same cut model). The batch: --texts texts of --min-tokens to --max-tokens tokens
(random words, fixed seed), encoded by each engine from the text.

- nanoserve: PoolingEngine, offline, in steps of its default --max-num-batched-tokens. It reads
  the Hugging Face directory (--nanoserve-reads hf, the default) or the very files llama.cpp
  runs (gguf-f32, gguf-f16).
- sentence-transformers: `encode` (batch 32, its default), torch.set_num_threads(--threads).
- llama.cpp: llama-cpp-python's `Llama(..., embedding=True).embed`, on GGUF files f32 and f16
  made by llama.cpp's own converter, pooling as the model's modules say.

Each engine's vectors are checked against sentence-transformers' (cosine) so that the comparison
is of the same computation. Wall-clock and CPU seconds (process time), the median of --repeats
runs after a warm-up. Results: bench/results/embeddings.json and .png, with the CPU's model and
flags and the thread count, and each model's settings and load average (a run of some --models
replaces their rows and keeps the others' where the CPU and threads are the same).

    python -m bench.bench_embeddings [--threads 2] [--texts 256] [--qwen3-layers 28]
                                     [--dtype float32] [--st-dtype bfloat16] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.bench_context import machine

RESULTS = Path(__file__).parent / "results"
BERT_BASE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522, max_position_embeddings=512)  # fmt: skip
QWEN3_06B = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151669, max_position_embeddings=32768,
                 tie_word_embeddings=True)  # fmt: skip
FULL_LAYERS = {"bert-base": 12, "qwen3-embedding-0.6b": 28}
LLAMA_POOLING = {"mean": 1, "cls": 2, "lasttoken": 3}  # llama.cpp's LLAMA_POOLING_TYPE_*


def write_model(name: str, path: Path, layers: int) -> Path:
    from nanoserve.testing.embedding_models import write_bert, write_decoder_embedding

    if name == "bert-base":
        return write_bert(path, "mean", True, num_hidden_layers=layers, **BERT_BASE)
    return write_decoder_embedding(path, num_hidden_layers=layers, **QWEN3_06B)


def make_texts(path: Path, count: int, low: int, high: int, seed: int) -> list[str]:
    """`count` texts of random words, each of a length drawn from [low, high] tokens (by the
    model's own tokenizer, its special tokens included)."""
    from transformers import AutoTokenizer

    from nanoserve.testing.embedding_models import WORDS

    tokenizer = AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target, words = rng.randint(low, high), []
        while len(tokenizer(" ".join(words))["input_ids"]) < target:
            words.append(rng.choice(WORDS))
        texts.append(" ".join(words))
    return texts


def run_nanoserve(model: Path, dtype: str) -> Callable[[list[str]], list[list[float]]]:
    from nanoserve.config import EngineConfig
    from nanoserve.engine import PoolingEngine

    # The engine's steps as a server's: its default --max-num-batched-tokens (2048). Every text
    # in one step (36k tokens) ran 1.3x slower: activations that big fall out of the caches.
    config = EngineConfig(dtype=dtype, max_num_seqs=1024)
    engine = PoolingEngine(model, config)
    print(f"  nanoserve runs in {engine.config.dtype} (--dtype {dtype})", flush=True)

    def embed(texts: list[str]) -> list[list[float]]:
        for i, text in enumerate(texts):
            engine.add_request(str(i), engine.admit_text(text, "input"))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        return [o.data for o in sorted(outputs, key=lambda o: int(o.request_id))]

    return embed


def run_sentence_transformers(
    model: Path, dtype: str = "float32"
) -> Callable[[list[str]], list[list[float]]]:
    from sentence_transformers import SentenceTransformer

    kwargs = {"dtype": getattr(torch, dtype)}
    st = SentenceTransformer(str(model), device="cpu", model_kwargs=kwargs)
    return lambda texts: st.encode(texts, batch_size=32).tolist()


def run_llamacpp(gguf: Path, model: Path, threads: int) -> Callable[[list[str]], list[list[float]]]:
    import llama_cpp as lc
    import llama_cpp.llama_cpp as low  # where Llama() takes its default model parameters from

    from bench.llamacpp import _model_params
    from nanoserve.model import read_pooling

    pooling = read_pooling(model, "cls")
    default_params = low.llama_model_default_params
    low.llama_model_default_params = _model_params  # its AMX buffers off where the CPU has AMX
    try:
        llm = lc.Llama(
            model_path=str(gguf), embedding=True, n_threads=threads, n_threads_batch=threads,
            n_ctx=2048, n_batch=2048, n_ubatch=2048, pooling_type=LLAMA_POOLING[pooling.mode],
            verbose=False,
        )  # fmt: skip
    finally:
        low.llama_model_default_params = default_params
    return lambda texts: llm.embed(texts, normalize=pooling.normalize)


def measure(embed: Callable[[list[str]], list[list[float]]], texts: list[str],
            repeats: int) -> tuple[dict[str, float], torch.Tensor]:  # fmt: skip
    """{wall_s, cpu_s}: the medians of `repeats` runs after a warm-up on a few texts; and the
    vectors."""
    embed(texts[:8])
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        vectors = embed(texts)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}, torch.tensor(
        vectors
    )


def bench_model(name: str, layers: int, args: argparse.Namespace, tmp: Path) -> dict:
    from nanoserve.testing.llamacpp_convert import convert

    model = write_model(name, tmp / name, layers)
    texts = make_texts(model, args.texts, args.min_tokens, args.max_tokens, args.seed)
    pre = "bert-bge" if name == "bert-base" else "qwen2"  # of the random vocabularies
    kinds = ("f32", "f16") if not args.skip_llamacpp or args.nanoserve_reads != "hf" else ()
    ggufs = {t: convert(model, tmp / f"{name}-{t}.gguf", t, pre) for t in kinds}
    reads = model if args.nanoserve_reads == "hf" else ggufs[args.nanoserve_reads[5:]]
    engines = {
        f"nanoserve ({args.nanoserve_reads}, {args.dtype})": partial(run_nanoserve, reads,
                                                                     args.dtype),
        f"sentence-transformers ({args.st_dtype})": partial(run_sentence_transformers, model,
                                                             args.st_dtype),
    }  # fmt: skip
    for t in () if args.skip_llamacpp else ("f32", "f16"):
        engines[f"llama.cpp {t}"] = partial(run_llamacpp, ggufs[t], model, args.threads)
    tokens = sum(len(ids) for ids in _token_ids(model, texts))
    row: dict = {"model": name, "layers": layers, "full_layers": FULL_LAYERS[name],
                 "texts": len(texts), "tokens": tokens, "engines": {}}  # fmt: skip
    vectors = {}
    for engine, make in engines.items():
        times, vectors[engine] = measure(make(), texts, args.repeats)
        row["engines"][engine] = times | {
            "texts_per_s": len(texts) / times["wall_s"],
            "tokens_per_s": tokens / times["wall_s"],
        }
        print(f"  {engine:34s} {times['wall_s']:7.2f} s  cpu {times['cpu_s']:7.2f} s", flush=True)
    oracle = vectors[f"sentence-transformers ({args.st_dtype})"]
    for engine, v in vectors.items():
        cosine = torch.nn.functional.cosine_similarity(v.float(), oracle.float())
        row["engines"][engine]["min_cosine_vs_st"] = round(cosine.min().item(), 6)
    return row


def _token_ids(model: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(texts)["input_ids"]


def print_row(row: dict) -> None:
    cut = "" if row["layers"] == row["full_layers"] else f", cut from {row['full_layers']}"
    print(f"{row['model']} ({row['layers']} layers{cut}): {row['texts']} texts, "
          f"{row['tokens']} tokens")  # fmt: skip
    ours = next(e for name, e in row["engines"].items() if name.startswith("nanoserve"))
    for name, e in row["engines"].items():
        ratio = ours["texts_per_s"] / e["texts_per_s"]
        print(f"  {name:34s} {e['texts_per_s']:8.1f} texts/s {e['tokens_per_s']:9.0f} tokens/s"
              f"  nanoserve x{ratio:5.2f}  cos {e['min_cosine_vs_st']:.6f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--bert-layers", type=int, default=12)
    parser.add_argument("--qwen3-layers", type=int, default=28)
    parser.add_argument("--models", default="bert-base,qwen3-embedding-0.6b")
    parser.add_argument("--dtype", default="auto", help="nanoserve's (float32 or bfloat16)")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--st-dtype", default="float32", choices=["float32", "bfloat16"])
    reads = ["hf", "gguf-f32", "gguf-f16"]  # the HF directory, or llama.cpp's file
    parser.add_argument("--nanoserve-reads", default="hf", choices=reads, help="what it loads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine() | {"threads": args.threads}
    print(json.dumps(info), flush=True)
    layers = {"bert-base": args.bert_layers, "qwen3-embedding-0.6b": args.qwen3_layers}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            print(f"{name}, {layers[name]} layers:", flush=True)
            load = os.getloadavg()
            rows.append(bench_model(name, layers[name], args, Path(tmp)))
            rows[-1] |= {"settings": vars(args), "load_average": [load, os.getloadavg()]}
            print_row(rows[-1])
    out = info | {"rows": kept_rows(info, rows) + rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "embeddings.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(out, RESULTS / "embeddings.png")


def kept_rows(info: dict, rows: list[dict]) -> list[dict]:
    """The rows of the results file that this run did not redo, where it was written on the same
    CPU with the same threads (a run of some --models updates theirs), else none."""
    try:
        old = json.loads((RESULTS / "embeddings.json").read_text())
    except (OSError, ValueError):
        return []
    if any(old.get(k) != info[k] for k in ("cpu", "flags", "threads")):
        return []
    done = {row["model"] for row in rows}
    kept = [row for row in old.get("rows", []) if row["model"] not in done]
    return [{"settings": old.get("settings")} | row for row in kept]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 2.8), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        names = list(row["engines"])
        ax.barh(names, [row["engines"][n]["texts_per_s"] for n in names],
                color=[f"C{i}" for i in range(len(names))])  # fmt: skip
        ax.invert_yaxis()
        ax.set_title(f"{row['model']}, {row['layers']} layers: {row['texts']} texts", fontsize=9)
        ax.set_xlabel("texts per second")
    fig.suptitle(f"{result['cpu']}, {result['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
