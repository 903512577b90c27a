"""Whole-ResNet conversion (issue 29 item 2): torchvision-shaped ResNets with BatchNorm statistics."""

from __future__ import annotations

import pytest
import torch

from lightning_dvi.nn import BatchNorm2d, GraphNetwork, from_torch
from lightning_dvi_benchmarks.torch_resnet import preact_resnet18, resnet18, resnet50

F64 = torch.float64


def _with_running_statistics(torch_net, shape):
    """A few train-mode passes on shifted random data (non-trivial running stats), then eval."""
    torch_net = torch_net.to(F64).train()
    with torch.no_grad():
        for _ in range(2):
            torch_net(1.5 * torch.randn(4, *shape, dtype=F64) + 0.5)
    return torch_net.eval()


NETS = {
    "resnet18": (
        lambda: resnet18(num_classes=5, in_channels=1, small_input=True, width=4),
        (1, 8, 8),
    ),
    "resnet18-full-size": (lambda: resnet18(num_classes=10), (3, 32, 32)),
    "resnet50": (
        lambda: resnet50(num_classes=5, in_channels=1, small_input=True, width=2),
        (1, 8, 8),
    ),
    "preact_resnet18": (
        lambda: preact_resnet18(num_classes=5, in_channels=1, small_input=True, width=4),
        (1, 8, 8),
    ),
}


@pytest.mark.parametrize("name", sorted(NETS))
def test_resnet_with_batchnorm_statistics_converts_and_matches_torch(name):
    build, shape = NETS[name]
    torch.manual_seed(0)
    torch_net = _with_running_statistics(build(), shape)
    bn = torch_net.get_submodule("layer1.0.bn1")
    assert float((bn.running_var - 1).abs().max()) > 0.05  # the statistics are not the defaults
    net = from_torch(torch_net, scale_fraction=0.0)
    assert isinstance(net, GraphNetwork)
    assert any(isinstance(m, BatchNorm2d) for m in net.modules())
    x = torch.randn(1, *shape, dtype=F64)
    with torch.no_grad():
        want = torch_net(x)
        diag = net(x, mode="diag")
        sample = net(x, mode="sample", num_samples=1)[0]
    scale = want.abs().max()
    assert float((diag.mean - want).abs().max() / scale) <= 1e-4
    assert float((sample - want).abs().max() / scale) <= 1e-4
    assert float(diag.var.abs().max()) <= 1e-20


def test_resnet_with_posterior_scale_gives_finite_moments_and_gradients():
    build, shape = NETS["resnet18"]
    torch.manual_seed(0)
    net = from_torch(_with_running_statistics(build(), shape), scale_fraction=0.1)
    out = net(torch.randn(2, *shape, dtype=F64), mode="diag")
    assert out.mean.shape == (2, 5) and bool((out.var > 0).all())
    (out.mean.sum() + out.var.sum()).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_residual_error_benchmark_measures_the_dropped_cross_term():
    from lightning_dvi_benchmarks.residual_error import block_error

    e = block_error("basic", "sum", 0.3, channels=2, num_samples=1_000)
    # the independence rule on an identity-shortcut block (docs/moments.md): small but non-zero
    assert 0 < e.dropped_median < 0.2 and e.std_median < 0.1 and e.mean_max < 0.2, e
