"""The Pyro front-end fails where Trace_ELBO fails, naming the site (issue 18, item 5)."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.pyro import Categorical, DeterministicELBO, DeterministicGuide

pytestmark = pytest.mark.usefixtures("pyro_state")


class Net(PyroModule):
    def __init__(self, d_in=2, d_out=1):
        super().__init__()
        self.l1 = PyroModule[nn.Linear](d_in, 8)
        self.l1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([8, d_in]).to_event(2))
        self.l1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([8]).to_event(1))
        self.l2 = PyroModule[nn.Linear](8, d_out)
        self.l2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, 8]).to_event(2))
        self.l2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def regression(net):
    def model(x, y=None):
        mean = net(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)

    return model


def test_nan_in_obs_raises_naming_the_site_like_trace_elbo():
    model = regression(Net())
    x, y = torch.randn(10, 2), torch.randn(10)
    y[3] = float("nan")
    with pytest.raises(ValueError, match="site 'obs'"):  # Pyro's own behaviour
        Trace_ELBO().loss(model, AutoNormal(model), x, y)
    with pytest.raises(ValueError, match=r"site 'obs'.*NaN"):
        DeterministicELBO().loss(model, DeterministicGuide(model), x, y)


def test_obs_of_shape_n_by_1_against_a_mean_of_shape_n_raises():
    model = regression(Net())
    x, y = torch.randn(10, 2), torch.randn(10, 1)
    with pytest.raises(ValueError, match="shape"):  # Pyro's own behaviour
        Trace_ELBO().loss(model, AutoNormal(model), x, y)
    with pytest.raises(ValueError, match=r"site 'obs'.*invalid obs shape \(10, 1\)"):
        DeterministicELBO().loss(model, DeterministicGuide(model), x, y)


def test_validation_can_be_switched_off_as_in_pyro():
    model = regression(Net())
    x, y = torch.randn(10, 2), torch.randn(10, 1)
    with pyro.validation_enabled(False):
        DeterministicELBO().loss(model, DeterministicGuide(model), x, y)  # broadcasts, as Pyro


def classifier(net, likelihood):
    def model(x, y=None):
        logits = net(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", likelihood(logits=logits), obs=y)

    return model


@pytest.mark.parametrize("mode", ["diag", "full"])
def test_plain_pyro_categorical_with_logits_works_in_the_moment_pass(mode):
    net = Net(2, 3)
    x, y = torch.randn(12, 2), torch.randint(0, 3, (12,))
    plain, ours = classifier(net, dist.Categorical), classifier(net, Categorical)
    guide = DeterministicGuide(plain, mode=mode, init_scale=0.3)
    loss = DeterministicELBO().loss(plain, guide, x, y)
    # The library's Categorical (the delta-method closed form) with the same posterior.
    assert loss == pytest.approx(DeterministicELBO().loss(ours, guide, x, y), rel=1e-6)
    svi = SVI(plain, guide, pyro.optim.Adam({"lr": 0.05}), DeterministicELBO())
    losses = [svi.step(x, y) for _ in range(30)]
    assert losses[-1] < losses[0]


def test_log_softmax_logits_and_misuse_of_normalised_logits():
    net = Net(2, 3)
    x, y = torch.randn(12, 2), torch.randint(0, 3, (12,))

    def model(x, y=None):
        logits = torch.log_softmax(net(x), dim=-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    guide = DeterministicGuide(model, init_scale=0.3)
    ours = classifier(net, Categorical)
    assert DeterministicELBO().loss(model, guide, x, y) == pytest.approx(
        DeterministicELBO().loss(ours, guide, x, y), rel=1e-6
    )

    def misuse(x, y=None):
        logits = net(x)
        return (logits - logits.logsumexp(-1, keepdim=True)) * 2

    with pytest.raises(NotImplementedError, match="log_softmax"):
        DeterministicELBO().loss(misuse, DeterministicGuide(misuse), x, y)


@pytest.mark.parametrize("positive", [torch.exp, torch.nn.functional.softplus])
def test_exp_noise_scale_names_the_heteroscedastic_likelihood(positive):
    """exp is refused as an op; softplus (a registered activation) at the observed site."""
    net = Net(2, 2)

    def model(x, y=None):
        out = net(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(out[..., 0], positive(out[..., 1])), obs=y)

    x, y = torch.randn(10, 2), torch.randn(10)
    with pytest.raises(NotImplementedError, match="HeteroscedasticGaussian"):
        DeterministicELBO().loss(model, DeterministicGuide(model), x, y)


def test_pyro_md_lightning_example_sets_module_local_params_first():
    # issue 18 item 7: the Lightning-style example must run as written and set
    # module_local_params before any PyroModule is built.
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "pyro.md").read_text()
    section = doc[doc.index("Lightning style") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "before the model and the guide" in section[: section.index("```python")]
    setting = code.index("pyro.settings.set(module_local_params=True)")
    assert setting < code.index("PyroModule[") and setting < code.index("DeterministicGuide(")
    namespace: dict = {}
    try:
        exec(compile(code, "docs/pyro.md", "exec"), namespace)
    finally:
        pyro.settings.set(module_local_params=False)
    assert torch.isfinite(namespace["loss"])


def _rows_model(net):
    """A regression whose mean follows the input: [N] for x [N, 2], [N, 1] for x [N, 1, 2]."""

    def model(x, y=None):
        mean = net(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)

    return model


def _count_shape_checks(monkeypatch) -> list[str]:
    import lightning_dvi.pyro.elbo as elbo_module

    calls: list[str] = []
    check = elbo_module.check_site_shape

    def counted(site, max_plate_nesting):
        calls.append(site["name"])
        return check(site, max_plate_nesting)

    monkeypatch.setattr(elbo_module, "check_site_shape", counted)
    return calls


def test_site_shape_check_runs_once_per_call_signature_and_catches_a_shape_change(monkeypatch):
    calls = _count_shape_checks(monkeypatch)
    model = _rows_model(Net())
    guide, elbo = DeterministicGuide(model), DeterministicELBO()
    x, y = torch.randn(10, 2), torch.randn(10)
    elbo.loss(model, guide, x, y)
    first = len(calls)
    assert first > 0 and "obs" in calls  # checked at the first call
    elbo.loss(model, guide, torch.randn(10, 2), torch.randn(10))
    assert len(calls) == first  # same shapes: not checked again
    elbo.loss(model, guide, torch.randn(7, 2), torch.randn(7))
    assert len(calls) == 2 * first  # a new batch size is checked again
    # x [10, 1, 2] gives a mean [10, 1], which the plate broadcasts to [10, 10]: y [10] fits
    # that likelihood (so only the site-shape check can see it), and the remembered
    # signatures do not hide it.
    bad = torch.randn(10, 1, 2)
    with pytest.raises(ValueError, match=r"site 'obs'.*\(10, 10\)"):
        elbo.loss(model, guide, bad, y)
    with pytest.raises(ValueError, match=r"site 'obs'.*\(10, 10\)"):  # on every call
        elbo.loss(model, guide, bad, y)
    with pytest.raises(ValueError, match="obs"):  # as Trace_ELBO refuses it
        Trace_ELBO().loss(model, AutoNormal(model), bad, y)
    # another guide of the same model: its first call is checked
    before = len(calls)
    elbo.loss(model, DeterministicGuide(model), x, y)
    assert len(calls) > before


def test_validate_every_step_and_validation_off(monkeypatch):
    calls = _count_shape_checks(monkeypatch)
    model = _rows_model(Net())
    guide, every = DeterministicGuide(model), DeterministicELBO(validate_every_step=True)
    x, y = torch.randn(10, 2), torch.randn(10)
    for _ in range(3):
        every.loss(model, guide, x, y)
    assert calls.count("obs") == 3 and calls.count("l1.weight") == 3  # every site, every call
    calls.clear()
    with pyro.validation_enabled(False):
        off = DeterministicELBO()
        off.loss(model, guide, x, y)
        off.loss(model, guide, torch.randn(10, 1, 2), y)  # broadcasts, as Pyro does
    assert calls == []
    # NaN in the observed values is checked on every call, whatever was remembered
    elbo = DeterministicELBO()
    elbo.loss(model, guide, x, y)
    y_nan = y.clone()
    y_nan[2] = float("nan")
    with pytest.raises(ValueError, match=r"site 'obs'.*NaN"):
        elbo.loss(model, guide, x, y_nan)


def _independent_loss(guide, x, y, noise):
    """The one-hidden-layer DVI loss written out (ReLU moments, linear moments, KL, E log N)."""
    normal = torch.distributions.Normal(0.0, 1.0)
    site = {
        n: guide._get_loc_and_scale(n) for n in ("l1.weight", "l1.bias", "l2.weight", "l2.bias")
    }
    (w1, s1), (b1, t1), (w2, s2), (b2, t2) = (site[n] for n in site)
    m1 = x @ w1.T + b1
    v1 = (x * x) @ (s1 * s1).T + t1 * t1
    sd = v1.sqrt()
    a = m1 / sd
    cdf, pdf = normal.cdf(a), normal.log_prob(a).exp()
    mean_h = m1 * cdf + sd * pdf
    var_h = (m1 * m1 + v1) * cdf + m1 * sd * pdf - mean_h * mean_h
    m2 = (mean_h @ w2.T + b2).squeeze(-1)
    v2 = ((mean_h * mean_h + var_h) @ (s2 * s2).T + var_h @ (w2 * w2).T + t2 * t2).squeeze(-1)
    ell = -0.5 * math.log(2 * math.pi * noise**2) - ((y - m2) ** 2 + v2) / (2 * noise**2)
    kl = sum((0.5 * (s * s + m * m - 1) - s.log()).sum() for m, s in site.values())
    return kl - ell.sum()


def test_remembered_shape_checks_leave_loss_and_gradients_unchanged():
    model = regression(Net())
    guide = DeterministicGuide(model, init_scale=0.3)
    x, y = torch.randn(16, 2), torch.randn(16)
    elbo = DeterministicELBO()
    elbo.loss(model, guide, x, y)  # first call: builds the guide, checks the site shapes
    params = list(guide.parameters())

    def loss_and_grads(loss_fn):
        loss = loss_fn()
        grads = torch.autograd.grad(loss, params)
        return loss.detach(), grads

    cached = loss_and_grads(lambda: elbo.differentiable_loss(model, guide, x, y))
    every = DeterministicELBO(validate_every_step=True)
    checked = loss_and_grads(lambda: every.differentiable_loss(model, guide, x, y))
    with pyro.validation_enabled(False):
        unchecked = loss_and_grads(
            lambda: DeterministicELBO().differentiable_loss(model, guide, x, y)
        )
    written_out = loss_and_grads(lambda: _independent_loss(guide, x, y, 0.5))
    for other in (checked, unchecked, written_out):
        assert other[0] == pytest.approx(cached[0].item(), rel=1e-5)
        for g, h in zip(cached[1], other[1], strict=True):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-5)
