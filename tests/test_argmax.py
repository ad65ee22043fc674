"""kernels.argmax, the greedy token of each row (the C kernel on CPU float32), is torch.argmax's
answer: the first largest value, the first NaN where a row has one, at any width and position."""

from __future__ import annotations

import pytest
import torch

from nanoserve import kernels
from nanoserve.kernels import c_backend

pytestmark = pytest.mark.skipif(not c_backend.enabled(), reason="the C kernels are not built")
WIDTHS = (1, 15, 16, 17, 255, 256, 257, 4099, 49152 + 3)


@pytest.mark.parametrize("n", WIDTHS)
def test_random_rows_match_torch(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("n", WIDTHS)
def test_ties_take_the_first(n: int) -> None:
    """The largest value at several places (one chunk, several chunks, the tail): the first."""
    g = torch.Generator().manual_seed(n)
    for places in ([0, n - 1], [n // 2, n - 1], [n - 1], [n // 3, n // 3 + 1, n - 2]):
        places = [p for p in places if 0 <= p < n]
        x = torch.randn(1, n, generator=g).clamp(max=4.0)
        x[0, places] = 5.0
        assert kernels.argmax(x).item() == x.argmax(dim=-1).item() == min(places)


@pytest.mark.parametrize("n", WIDTHS)
def test_nan_wins_as_in_torch(n: int) -> None:
    """torch counts NaN the largest: the first NaN, before or after the largest number."""
    g = torch.Generator().manual_seed(n)
    for nans in ([n - 1], [0], [n // 2, n - 1], [n - 1, n // 4]):
        x = torch.randn(1, n, generator=g)
        x[0, 0] = 10.0
        x[0, nans] = float("nan")
        assert kernels.argmax(x).item() == x.argmax(dim=-1).item() == min(nans)


def test_infinities_and_signed_zeros() -> None:
    rows = torch.tensor(
        [
            [float("-inf")] * 300,
            [float("-inf")] * 299 + [float("inf")],
            [-0.0, 0.0, -1.0] * 100,
            [0.0, -0.0] * 150,
            [-3.0] * 257 + [-2.0] + [-3.0] * 42,
        ]
    )
    assert torch.equal(kernels.argmax(rows), rows.argmax(dim=-1))


def test_other_layouts_and_dtypes() -> None:
    """A strided view is read as its values; float64 and bfloat16 take torch's argmax."""
    x = torch.randn(4, 600)
    assert torch.equal(kernels.argmax(x[:, ::3]), x[:, ::3].argmax(dim=-1))
    for dtype in (torch.float64, torch.bfloat16):
        assert torch.equal(kernels.argmax(x.to(dtype)), x.to(dtype).argmax(dim=-1))
    assert kernels.argmax(torch.empty(0, 5)).shape == (0,)
    with pytest.raises(ValueError, match="logits"):
        kernels.argmax(torch.empty(2, 0))
    with pytest.raises(ValueError, match="logits"):
        kernels.argmax(torch.randn(5))
