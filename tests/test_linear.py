import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import c_backend
from nanoserve.model.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 64, 300])
def test_linear_matches_f_linear_on_every_path(dtype, rows):
    """Up to 4 rows: the C GEMV; more: oneDNN on the prepacked weight; the same product."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g).to(dtype)
    x = torch.randn(rows, 160, generator=g).to(dtype)
    layer = Linear(w)
    if torch.backends.mkldnn.is_available():
        assert layer.packed is not None
    expected = F.linear(x.double(), w.double())
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)
    # a non-contiguous input (a column slice) gives the same result
    wide = torch.cat([x, x], dim=1)[:, :160]
    assert torch.equal(layer(wide), out)


@pytest.mark.parametrize("c_module,onednn", [(False, True), (True, False), (False, False)])
def test_linear_paths_are_independent(monkeypatch, c_module, onednn):
    """Without the C module a few rows go to oneDNN; without oneDNN many rows go to F.linear."""
    if c_module and not c_backend.AVAILABLE:
        pytest.skip("C module not built")
    monkeypatch.setattr(c_backend, "AVAILABLE", c_module)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: onednn)
    w = torch.randn(8, 16)
    layer = Linear(w)
    assert layer.gemv == c_module and (layer.packed is not None) == onednn
    for rows in (3, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_float16_weights_use_f_linear():
    layer = Linear(torch.randn(8, 16).half())
    assert layer.packed is None and not layer.gemv
