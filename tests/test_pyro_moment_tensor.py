"""MomentTensor rules, and every refusal of the moment pass (NotImplementedError naming it)."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi import moments as M
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, MomentTensor
from lightning_dvi.pyro.moment_tensor import SampledTensor

pytestmark = pytest.mark.usefixtures("pyro_state")


def _weights(out_f=3, in_f=2, mode="diag", name="w"):
    w = MomentTensor(torch.randn(out_f, in_f), torch.rand(out_f, in_f), mode=mode, sources={name})
    b = MomentTensor(torch.randn(out_f), torch.rand(out_f), mode=mode, sources={name + "b"})
    return w, b


# ----------------------------------------------------------------------------- rules
def test_linear_relu_use_the_shared_moment_formulas():
    x = torch.randn(5, 2)
    w, b = _weights()
    h = F.relu(F.linear(x, w, b))
    mean, var = M.linear_deterministic(x, w.dvi_mean, w.dvi_var, b.dvi_mean, b.dvi_var)
    mean, var = M.relu_diag(mean, var)
    torch.testing.assert_close(h.dvi_mean, mean)
    torch.testing.assert_close(h.dvi_var, var)
    w2, _ = _weights(4, 3, name="w2")
    out = h @ w2.mT  # matmul with an [in, out] weight is a linear layer too
    ref_mean, ref_var = M.linear_diag(mean, var, w2.dvi_mean, w2.dvi_var)
    torch.testing.assert_close(out.dvi_mean, ref_mean)
    torch.testing.assert_close(out.dvi_var, ref_var)
    assert out.dvi_sources == {"w", "wb", "w2"}


def test_plate_expand_and_broadcast_keep_the_variance():
    # The failure this library refuses to repeat: expand under pyro.plate dropping the variance.
    x = torch.randn(5, 2)
    w, b = _weights(1, 2)
    mu = F.linear(x, w, b).squeeze(-1)
    with pyro.validation_enabled(False):
        d = dist.Normal(mu, torch.tensor(0.5)).expand(torch.Size([3, 5]))
    assert isinstance(d.loc, MomentTensor)
    torch.testing.assert_close(d.loc.dvi_var, mu.dvi_var.expand(3, 5))


def test_full_covariance_shape_ops_gather_the_covariance_exactly():
    a = torch.randn(4, 3, 3)
    cov = a @ a.mT
    mt = MomentTensor(torch.randn(4, 3), cov=cov, mode="full")
    sub = mt[1:3, [2, 0]]
    torch.testing.assert_close(sub.dvi_cov, cov[1:3][:, [2, 0]][:, :, [2, 0]])
    assert not sub.dvi_marginal
    big = mt.unsqueeze(0).expand(2, 4, 3)
    torch.testing.assert_close(big.dvi_cov, cov.expand(2, 4, 3, 3))
    mixed = mt.t()  # the last dim now indexes data points: only marginals survive
    assert mixed.dvi_marginal and mixed.dvi_cov is None
    torch.testing.assert_close(mixed.dvi_var, cov.diagonal(dim1=-2, dim2=-1).t())


@pytest.mark.parametrize("mode", ["diag", "full"])
@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.expand(4, 3),
        lambda t: t.expand(-1, 3),
        lambda t: t.view(4, 3),
        lambda t: t.reshape(4, -1),
        lambda t: torch.reshape(t, (4, 3)),
        lambda t: t.contiguous(),
        lambda t: t.clone(),
    ],
)
def test_same_shape_ops_keep_the_moments_as_the_general_gather_does(op, mode):
    # An op that moves no element (the plate's expand of a site already of its batch shape)
    # keeps the moments as they are; the oracle is the general rule's index-probe gather.
    from lightning_dvi.pyro import moment_rules

    a = torch.randn(4, 3, 3, dtype=torch.float64)
    cov = (a @ a.mT).requires_grad_()
    mean = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    head = MomentTensor(mean, cov=cov, mode=mode, sources={"w"})  # a diag-mode head keeps cov
    for marginal in (False, True):
        head.dvi_marginal = marginal and mode == "full"
        fast = op(head)
        original = moment_rules._IDENTITY_IF_SAME_SHAPE
        moment_rules._IDENTITY_IF_SAME_SHAPE = frozenset()
        try:
            general = op(head)
        finally:
            moment_rules._IDENTITY_IF_SAME_SHAPE = original
        assert fast.dvi_marginal == general.dvi_marginal
        assert (fast.dvi_cov is None) == (general.dvi_cov is None)
        assert fast.dvi_sources == general.dvi_sources and fast.dvi_mode is general.dvi_mode
        torch.testing.assert_close(fast.dvi_mean, general.dvi_mean, rtol=0, atol=0)
        torch.testing.assert_close(fast.dvi_var, general.dvi_var, rtol=0, atol=0)
        if general.dvi_cov is not None:
            torch.testing.assert_close(fast.dvi_cov, general.dvi_cov, rtol=0, atol=0)
            # and the gradients through both are the same
            g_fast = torch.autograd.grad(
                fast.dvi_cov.square().sum(), (mean, cov), allow_unused=True
            )
            g_gen = torch.autograd.grad(
                general.dvi_cov.square().sum(), (mean, cov), allow_unused=True
            )
            torch.testing.assert_close(g_fast[1], g_gen[1], rtol=0, atol=0)
    linked = torch.distributions.Categorical(logits=head, validate_args=False)  # log_softmax link
    assert linked.logits.dvi_link == "log_softmax"
    assert op(linked.logits).dvi_link == "log_softmax"


def test_shape_ops_that_change_the_shape_still_gather():
    mt = MomentTensor(torch.randn(4, 3), cov=torch.eye(3).expand(4, 3, 3), mode="full")
    assert mt.expand(2, 4, 3).dvi_cov.shape == (2, 4, 3, 3)
    assert mt.reshape(2, 2, 3).dvi_cov.shape == (2, 2, 3, 3)
    with pytest.raises(RuntimeError):
        mt.expand(5, 3)  # the op's own error, from the general rule


def test_arithmetic_with_constants_and_independent_moments():
    w, b = _weights()
    c = torch.tensor([1.0, -2.0])
    out = 3.0 - (w * c) / 2
    torch.testing.assert_close(out.dvi_mean, 3.0 - w.dvi_mean * c / 2)
    torch.testing.assert_close(out.dvi_var, w.dvi_var * (c / 2) ** 2)
    s = w[:, 0] + b  # different weight sites: independent, variances add
    torch.testing.assert_close(s.dvi_var, w.dvi_var[:, 0] + b.dvi_var)


@pytest.mark.parametrize(
    ("op", "module"),
    [
        (torch.tanh, "Tanh"),
        (torch.sigmoid, "Sigmoid"),
        (F.gelu, "GELU"),
        (F.silu, "SiLU"),
        (F.elu, "ELU"),
        (F.softplus, "Softplus"),
    ],
)
def test_registered_activations_propagate_in_the_moment_pass(op, module):
    """Ops the activation registry knows use the declared module's moments (one interpreter)."""
    from lightning_dvi import Gaussian
    from lightning_dvi import nn as dnn

    x = torch.randn(5, 2)
    w, b = _weights()
    h = op(F.linear(x, w, b))
    mean, var = M.linear_deterministic(x, w.dvi_mean, w.dvi_var, b.dvi_mean, b.dvi_var)
    ref = getattr(dnn, module)()(Gaussian(mean, var=var), mode="diag")
    torch.testing.assert_close(h.dvi_mean, ref.mean)
    torch.testing.assert_close(h.dvi_var, ref.var)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("op", "name"),
    [
        (torch.sin, "sin"),  # (tanh was refused before it was registered as an activation)
        (lambda t: torch.exp(t) + 1.0, "exp"),  # exp is only the link of a Poisson rate
        (lambda t: t.sum(-1), "sum"),
        (lambda t: t > 0, "gt"),
        (lambda t: t * t, "two moment-carrying"),
        (lambda t: torch.sin_(t), "sin_"),  # in-place forms of unregistered ops stay refused
        (lambda t: t.detach(), "detach"),
    ],
)
def test_unknown_ops_raise_naming_the_op(op, name):
    w, _ = _weights()
    with pytest.raises(NotImplementedError, match=name) as info:
        op(w)
    assert "Trace_ELBO" in str(info.value)


