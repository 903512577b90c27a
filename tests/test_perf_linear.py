"""``shared_scales``: one softplus per raw scale per ELBO step, same values and gradients."""

import torch

from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import BayesLinear, mlp
from lightning_dvi.nn.linear import shared_scales
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes


def _setup():
    torch.manual_seed(0)
    net = mlp(3, [6], 2).double()
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    return net, HeteroscedasticGaussian(), EmpiricalBayes(), x, y


def test_elbo_matches_the_unshared_computation() -> None:
    net, lik, prior, x, y = _setup()
    for mode in ("diag", "full", "sample"):
        torch.manual_seed(1)
        terms = elbo(net, lik, prior, x, y, 40, mode=mode)
        got = torch.autograd.grad(terms.loss, list(net.parameters()))
        torch.manual_seed(1)  # the same computation, every scale computed afresh
        if mode == "sample":
            ell = lik.log_prob(net(x, mode=mode), y).mean(0).mean()
        else:
            ell = lik.expected_log_prob(net(x, mode=mode), y).mean()
        loss = -(ell - prior.kl(net) / 40)
        want = torch.autograd.grad(loss, list(net.parameters()))
        assert torch.equal(terms.loss.detach(), loss.detach())
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, rtol=1e-13, atol=0)


def test_scales_are_shared_only_inside_the_block_and_only_while_unchanged() -> None:
    layer = BayesLinear(3, 2)
    assert layer.weight_scale is not layer.weight_scale
    with shared_scales():
        first = layer.weight_scale
        assert layer.weight_scale is first and layer.bias_scale is layer.bias_scale
        with shared_scales():  # nested: same cache
            assert layer.weight_scale is first
        with torch.no_grad():
            assert layer.weight_scale is not first  # other grad mode
            layer.weight_raw_scale.add_(1.0)  # in-place update bumps the version
        changed = layer.weight_scale
        assert changed is not first
        assert torch.allclose(changed, torch.nn.functional.softplus(layer.weight_raw_scale))
    assert layer.weight_scale is not layer.weight_scale


def test_repeated_steps_without_an_update_backpropagate_each_time() -> None:
    net, lik, prior, x, y = _setup()
    for _ in range(3):  # the benchmark's step: no optimiser update between backward passes
        net.zero_grad(set_to_none=True)
        elbo(net, lik, prior, x, y, 40, mode="diag").loss.backward()
        assert all(p.grad is not None for p in net.parameters())


def test_compiled_elbo_matches_eager() -> None:
    net, lik, prior, x, y = _setup()
    step = torch.compile(lambda: elbo(net, lik, prior, x, y, 40, mode="full").loss, backend="eager")
    got = step()
    want = elbo(net, lik, prior, x, y, 40, mode="full").loss
    assert torch.allclose(got, want, rtol=1e-12)
