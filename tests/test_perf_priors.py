"""The one-pass KL (``priors.functional.grouped_gaussian_kl``) against the per-group formulas."""

import math

import pytest
import torch
from helpers import posterior_net

from lightning_dvi.nn import parameter_groups
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior, functional

F64 = torch.float64


def _net(dtype: torch.dtype = F64) -> torch.nn.Module:
    torch.manual_seed(0)
    return posterior_net(dtype)


def _per_group(prior, net: torch.nn.Module) -> torch.Tensor:
    """The loop the one-pass KL replaces: ``sum(prior.group_kl(g))``."""
    return torch.stack([prior.group_kl(g) for g in parameter_groups(net)]).sum()


def _grads(net: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(net.parameters())))


PRIORS = [
    lambda: GaussianPrior(0.7),
    lambda: EmpiricalBayes(alpha=2.0, beta=0.5),
    lambda: EmpiricalBayes(alpha=2.0, beta=0.5, mode="buffer"),
]


@pytest.mark.parametrize("make", PRIORS)
@pytest.mark.parametrize(("dtype", "rtol"), [(F64, 1e-12), (torch.float32, 2e-6)])
def test_one_pass_kl_and_gradients_match_the_per_group_sum(make, dtype, rtol) -> None:
    net, prior = _net(dtype), make()
    if getattr(prior, "mode", None) == "buffer":
        with torch.no_grad():  # distinct variances per group
            for k, g in enumerate(parameter_groups(net)):
                g.prior_variance.fill_(0.3 + 0.2 * k)
    ref = _per_group(prior, net)
    ref_grads = _grads(net, ref)
    kl = prior.kl(net)
    assert kl.shape == () and kl.dtype == dtype
    assert torch.allclose(kl, ref.detach(), rtol=rtol, atol=0)
    for got, want in zip(_grads(net, prior.kl(net)), ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_in_graph_kl_writes_every_buffer() -> None:
    net, prior = _net(), EmpiricalBayes(alpha=1.5, beta=0.3)
    prior.kl(net)
    for g in parameter_groups(net):
        s = functional.optimal_variance(g.loc, g.scale, 1.5, 0.3)
        assert math.isclose(g.prior_variance.item(), s.item(), rel_tol=1e-12)
        assert not g.prior_variance.requires_grad


def test_gradcheck_and_double_backward() -> None:
    gen = torch.Generator().manual_seed(1)
    locs = [torch.randn(4, 3, generator=gen, dtype=F64), torch.randn(4, generator=gen, dtype=F64)]
    scales = [
        torch.rand(4, 3, generator=gen, dtype=F64) + 0.1,
        torch.rand(4, generator=gen, dtype=F64) + 0.1,
    ]
    inputs = [t.requires_grad_() for t in locs + scales]
    for variances in (None, torch.tensor([0.4, 2.0], dtype=F64)):

        def fn(*ts, variances=variances):
            return functional.grouped_gaussian_kl(ts[:2], ts[2:], variances, 1.5, 0.7)[0]

        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


def test_torch_func_grad_takes_the_reference_path() -> None:
    gen = torch.Generator().manual_seed(2)
    locs = [torch.randn(5, 3, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)]
    raws = [torch.randn(5, 3, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)]

    def kl(locs, raws):
        scales = [torch.nn.functional.softplus(r) for r in raws]
        return functional.grouped_gaussian_kl(locs, scales, None, 1.0, 10.0)[0]

    got = torch.func.grad(kl, argnums=(0, 1))(locs, raws)
    leaves = [t.clone().requires_grad_() for t in locs + raws]
    want = torch.autograd.grad(kl(leaves[:2], leaves[2:]), leaves)
    for g, w in zip([*got[0], *got[1]], want, strict=True):
        assert torch.allclose(g, w, rtol=1e-12)


def test_subclass_overriding_variance_uses_its_own_variance() -> None:
    class Doubled(GaussianPrior):
        def variance(self, group):
            return 2 * super().variance(group)

    net = _net()
    assert torch.allclose(Doubled(0.5).kl(net), GaussianPrior(1.0).kl(net), rtol=1e-12)


def test_mixed_dtypes_fall_back_to_the_per_group_sum() -> None:
    net = _net()
    net[0].float()
    prior = EmpiricalBayes()
    kl = prior.kl(net)
    assert torch.allclose(kl, _per_group(prior, net).to(kl.dtype), rtol=1e-6)
