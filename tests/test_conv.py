"""Convolution and pooling moments against Monte Carlo, and the conv modules in every mode.

Tolerances (float64, fixed seeds): Monte Carlo means within 3 standard errors per unit,
variances within 5 % (the MC variance itself has a relative standard error of about
``sqrt(2 / N)``, under 1 % here).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_dvi import DVIClassifier, Gaussian
from lightning_dvi.data import DigitsDataModule
from lightning_dvi.moments import (
    avg_pool2d_diag,
    conv2d_deterministic,
    conv2d_diag,
    conv2d_sample,
    linear_full_from_diag,
    max_of_gaussians,
    max_pool2d_diag,
)
from lightning_dvi.nn import (
    AvgPool2d,
    BayesConv2d,
    BayesLinear,
    Flatten,
    MaxPool2d,
    ReLU,
    Sequential,
    bayes_layers,
    cnn,
    parameter_groups,
)
from lightning_dvi.priors import EmpiricalBayes, named_parameter_groups
from lightning_dvi.propagation import propagation
from tests.helpers import cpu_trainer

DT = torch.float64
N = 40_000


def _assert_mc(samples, mean, var, rel=0.05):
    """Means within 3 standard errors, variances within ``rel`` (relative)."""
    mc_mean, mc_var = samples.mean(0), samples.var(0)
    se = (mc_var / samples.shape[0]).sqrt()
    z = ((mean - mc_mean).abs() / se).max().item()
    assert z < 3.0, f"mean off by {z:.2f} standard errors"
    err = ((var - mc_var).abs() / mc_var).max().item()
    assert err < rel, f"variance off by {100 * err:.2f} %"


def _kernel(gen, c_out, c_in, k):
    w_loc = torch.randn(c_out, c_in, k, k, generator=gen, dtype=DT) / math.sqrt(c_in * k * k)
    w_var = torch.rand(c_out, c_in, k, k, generator=gen, dtype=DT) * 0.1
    b_loc = torch.randn(c_out, generator=gen, dtype=DT) * 0.1
    b_var = torch.rand(c_out, generator=gen, dtype=DT) * 0.05
    return w_loc, w_var, b_loc, b_var


def _sample_conv(gen, h, w_loc, w_var, b_loc, b_var, stride=1, padding=0):
    """Independent of the library: receptive fields by unfold, one weight draw per sample."""
    s, b, c, height, width = h.shape
    k = w_loc.shape[-1]
    w = w_loc + w_var.sqrt() * torch.randn(s, *w_loc.shape, generator=gen, dtype=DT)
    bias = b_loc + b_var.sqrt() * torch.randn(s, *b_loc.shape, generator=gen, dtype=DT)
    cols = F.unfold(h.reshape(s * b, c, height, width), k, padding=padding, stride=stride)
    cols = cols.reshape(s, b, c * k * k, -1)  # [S, B, C k k, L]
    out = torch.einsum("sbil,soi->sbol", cols, w.reshape(s, w.shape[1], -1))
    out = out + bias[:, None, :, None]
    side_h = (height + 2 * padding - k) // stride + 1
    return out.reshape(s, b, -1, side_h, out.shape[-1] // side_h)


@pytest.mark.parametrize(("stride", "padding"), [(1, 1), (2, 0)])
def test_conv2d_diag_matches_monte_carlo(stride, padding):
    gen = torch.Generator().manual_seed(1)
    params = _kernel(gen, 3, 2, 3)
    mean = torch.randn(1, 2, 5, 5, generator=gen, dtype=DT)
    var = torch.rand(1, 2, 5, 5, generator=gen, dtype=DT) * 0.5
    out_mean, out_var = conv2d_diag(mean, var, *params, stride=stride, padding=padding)
    h = mean + var.sqrt() * torch.randn(N, *mean.shape, generator=gen, dtype=DT)
    samples = _sample_conv(gen, h, *params, stride=stride, padding=padding)
    _assert_mc(samples, out_mean, out_var)


def test_conv2d_deterministic_matches_monte_carlo_and_diag_at_zero_variance():
    gen = torch.Generator().manual_seed(2)
    params = _kernel(gen, 2, 2, 3)
    x = torch.randn(1, 2, 4, 4, generator=gen, dtype=DT)
    mean, var = conv2d_deterministic(x, *params, padding=1)
    samples = _sample_conv(gen, x.expand(N, *x.shape).contiguous(), *params, padding=1)
    _assert_mc(samples, mean, var)
    d_mean, d_var = conv2d_diag(x, torch.zeros_like(x), *params, padding=1)
    torch.testing.assert_close((d_mean, d_var), (mean, var))


def test_conv2d_sample_is_one_convolution_per_weight_draw():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 3, 6, 6, generator=gen, dtype=DT)
    w = torch.randn(4, 5, 3, 3, 3, generator=gen, dtype=DT)
    b = torch.randn(4, 5, generator=gen, dtype=DT)
    out = conv2d_sample(x, w, b, stride=2, padding=1)
    loop = torch.stack([F.conv2d(x[s], w[s], b[s], stride=2, padding=1) for s in range(4)])
    torch.testing.assert_close(out, loop)


def test_avg_pool_is_exact():
    gen = torch.Generator().manual_seed(4)
    mean = torch.randn(2, 3, 4, 6, generator=gen, dtype=DT)
    var = torch.rand(2, 3, 4, 6, generator=gen, dtype=DT)
    out_mean, out_var = avg_pool2d_diag(mean, var, 2)
    # by hand: the window's 4 independent units, each weighted 1/4
    win_m = mean.unfold(2, 2, 2).unfold(3, 2, 2)
    win_v = var.unfold(2, 2, 2).unfold(3, 2, 2)
    torch.testing.assert_close(out_mean, win_m.sum((-1, -2)) / 4)
    torch.testing.assert_close(out_var, win_v.sum((-1, -2)) / 16)
    h = mean + var.sqrt() * torch.randn(N, *mean.shape, generator=gen, dtype=DT)
    samples = F.avg_pool2d(h.flatten(0, 1), 2).unflatten(0, (N, 2))
    _assert_mc(samples, out_mean, out_var)


@pytest.mark.parametrize("spread", [0.0, 1.0, 3.0])
def test_max_pool_quadrature_matches_monte_carlo(spread):
    gen = torch.Generator().manual_seed(5)
    n = 200_000  # a maximum dominated by a narrow unit is heavy-tailed: more draws
    mean = spread * torch.randn(1, 3, 4, 4, generator=gen, dtype=DT)
    var = torch.rand(1, 3, 4, 4, generator=gen, dtype=DT) + 0.05
    var[0, 0, 0, 0] = 1e-12  # a (nearly) deterministic unit: a step in the CDF of the maximum
    var[0, 1, :2, :2] = 1e-4  # narrow units beside wide ones
    out_mean, out_var = max_pool2d_diag(mean, var, 2)
    h = mean + var.sqrt() * torch.randn(n, *mean.shape, generator=gen, dtype=DT)
    samples = F.max_pool2d(h.flatten(0, 1), 2).unflatten(0, (n, 1))
    _assert_mc(samples, out_mean, out_var)
    # and the quadrature has converged: 64 nodes against 1000
    ref = max_pool2d_diag(mean, var, 2, points=1000)
    torch.testing.assert_close((out_mean, out_var), ref, rtol=1e-3, atol=1e-8)


def test_clark_is_exact_for_two_units_and_the_default_for_none():
    gen = torch.Generator().manual_seed(6)
    mean = torch.randn(1, 2, 3, 4, generator=gen, dtype=DT)
    var = torch.rand(1, 2, 3, 4, generator=gen, dtype=DT) + 0.1
    clark = max_pool2d_diag(mean, var, (1, 2), method="clark")
    quad = max_pool2d_diag(mean, var, (1, 2))
    torch.testing.assert_close(clark, quad, rtol=1e-6, atol=1e-8)
    h = mean + var.sqrt() * torch.randn(N, *mean.shape, generator=gen, dtype=DT)
    samples = F.max_pool2d(h.flatten(0, 1), (1, 2)).unflatten(0, (N, 1))
    _assert_mc(samples, *clark)


def test_max_of_two_gaussians_limits():
    m1, m2 = torch.tensor([3.0, 0.0], dtype=DT), torch.tensor([-1.0, 0.0], dtype=DT)
    v = torch.zeros(2, dtype=DT)
    mean, var = max_of_gaussians(m1, v, m2, v)  # deterministic: the plain maximum
    torch.testing.assert_close(mean, torch.tensor([3.0, 0.0], dtype=DT))
    torch.testing.assert_close(var, torch.zeros(2, dtype=DT))
    # max(N(0,1), N(0,1)): mean 1/sqrt(pi), variance 1 - 1/pi
    zero, one = torch.zeros(2, dtype=DT), torch.ones(2, dtype=DT)
    mean, var = max_of_gaussians(zero, one, zero, one)
    torch.testing.assert_close(mean, torch.full((2,), 1 / math.sqrt(math.pi), dtype=DT))
    torch.testing.assert_close(var, torch.full((2,), 1 - 1 / math.pi, dtype=DT))


# ---------------------------------------------------------------------------------- modules
def _spread(module):
    with torch.no_grad():
        for layer in bayes_layers(module):
            layer.weight_raw_scale.normal_(-2.0, 0.3)
            if layer.bias_loc is not None:
                layer.bias_raw_scale.normal_(-2.5, 0.3)
                layer.bias_loc.normal_(0, 0.2)
    return module


def test_bayes_conv2d_modes_agree_with_monte_carlo():
    torch.manual_seed(7)
    conv = _spread(BayesConv2d(2, 3, 3, padding=1).double())
    x = torch.randn(2, 2, 5, 5, dtype=DT)
    diag = conv(x, mode="diag")
    full = conv(x, mode="full")
    assert diag.cov is None and full.cov is None  # conv stages stay diagonal in full mode
    torch.testing.assert_close((full.mean, full.var), (diag.mean, diag.var))
    _assert_mc(conv(x, mode="sample", num_samples=N), diag.mean, diag.var)
    _assert_mc(conv(x, mode="local", num_samples=N), diag.mean, diag.var)
    # a Gaussian input: the module is the functional core
    g = Gaussian(x, var=torch.rand_like(x))
    out = conv(g, mode="diag")
    w_loc, w_var, b_loc, b_var = conv._moments()
    ref = conv2d_diag(g.mean, g.var, w_loc, w_var, b_loc, b_var, padding=1)
    torch.testing.assert_close((out.mean, out.var), ref)


def test_pooling_and_flatten_modules_in_every_mode():
    torch.manual_seed(8)
    x = torch.randn(2, 3, 4, 4, dtype=DT)
    g = Gaussian(x, var=torch.rand_like(x))
    for pool, fn in ((AvgPool2d(2), F.avg_pool2d), (MaxPool2d(2), F.max_pool2d)):
        torch.testing.assert_close(pool(x, mode="diag"), fn(x, 2))
        samples = torch.randn(5, 2, 3, 4, 4, dtype=DT)
        torch.testing.assert_close(
            pool.propagate(samples, propagation("sample")),
            fn(samples.flatten(0, 1), 2).unflatten(0, (5, 2)),
        )
        assert pool(g, mode="diag").mean.shape == (2, 3, 2, 2)
    flat = Flatten()(g, mode="diag")
    torch.testing.assert_close((flat.mean, flat.var), (x.reshape(2, 48), g.var.reshape(2, 48)))
    assert Flatten().propagate(torch.zeros(5, 2, 3, 4, 4), propagation("sample")).shape == (
        5,
        2,
        48,
    )


def test_full_mode_lifts_to_full_at_the_first_dense_layer():
    torch.manual_seed(9)
    net = _spread(
        Sequential(
            BayesConv2d(1, 2, 3, padding=1), ReLU(), AvgPool2d(2), Flatten(), BayesLinear(8, 3)
        ).double()
    )
    x = torch.randn(4, 1, 4, 4, dtype=DT)
    full, diag = net(x, mode="full"), net(x, mode="diag")
    assert full.cov.shape == (4, 3, 3)
    diag_pass = propagation("diag")
    h = x
    for layer in net[:4]:
        h = layer.propagate(h, diag_pass)
    dense = net[4]
    ref = linear_full_from_diag(h.mean, h.var, *dense._moments())
    torch.testing.assert_close((full.mean, full.cov), ref)
    torch.testing.assert_close(full.var, diag.var)  # exact on the diagonal
    assert (full.cov - torch.diag_embed(full.var)).abs().max() > 0  # correlated logits


def test_cnn_moments_against_monte_carlo_over_weights():
    """The whole diag network (conv, ReLU, pools, dense) against sampling weights."""
    torch.manual_seed(10)
    for pool in ("avg", "max"):
        net = _spread(cnn(1, 3, image_size=4, channels=[2], hidden=[4], pool=pool).double())
        x = torch.randn(2, 1, 4, 4, dtype=DT)
        out = net(x, mode="diag")
        samples = net(x, mode="sample", num_samples=N)
        mc_mean, mc_sd = samples.mean(0), samples.std(0)
        # the diag approximation drops correlations after the first layer: a loose check
        assert ((out.mean - mc_mean).abs() / mc_sd).max() < 0.1
        assert ((out.var.sqrt() - mc_sd).abs() / mc_sd).max() < 0.1


def test_conv_layers_are_prior_groups():
    net = cnn(1, 10, channels=[4, 8], hidden=[16])
    names = [n for n, _ in named_parameter_groups(net)]
    assert names[:2] == ["layers.0.weight", "layers.0.bias"]
    assert len(parameter_groups(net)) == 8
    prior = EmpiricalBayes(mode="buffer")
    values = prior.refresh(net)
    assert set(values) == set(names)
    assert torch.isfinite(prior.kl(net))
    kl = prior.kl(net)
    kl.backward()
    assert net[0].weight_raw_scale.grad is not None


def test_bad_conv_inputs():
    conv = BayesConv2d(3, 4, 3)
    with pytest.raises(ValueError, match="expected 3 input channels, got 1"):
        conv(torch.zeros(2, 1, 8, 8), mode="diag")
    with pytest.raises(ValueError, match=r"expects an image batch \[B, C, H, W\] \(4-D\)"):
        conv(torch.zeros(2, 64), mode="sample", num_samples=2)
    with pytest.raises(ValueError, match="full-covariance Gaussian"):
        Flatten()(Gaussian(torch.zeros(2, 3), cov=torch.eye(3).expand(2, 3, 3)), mode="full")
    with pytest.raises(ValueError, match="larger than the image"):
        MaxPool2d(4)(torch.zeros(1, 1, 3, 3), mode="diag")
    with pytest.raises(ValueError, match="method must be"):
        MaxPool2d(2, method="exact")
    with pytest.raises(ValueError, match="odd"):
        cnn(1, 10, kernel_size=2)


def test_dvi_classifier_trains_a_cnn_on_digit_images():
    torch.manual_seed(11)
    dm = DigitsDataModule(batch_size=256, images=True)
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape[1:] == (1, 8, 8)
    for mode, extra in (("full", {}), ("diag", {}), ("local", {"num_samples": 2})):
        net = cnn(1, 10, channels=[4], hidden=[16])
        model = DVIClassifier(net=net, in_features=64, mode=mode, lr=1e-2, **extra)
        trainer = cpu_trainer(
            max_epochs=1,
            limit_train_batches=2,
            limit_val_batches=1,
            limit_test_batches=1,
            enable_checkpointing=False,
        )
        trainer.fit(model, dm)
        (result,) = trainer.test(model, dm, verbose=False)
        assert math.isfinite(result["test/nll"])
        probs = model.predict_proba(x[:5])
        torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_image_outputs_stay_diag_in_full_mode():
    x = torch.randn(2, 1, 4, 4)
    for net in (
        BayesConv2d(1, 2, 3, padding=1),
        Sequential(BayesConv2d(1, 2, 3, padding=1), ReLU()),
        Sequential(BayesConv2d(1, 2, 3, padding=1), ReLU(), MaxPool2d(2)),
    ):
        out = net(x, mode="full")
        assert out.cov is None and out.mean.dim() == 4
    flat = Sequential(BayesConv2d(1, 2, 3, padding=1), ReLU(), Flatten())(x, mode="full")
    assert flat.cov.shape == (2, 32, 32)  # a flat output is returned full, as for dense nets


def test_conv_with_weight_values_from_a_front_end_is_the_torch_convolution():
    """A drawn weight (a Pyro sample, the point pass) runs the plain convolution, as in linear."""
    from lightning_dvi.nn.linear import given_weights

    conv = BayesConv2d(1, 2, 3)
    w, b = torch.randn(2, 1, 3, 3), torch.randn(2)
    x = torch.randn(1, 1, 5, 5)
    with given_weights({conv: (w, None, b, None)}):
        out = conv(x, mode="sample", num_samples=1)
    torch.testing.assert_close(out.reshape(1, 2, 3, 3), torch.nn.functional.conv2d(x, w, b))
