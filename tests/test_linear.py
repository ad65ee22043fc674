import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import c_backend
from nanoserve.model.linear import Linear, onednn_packs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 64, 300])
def test_linear_matches_f_linear_on_every_path(dtype, rows):
    """Up to 4 rows: the C GEMV; more: oneDNN on the prepacked weight where this CPU lets oneDNN
    take the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT), F.linear elsewhere; the same product."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g).to(dtype)
    x = torch.randn(rows, 160, generator=g).to(dtype)
    layer = Linear(w)
    assert (layer.packed is not None) == onednn_packs(dtype)
    expected = F.linear(x.double(), w.double())
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)
    # a non-contiguous input (a column slice) gives the same result
    wide = torch.cat([x, x], dim=1)[:, :160]
    assert torch.equal(layer(wide), out)


@pytest.mark.parametrize("c_kernels,onednn", [(False, True), (True, False), (False, False)])
def test_linear_paths_are_independent(monkeypatch, c_kernels, onednn):
    """With the C kernels off a few rows go to oneDNN; without oneDNN many rows go to F.linear."""
    monkeypatch.setattr(c_backend, "ENABLED", c_kernels)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: onednn)
    w = torch.randn(8, 16)
    layer = Linear(w)
    assert layer.gemv == c_kernels and (layer.packed is not None) == onednn
    for rows in (3, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_bfloat16_falls_back_where_onednn_refuses_it():
    """On a CPU whose oneDNN has no native bf16 (capped here to AVX2, as on an EPYC without
    AVX-512), bf16 weights are not packed and many rows go to F.linear, with the same product."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from nanoserve.model.linear import Linear, onednn_packs\n"
        "w = torch.randn(96, 160).bfloat16(); x = torch.randn(64, 160).bfloat16()\n"
        "layer = Linear(w)\n"
        "assert not onednn_packs(torch.bfloat16) and layer.packed is None\n"
        "assert onednn_packs(torch.float32) == (Linear(w.float()).packed is not None)\n"
        "assert torch.equal(layer(x), F.linear(x, w))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_float16_weights_use_f_linear():
    layer = Linear(torch.randn(8, 16).half())
    assert layer.packed is None and not layer.gemv
