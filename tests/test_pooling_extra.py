"""Padded max pooling (ResNet's stem) and adaptive average pooling: torch equality and MC oracles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.moments import max_pool2d_diag
from lightning_dvi.nn import AdaptiveAvgPool2d, MaxPool2d, from_torch


def _pixels(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(2, 3, 5, 5, generator=g, dtype=dtype)
    var = (0.5 * torch.rand(2, 3, 5, 5, generator=g, dtype=dtype) + 0.05) ** 2
    return mean, var


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["quadrature", "clark"])
def test_padded_max_pool_at_zero_variance_is_torch(dtype, method):
    mean, _ = _pixels(dtype)
    m, v = max_pool2d_diag(mean, torch.zeros_like(mean), 3, 2, method=method, padding=1)
    torch.testing.assert_close(m, F.max_pool2d(mean, 3, 2, 1))
    assert float(v.abs().max()) <= 1e-12


@pytest.mark.parametrize("method", ["quadrature", "clark"])
def test_padded_max_pool_moments_match_monte_carlo(method):
    mean, var = _pixels(torch.float64)
    m, v = max_pool2d_diag(mean, var, 3, 2, method=method, padding=1)
    torch.manual_seed(1)
    samples = mean + var.sqrt() * torch.randn(50_000, *mean.shape, dtype=torch.float64)
    draws = F.max_pool2d(samples.flatten(0, 1), 3, 2, 1).unflatten(0, (50_000, 2))
    mc_mean, mc_std = draws.mean(0), draws.std(0)
    assert float(((m - mc_mean).abs() / mc_std).max()) < 0.05
    # quadrature is exact; Clark's sequential pairwise rule is exact for two units only
    assert float(((v.sqrt() - mc_std).abs() / mc_std).max()) < (
        0.02 if method == "quadrature" else 0.3
    )


def test_padded_max_pool_gradients_are_finite():
    mean, var = _pixels(torch.float32)
    mean.requires_grad_(True)
    var.requires_grad_(True)
    out = MaxPool2d(3, 2, padding=1)(Gaussian(mean, var=var), mode="diag")
    (out.mean.sum() + out.var.sum()).backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(var.grad).all()
    assert float(mean.grad.abs().sum()) > 0


def test_padding_above_half_the_window_is_refused():
    with pytest.raises(ValueError, match="at most half the window"):
        MaxPool2d(2, padding=2)


@pytest.mark.parametrize(("size", "window"), [(1, (4, 4)), (2, (2, 2)), ((1, None), (4, 1))])
def test_adaptive_avg_pool_is_exact_average_pooling(size, window):
    mean, var = _pixels(torch.float64)
    mean, var = mean[..., :4, :4], var[..., :4, :4]
    out = AdaptiveAvgPool2d(size)(Gaussian(mean, var=var), mode="diag")
    torch.testing.assert_close(out.mean, F.adaptive_avg_pool2d(mean, size))
    # the variance of the mean of k independent pixels: their variances summed, over k^2
    k = window[0] * window[1]
    torch.testing.assert_close(out.var, F.avg_pool2d(var, window, window) * k / k**2)
    torch.manual_seed(1)
    samples = mean + var.sqrt() * torch.randn(50_000, *mean.shape, dtype=torch.float64)
    draws = F.adaptive_avg_pool2d(samples.flatten(0, 1), size).unflatten(0, (50_000, 2))
    assert float(((out.var.sqrt() - draws.std(0)).abs() / draws.std(0)).max()) < 0.02


def test_adaptive_avg_pool_refuses_sizes_that_do_not_divide():
    with pytest.raises(
        ValueError, match=r"output size \(3, 3\) does not divide the input size \(4, 4\)"
    ):
        AdaptiveAvgPool2d(3)(torch.zeros(1, 1, 4, 4), mode="diag")


def test_functional_adaptive_pool_converts():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3, padding=1, bias=False)
            self.fc = nn.Linear(2, 1)

        def forward(self, x):
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.conv(x), 1), 1))

    torch.manual_seed(0)
    torch_net = Net().double()
    net = from_torch(torch_net, scale_fraction=0.0)
    x = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(net(x, mode="diag").mean, torch_net(x))
