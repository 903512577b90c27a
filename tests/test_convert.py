"""from_torch: conversion of torch Sequentials, MOPED-style posteriors, round trips, errors."""

import pytest
import torch
from torch import nn

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.nn import (
    GELU,
    BayesLinear,
    LeakyReLU,
    ReLU,
    Sequential,
    Sigmoid,
    SiLU,
    Tanh,
    from_torch,
    set_posterior,
)


def _torch_net(dtype=torch.float64):
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Linear(5, 16),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 12), nn.GELU()),
            nn.Linear(12, 12),
            nn.SiLU(),
            nn.Sequential(nn.Linear(12, 8), nn.Tanh()),
            nn.Linear(8, 8),
            nn.Sigmoid(),
            nn.Linear(8, 3),
        )
        .to(dtype)
        .eval()
    )


def test_structure_and_activation_parameters():
    net = from_torch(_torch_net())
    names = [type(m).__name__ for m in net]
    assert names == [
        "BayesLinear", "ReLU", "BayesLinear", "LeakyReLU", "BayesLinear", "GELU",
        "BayesLinear", "SiLU", "BayesLinear", "Tanh", "BayesLinear", "Sigmoid", "BayesLinear",
    ]  # fmt: skip
    assert net[3].negative_slope == pytest.approx(0.2)
    assert isinstance(net[1], ReLU) and isinstance(net[5], GELU) and isinstance(net[7], SiLU)
    assert isinstance(net[9], Tanh) and isinstance(net[11], Sigmoid)
    assert isinstance(net[3], LeakyReLU)
    assert all(p.dtype == torch.float64 for p in net.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["full", "diag"])
def test_zero_scale_round_trip_is_the_torch_network(mode, dtype):
    torch_net = _torch_net(dtype)
    net = from_torch(torch_net, scale_fraction=0.0)
    x = torch.randn(7, 5, dtype=dtype)
    with torch.no_grad():
        out = net(x, mode=mode)
        ref = torch_net(x)
    torch.testing.assert_close(out.mean, ref, rtol=0, atol=1e-6)
    # zero up to the ReLU kernel's variance floor (1e-30 in float64, 1e-24 in float32)
    assert out.var.abs().max().item() <= 1e-20
    if mode == "full":
        assert out.cov.abs().max().item() <= 1e-20
    for layer in net:
        if isinstance(layer, BayesLinear):
            assert layer.weight_scale.abs().max().item() == 0.0
    # the sampling modes draw the same deterministic weights
    torch.testing.assert_close(net(x, mode="sample", num_samples=2)[1], ref, rtol=0, atol=1e-6)


def test_gelu_tanh_round_trip():
    torch_net = nn.Sequential(nn.Linear(3, 6), nn.GELU(approximate="tanh"), nn.Linear(6, 2))
    torch_net = torch_net.double()
    net = from_torch(torch_net, scale_fraction=0.0)
    assert net[1].approximate == "tanh"
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(net(x, mode="full").mean, torch_net(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("transform", ["softplus", "exp"])
def test_moped_scales_are_a_fraction_of_the_weights(transform):
    torch_net = _torch_net()
    with torch.no_grad():
        torch_net[0].weight[0, 0] = 0.0
    net = from_torch(torch_net, scale_fraction=0.05, min_scale=1e-6, scale_transform=transform)
    first = net[0]
    w = torch_net[0].weight.detach()
    expected = (0.05 * w.abs()).clamp_min(1e-6)
    torch.testing.assert_close(first.weight_scale, expected, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(first.weight_loc, w)
    torch.testing.assert_close(first.bias_loc, torch_net[0].bias.detach())
    assert first.weight_scale[0, 0].item() == pytest.approx(1e-6, rel=1e-6)
    assert first.scale_transform == transform


def test_fresh_init_keeps_only_the_architecture():
    torch_net = _torch_net()
    net = from_torch(torch_net, init="fresh", init_scale=0.02)
    assert not torch.allclose(net[0].weight_loc, torch_net[0].weight)
    assert net[0].weight_scale.max().item() == pytest.approx(0.02)


def test_unsupported_layers_are_named_with_their_position():
    bad = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.InstanceNorm1d(4)))
    with pytest.raises(
        NotImplementedError, match=r"layer 3 \(1\.1\): InstanceNorm1d is not supported"
    ):
        from_torch(bad)

    class Custom(nn.Module):  # a module of the user's own: converted by graph (torch.fx)
        def forward(self, x):
            return torch.sin(x)

    with pytest.raises(NotImplementedError, match=r"node 'sin' \(call_function sin\) in 1"):
        from_torch(nn.Sequential(nn.Linear(2, 2), Custom()))


@pytest.mark.parametrize("mode", ["diag", "full"])
def test_cnn_round_trip_with_zero_scale_is_the_torch_network(mode):
    torch.manual_seed(0)
    torch_net = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(3, 2, 3), nn.GELU(), nn.Flatten(), nn.Linear(2, 4),
    ).double()  # fmt: skip
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    net = from_torch(torch_net, scale_fraction=0.0)
    assert [type(m).__name__ for m in net][:3] == ["BayesConv2d", "ReLU", "AvgPool2d"]
    out = net(x, mode=mode)
    torch.testing.assert_close(out.mean, torch_net(x), rtol=0, atol=1e-6)
    assert float(out.var.abs().max()) <= 1e-12


