"""Run by `nox -s install_check` in a virtual environment holding nanoserve and its runtime
dependencies only: every module imports (but the Triton kernel, which is the `triton` extra's and
is imported only where triton is), and the test helpers say which extra they need."""

import importlib
import pkgutil
import subprocess
import sys

import nanoserve

TEST_ONLY = ("httpx", "openai", "transformers", "pytest", "hypothesis", "importlinter", "triton")
BEHIND_EXTRAS = ("nanoserve.testing", "nanoserve.kernels.triton_decode")


def main() -> None:
    for name in TEST_ONLY:
        if importlib.util.find_spec(name) is not None:
            sys.exit(f"{name} is installed: this check needs an environment without test extras")
    imported = []
    for module in pkgutil.walk_packages(nanoserve.__path__, "nanoserve."):
        if module.name.startswith(BEHIND_EXTRAS):
            continue
        importlib.import_module(module.name)
        imported.append(module.name)
    try:
        importlib.import_module("nanoserve.testing")
    except ImportError as e:
        assert "pip install 'nanoserve[test]'" in str(e), e
    else:
        sys.exit("nanoserve.testing imported without httpx")
    help_text = subprocess.run(["nanoserve", "serve", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "--port" in help_text.stdout, help_text.stderr
    print(f"{len(imported)} modules import with the runtime dependencies alone")


if __name__ == "__main__":
    main()