def test_dependent_operands_are_refused():
    x = torch.randn(5, 3)
    w, b = _weights(3, 3)
    h = F.relu(F.linear(x, w, b))
    with pytest.raises(NotImplementedError, match=r"weight site\(s\) \['w'\]"):
        F.linear(h, w)  # the same weight twice
    w2, b2 = _weights(3, 3, name="v")
    with pytest.raises(NotImplementedError, match="skip connection"):
        _ = h + F.linear(h, w2, b2)  # a hand-written residual


class Net(PyroModule):
    """Tutorial BNN whose forward pass is chosen per test."""

    def __init__(self, forward_fn, obs_fn=None):
        super().__init__()
        self.l1 = PyroModule[nn.Linear](1, 4)
        self.l1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([4, 1]).to_event(2))
        self.l1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        self.l2 = PyroModule[nn.Linear](4, 4)
        self.l2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([4, 4]).to_event(2))
        self.l2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        self.forward_fn = forward_fn
        self.obs_fn = obs_fn or (lambda mu: dist.Normal(mu, 0.5))

    def forward(self, x, y=None):
        mu = self.forward_fn(self, x)[..., 0]
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", self.obs_fn(mu), obs=y)
        return mu


def _dvi_loss(model, mode="diag"):
    x, y = torch.randn(8, 1), torch.randn(8)
    guide = DeterministicGuide(model, mode=mode)
    return DeterministicELBO().loss(model, guide, x, y)


