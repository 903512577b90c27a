"""The propagation value (issue 40 item 2): one table, one check, and layers that derive sampling.

``lightning_dvi.propagation`` resolves the shorthand strings once; ``WeightLayer`` derives the
``sample``/``local`` modes and the front-ends' substituted weights from a layer's moments and its
given-weights path, for every weight layer alike (the convolution included).
"""

from __future__ import annotations

import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import (
    BayesConv2d,
    BayesLinear,
    BayesLinearFullCov,
    WeightLayer,
    given_weights,
    mlp,
)
from lightning_dvi.objective import elbo
from lightning_dvi.priors import GaussianPrior
from lightning_dvi.propagation import (
    DIAG,
    FULL,
    MomentPass,
    SamplePass,
    moment_propagation,
    propagation,
    sample_propagation,
)

F64 = torch.float64


def test_the_table_resolves_each_shorthand_once():
    assert propagation("full") is FULL and propagation("diag") is DIAG
    assert propagation("sample") == SamplePass(1)
    assert propagation("local", 4) == SamplePass(4, local=True)
    assert propagation("sample", 3) is propagation("sample", 3)  # one object: compile reuses it
    value = SamplePass(2, local=True)
    assert propagation(value) is value and propagation(value, 2) is value
    # a value equals its shorthand, so a layer written against the strings keeps working
    assert value == "local" and value != "sample" and FULL == "full" and DIAG != "full"
    assert {"diag": 1}[DIAG] == 1
    assert (FULL.full, FULL.diag, FULL.samples, DIAG.diag, value.samples, value.local) == (
        True,
        False,
        False,
        True,
        True,
        True,
    )
    assert SamplePass(3).closed_form() is FULL and DIAG.closed_form() is DIAG
    assert DIAG.draws(5) == SamplePass(5) and value.draws(7) == SamplePass(7, local=True)


@pytest.mark.parametrize(
    ("mode", "num_samples", "message"),
    [
        ("exact", None, "unknown mode 'exact'; expected one of full, diag, sample, local"),
        ("full", 2, "num_samples is only used by mode='sample'/'local', not 'full'"),
        ("sample", 0, "num_samples must be a positive int, got 0"),
        ("local", True, "num_samples must be a positive int, got True"),
        ("sample", 2.0, "num_samples must be a positive int, got 2.0"),
        (SamplePass(2), 3, "num_samples is set by the propagation"),
    ],
)
def test_the_pair_is_checked_in_one_place_with_one_message(mode, num_samples, message):
    with pytest.raises(ValueError, match=message):
        propagation(mode, num_samples)
    net = mlp(2, [3], 1)  # every entry point says the same
    with pytest.raises(ValueError, match=message):
        net(torch.randn(2, 2), mode=mode, num_samples=num_samples)
    with pytest.raises(ValueError, match=message):
        elbo(net, HeteroscedasticGaussian(), GaussianPrior(1.0), torch.randn(2, 2),
             torch.randn(2), num_data=2, mode=mode, num_samples=num_samples)  # fmt: skip
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        SamplePass(-1)
    with pytest.raises(ValueError, match="storage must be 'full' or 'diag'"):
        MomentPass("sample")  # type: ignore[arg-type]


def test_moment_and_sample_only_entry_points():
    assert moment_propagation("diag") is DIAG
    with pytest.raises(ValueError, match="mode must be 'diag' or 'full' here, got 'local'"):
        moment_propagation("local", " here")
    assert sample_propagation("local") == SamplePass(1, local=True)
    with pytest.raises(ValueError, match="sample_mode must be 'sample' or 'local', got 'full'"):
        sample_propagation("full", "sample_mode")


def test_a_value_and_its_shorthand_run_the_same_pass():
    torch.manual_seed(0)
    net = mlp(3, [5], 2).double()
    x = torch.randn(4, 3, dtype=F64)
    for mode in ("full", "diag"):
        a, b = net(x, mode=mode), net(x, mode=propagation(mode))
        assert torch.equal(a.mean, b.mean) and torch.equal(a.var, b.var)
    for mode in ("sample", "local"):
        torch.manual_seed(1)
        a = net(x, mode=mode, num_samples=3)
        torch.manual_seed(1)
        assert torch.equal(a, net(x, mode=propagation(mode, 3)))


def _layers():
    torch.manual_seed(0)
    full_cov = BayesLinearFullCov(3, 2).double()
    with torch.no_grad():
        full_cov.tril.normal_(0.0, 0.1)
    return {
        "linear": (BayesLinear(3, 2).double(), (5, 3)),
        "conv": (BayesConv2d(2, 3, 3, padding=1).double(), (5, 2, 4, 4)),
        "full_cov": (full_cov, (5, 3)),
    }


@pytest.mark.parametrize("kind", ["linear", "conv", "full_cov"])
def test_every_weight_layer_takes_substituted_values_in_every_mode(kind):
    layer, shape = _layers()[kind]
    assert isinstance(layer, WeightLayer)
    x = torch.randn(*shape, dtype=F64)
    weight = torch.randn_like(layer.weight_loc)
    bias = torch.randn_like(layer.bias_loc)
    values = {layer: {"weight": (weight, None), "bias": (bias, None)}}
    if kind == "conv":
        want = torch.nn.functional.conv2d(x, weight, bias, padding=1)
    else:
        want = x @ weight.T + bias
    with given_weights(values):
        for mode in ("full", "diag"):
            torch.testing.assert_close(layer(x, mode=mode), want)
        for mode in ("sample", "local"):
            torch.testing.assert_close(
                layer(x, mode=mode, num_samples=2), want.expand(2, *want.shape)
            )


@pytest.mark.parametrize("kind", ["linear", "conv", "full_cov"])
def test_every_weight_layer_draws_from_substituted_moments(kind):
    # the Pyro guide's moments replace the layer's own posterior in every mode, sampling included
    layer, shape = _layers()[kind]
    x = torch.randn(*shape, dtype=F64)
    loc, var = torch.randn_like(layer.weight_loc), 0.01 * torch.rand_like(layer.weight_loc)
    b_loc, b_var = torch.randn_like(layer.bias_loc), 0.01 * torch.rand_like(layer.bias_loc)
    with given_weights({layer: {"weight": (loc, var), "bias": (b_loc, b_var)}}):
        ref = layer(x, mode="diag")
        assert isinstance(ref, Gaussian)
        for mode in ("sample", "local"):
            torch.manual_seed(0)
            f = layer(x, mode=mode, num_samples=20_000)
            tol = 5 * (ref.var / 20_000).sqrt() + 1e-12
            assert bool(((f.mean(0) - ref.mean).abs() < tol).all()), mode
            torch.testing.assert_close(f.var(0), ref.var, rtol=0.1, atol=1e-6)


def test_the_derived_local_draw_has_finite_gradients_at_zero_variance():
    # a zero input to a layer without bias: the output's variance is exactly 0, its draw the mean
    torch.manual_seed(0)
    layer = BayesLinear(2, 3, bias=False).double()
    out = layer(torch.zeros(4, 2, dtype=F64), mode="local", num_samples=2)
    assert out.abs().max() < 1e-150  # sqrt of the clamp at the smallest normal float
    out.sum().backward()
    assert bool(torch.isfinite(layer.weight_raw_scale.grad).all())
    assert bool(torch.isfinite(layer.weight_loc.grad).all())
