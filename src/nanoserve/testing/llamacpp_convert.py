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

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from nanoserve.env import cache_dir

if TYPE_CHECKING:
    from nanoserve.tokenizer import Tokenizer

SDIST = "llama-cpp-python==0.3.36"
# llama.cpp's LLAMA_FTYPE_MOSTLY_* of the quantizations people download.
FTYPES = {"Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
          "MXFP4_MOE": 38}  # fmt: skip
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


# Runs the converter with its tokenizer's pre-tokenizer name given (argv[1]) rather than found by
# the hash of a test text's token ids, which only the vocabularies it lists have.
_NAMED_PRE = """import runpy, sys
script, pre = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
sys.path.insert(0, script.rpartition("/")[0])
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(script, run_name="__main__")
"""


def convert(model_dir: Path, out: Path, outtype: str = "f32", pre: str | None = None) -> Path:
    """`model_dir` (a Hugging Face checkpoint) written to `out` by llama.cpp's converter. `pre`:
    the tokenizer.ggml.pre to write, for a random vocabulary the converter does not recognize
    (a WordPiece one: llama.cpp's BERT tokenizer reads no pre-tokenizer name)."""
    script = converter()
    if script is None:
        raise FileNotFoundError("llama.cpp's converter is not fetched: run fetch() first")
    run = [str(script)] if pre is None else ["-c", _NAMED_PRE, str(script), pre]
    done = subprocess.run(
        [sys.executable, *run, str(model_dir), "--outfile", str(out), "--outtype", outtype],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-2000:]}")
    return out


def smollm2_vocabulary() -> Tokenizer:
    """SmolLM2's tokenizer (the default model's file), whose pre-tokenizer the converter knows:
    the vocabulary of the checkpoints tests and benchmarks convert."""
    from nanoserve.default_model import default_model_path
    from nanoserve.model.gguf_file import GGUFCheckpoint

    return GGUFCheckpoint(default_model_path()).tokenizer()


def write_vocabulary(model_dir: Path, vocab: Tokenizer) -> None:
    """vocab as model_dir's tokenizer, as the converter reads it: tokenizer.json, and a
    tokenizer_config.json naming the fast class (else transformers picks the family's own) and
    SmolLM2's chat markers as BOS and EOS."""
    (model_dir / "tokenizer.json").write_text(vocab.backend_json())
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
               "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (model_dir / "tokenizer_config.json").write_text(json.dumps(special))


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