@pytest.mark.parametrize(
    ("forward_fn", "obs_fn", "match"),
    [
        (lambda m, x: m.l2(torch.sin(m.l1(x))), None, "sin"),
        (lambda m, x: m.l2(torch.relu(m.l2(torch.relu(m.l1(x))))), None, "l2.weight"),
        (lambda m, x: (h := torch.relu(m.l1(x))) + m.l2(h), None, "skip connection"),
        (
            lambda m, x: m.l2(torch.relu(m.l1(x))),
            lambda mu: dist.StudentT(3.0, mu, 1.0),
            "StudentT",
        ),
        (
            lambda m, x: m.l2(torch.relu(m.l1(x))),
            lambda mu: dist.Normal(torch.zeros(8), torch.relu(mu) + 0.1),
            "scale depends on the network",
        ),
    ],
)
def test_unsupported_models_raise_naming_the_op_or_site(forward_fn, obs_fn, match):
    with pytest.raises(NotImplementedError, match=match):
        _dvi_loss(Net(forward_fn, obs_fn))
    # ... while Trace_ELBO, which samples, still handles the same model.
    x, y = torch.randn(8, 1), torch.randn(8)
    model = Net(forward_fn, obs_fn)
    assert torch.isfinite(torch.tensor(Trace_ELBO().loss(model, AutoNormal(model), x, y)))


def test_full_mode_refuses_a_layer_after_covariance_was_dropped():
    fwd = lambda m, x: m.l2(torch.relu(m.l1(x)).t().t())  # noqa: E731
    assert torch.isfinite(torch.tensor(_dvi_loss(Net(fwd), mode="diag")))
    with pytest.raises(NotImplementedError, match="dropped"):
        _dvi_loss(Net(fwd), mode="full")


def test_other_guides_discrete_latents_and_bad_modes_are_refused():
    model = Net(lambda m, x: m.l2(torch.relu(m.l1(x))))
    x, y = torch.randn(8, 1), torch.randn(8)
    svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), DeterministicELBO())
    with pytest.raises(NotImplementedError, match="DeterministicGuide"):
        svi.step(x, y)

    def discrete(x, y=None):
        pyro.sample("k", dist.Bernoulli(0.5))

    with pytest.raises(ValueError, match="discrete"):  # Pyro's own AutoNormal message
        DeterministicGuide(discrete)(x)
    with pytest.raises(ValueError, match="mode"):
        DeterministicGuide(model, mode="sample")


def _laplace_weights(m):
    m.l1.weight = PyroSample(dist.Laplace(0.0, 1.0).expand([4, 1]).to_event(2))
    return m


