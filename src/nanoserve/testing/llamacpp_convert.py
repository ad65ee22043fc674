"""llama.cpp's own converter (`convert_hf_to_gguf.py`) and quantizer (`llama_model_quantize`),
for tests and benchmarks that need GGUF files as the world writes them. The converter ships in
llama-cpp-python's source distribution (under vendor/llama.cpp, with its `conversion` package and
its own copy of gguf-py); `fetch()` downloads that from PyPI once and keeps the Python parts under
the cache directory (NANOSERVE_CACHE). The quantizer is llama.cpp's C library, through the
installed llama-cpp-python (the nox test session builds it: a few minutes the first time). The
nox test session fetches the converter before the tests, which download nothing (those that need
either skip where it is absent).

    python -m nanoserve.testing.llamacpp_convert     # fetch it
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from nanoserve.env import cache_dir

SDIST = "llama-cpp-python==0.3.36"
# llama.cpp's LLAMA_FTYPE_MOSTLY_* of the quantizations people download.
FTYPES = {"Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # under vendor/llama.cpp/


def converter() -> Path | None:
    """The fetched convert_hf_to_gguf.py, or None."""
    script = cache_dir() / "llama.cpp" / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def fetch() -> Path:
    """Download the source distribution (no build) and keep the converter; returns it."""
    if (script := converter()) is not None:
        return script
    target = cache_dir() / "llama.cpp"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", SDIST, "-d", tmp],
            check=True,
        )
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            members = []
            for m in tar.getmembers():
                rest = m.name.partition("/vendor/llama.cpp/")[2]
                if rest and rest.startswith(PARTS) and (m.isfile() or m.isdir()):
                    m.name = rest
                    members.append(m)
            partial = target.with_suffix(".partial")
            tar.extractall(partial, members=members, filter="data")
    partial.rename(target)  # whole or absent
    return target / "convert_hf_to_gguf.py"


# Runs the converter with its pre-tokenizer's name given (sys.argv[1]) instead of recognized
# from a hash of the tokenizer's output, which a random test vocabulary never matches.
_NAMED_PRE = """
import runpy, sys
sys.path.insert(0, sys.argv[2].rsplit("/", 1)[0])
import conversion.base
pre = sys.argv.pop(1)
sys.argv.pop(0)  # "-c": the script's arguments follow its name, as when it is run itself
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model_dir: Path, out: Path, outtype: str = "f32", pre: str | None = None) -> Path:
    """`model_dir` (a Hugging Face checkpoint) written to `out` by llama.cpp's converter.
    `pre`: the pre-tokenizer's name written to the file (e.g. "bert-bge" for a WordPiece
    vocabulary), where the converter would not recognize the tokenizer's."""
    script = converter()
    if script is None:
        raise FileNotFoundError("llama.cpp's converter is not fetched: run fetch() first")
    run = [sys.executable, str(script)] if pre is None else [sys.executable, "-c", _NAMED_PRE, pre,
                                                             str(script)]  # fmt: skip
    done = subprocess.run(
        [*run, str(model_dir), "--outfile", str(out), "--outtype", outtype],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-2000:]}")
    return out


def quantizer_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def quantize(source: Path, out: Path, quant: str, threads: int = 2) -> Path:
    """The GGUF `source` (F32 or F16) quantized to `quant` (a key of FTYPES) by llama.cpp's own
    quantizer, written to `out`; llama.cpp chooses each matrix's format as it does for anyone
    (Q4_K_M: Q4_K, with Q6_K for some, and Q5_0 / Q8_0 where rows are no multiple of 256)."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = threads
    if lc.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize of {source.name} to {quant} failed")
    return out


if __name__ == "__main__":
    print(fetch())