def test_max_pool_converts_and_unsupported_conv_options_are_named():
    torch_net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.MaxPool2d(2), nn.Flatten())
    net = from_torch(torch_net, scale_fraction=0.1)
    assert type(net[1]).__name__ == "MaxPool2d"
    out = net(torch.randn(3, 1, 4, 4), mode="diag")
    assert out.mean.shape == (3, 8) and bool(torch.isfinite(out.var).all())
    with pytest.raises(NotImplementedError, match=r"layer 1 \(0\): Conv2d.*dilation=1"):
        from_torch(nn.Sequential(nn.Conv2d(1, 2, 3, dilation=2)))
    with pytest.raises(NotImplementedError, match="MaxPool2d with ceil_mode=False"):
        from_torch(nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2, ceil_mode=True)))
    with pytest.raises(NotImplementedError, match="AvgPool2d with padding=0"):
        from_torch(nn.Sequential(nn.Conv2d(1, 2, 3), nn.AvgPool2d(2, padding=1)))


def test_bad_options_rejected():
    with pytest.raises(ValueError, match="init"):
        from_torch(_torch_net(), init="moped")
    with pytest.raises(ValueError, match="scale_fraction"):
        from_torch(_torch_net(), scale_fraction=-0.1)
    with pytest.raises(ValueError, match="nothing left"):
        from_torch(nn.Sequential(nn.Dropout()))
    with pytest.raises(TypeError):
        from_torch("not a module")
    layer = BayesLinear(2, 3)
    with pytest.raises(ValueError, match="shape"):
        set_posterior(layer, torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=">= 0"):
        set_posterior(layer, torch.zeros(3, 2), -torch.ones(3, 2))


def test_flatten_converts_image_inputs_in_every_mode():
    torch_net = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    net = from_torch(torch_net, scale_fraction=0.0)
    x = torch.randn(3, 1, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(net(x, mode="diag").mean, torch_net(x))
    assert net(x, mode="sample", num_samples=2).shape == (2, 3, 2)
    assert net(x, mode="local", num_samples=2).shape == (2, 3, 2)


def test_converted_net_plugs_into_the_lightning_modules():
    torch.manual_seed(0)
    reg_net = from_torch(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)))
    model = DVIRegressor(net=reg_net, num_data=10)
    assert tuple(model(torch.randn(3, 4)).mean.shape) == (3, 2)
    clf_net = from_torch(nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 3)))
    clf = DVIClassifier(num_classes=3, net=clf_net, num_data=10, mode="diag")
    assert tuple(clf(torch.randn(3, 4)).mean.shape) == (3, 3)


def test_converted_net_is_a_declared_sequential_and_trains():
    torch.manual_seed(0)
    net = from_torch(nn.Sequential(nn.Linear(2, 8), nn.Sigmoid(), nn.Linear(8, 1)))
    assert isinstance(net, Sequential)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x = torch.randn(16, 2)
    out = net(x, mode="full")
    (out.mean.square().mean() + out.var.mean()).backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())
    opt.step()
