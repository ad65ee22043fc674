"""The source stays readable in pieces: no module of src/ over 450 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src" / "nanoserve"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := p.read_text().count("\n")) > MAX_FILE_LINES}  # fmt: skip
    assert not long, f"split these modules: {long}"


def test_no_function_is_over_60_lines():
    long = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(SRC)}:{node.name}"] = lines
    assert not long, f"split these functions: {long}"