def test_a_layer_of_sampled_weights_is_refused():
    # A non-Normal weight prior (or a Normal one listed in sampled_sites) would be sampled, not
    # integrated: refused rather than quietly turning the objective back into Monte Carlo.
    fwd = lambda m, x: m.l2(torch.relu(m.l1(x)))  # noqa: E731
    x, y = torch.randn(8, 1), torch.randn(8)
    model = _laplace_weights(Net(fwd))
    with pytest.raises(NotImplementedError, match="non-Normal prior"):
        DeterministicELBO().loss(model, DeterministicGuide(model), x, y)
    model = Net(fwd)
    guide = DeterministicGuide(model, sampled_sites=["l2.bias"])
    with pytest.raises(NotImplementedError, match="sampled_sites"):
        DeterministicELBO().loss(model, guide, x, y)
    with pytest.raises(ValueError, match="not found"):
        DeterministicGuide(model, sampled_sites=["nope"])(x, y)


@pytest.mark.parametrize("op", ["linear", "conv2d"])
def test_a_sampled_weight_is_refused_on_a_plain_input(op):
    # The first layer sees the data (a plain tensor): its sampled weight must still be refused.
    if op == "linear":
        x, w = torch.randn(4, 3), torch.randn(2, 3).as_subclass(SampledTensor)
        call = lambda: F.linear(x, w)  # noqa: E731
    else:
        x, w = torch.randn(4, 1, 5, 5), torch.randn(2, 1, 3, 3).as_subclass(SampledTensor)
        call = lambda: F.conv2d(x, w)  # noqa: E731
    with pytest.raises(NotImplementedError, match="non-Normal prior"):
        call()


def test_non_centred_hierarchical_scale_is_integrated_exactly():
    # w = tau * w_raw with tau ~ HalfNormal sampled and w_raw ~ Normal integrated: allowed,
    # since given tau the layer is still Gaussian.
    def model(x, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        w = tau * pyro.sample("w_raw", dist.Normal(0.0, 1.0).expand([3, 1]).to_event(2))
        v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        mu = F.linear(torch.relu(F.linear(x, w)), v).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mu, 0.5), obs=y)

    x, y = torch.randn(8, 1), torch.randn(8)
    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), DeterministicELBO())
    assert all(torch.isfinite(torch.tensor(svi.step(x, y))) for _ in range(5))
    assert guide.weight_sites == ("w_raw", "v")


# ----------------------------------------------------------------------------- convolutions
def test_conv2d_and_avg_pool_use_the_conv_moment_formulas():
    x = torch.randn(2, 1, 6, 6)
    w = MomentTensor(torch.randn(3, 1, 3, 3), torch.rand(3, 1, 3, 3), mode="diag", sources={"w"})
    b = MomentTensor(torch.randn(3), torch.rand(3), mode="diag", sources={"b"})
    h = F.avg_pool2d(torch.relu(F.conv2d(x, w, b, padding=1)), 2)
    mean, var = M.conv2d_deterministic(x, w.dvi_mean, w.dvi_var, b.dvi_mean, b.dvi_var, 1, 1)
    mean, var = M.avg_pool2d_diag(*M.relu_diag(mean, var), 2)
    torch.testing.assert_close(h.dvi_mean, mean)
    torch.testing.assert_close(h.dvi_var, var)
    with pytest.raises(NotImplementedError, match="conv2d"):
        F.conv2d(x, w, b, groups=1, dilation=2)


def test_pyro_cnn_trains_with_the_deterministic_guide():
    """Issue 13: PyroModule[nn.Conv2d] with Normal priors in diag mode."""

    class CNN(PyroModule):
        def __init__(self):
            super().__init__()
            self.conv = PyroModule[nn.Conv2d](1, 2, 3, padding=1)
            self.conv.weight = PyroSample(dist.Normal(0.0, 1.0).expand([2, 1, 3, 3]).to_event(4))
            self.conv.bias = PyroSample(dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            self.fc = PyroModule[nn.Linear](2 * 2 * 2, 3)
            self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 8]).to_event(2))
            self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))

        def forward(self, x, y=None):
            h = F.avg_pool2d(torch.relu(self.conv(x)), 2).flatten(1)
            logits = self.fc(h)
            with pyro.plate("data", x.shape[0]):
                return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    pyro.set_rng_seed(0)
    x, y = torch.randn(16, 1, 4, 4), torch.randint(0, 3, (16,))
    model = CNN()
    guide = DeterministicGuide(model, mode="diag")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), loss=DeterministicELBO())
    losses = [svi.step(x, y) for _ in range(30)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert DeterministicELBO().loss(model, guide, x, y) == DeterministicELBO().loss(
        model, guide, x, y
    )
