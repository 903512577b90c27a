"""The Gaussian algebra of moments/algebra.py against oracles (Monte Carlo, or exact indexing).

Sums and constant factors: 400,000 draws in float64; the tolerance 0.02 is over six standard
errors of a mean or covariance entry of unit-scale Gaussians (SE <= ~3e-3). Shape and index ops:
an exact oracle, the joint covariance of *all* elements as one block-diagonal matrix indexed by
the flat source position of every output element.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi import moments as M
from lightning_dvi.nn.conv import unsupported_conv2d_options, unsupported_pool2d_options

N_MC = 400_000
TOL = 0.02


def _full(batch, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, d, d, generator=gen, dtype=dtype) * 0.6
    cov = a @ a.mT + 0.1 * torch.eye(d, dtype=dtype)
    return Gaussian(torch.randn(*batch, d, generator=gen, dtype=dtype), cov=cov)


def _diag(batch, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    var = torch.rand(*batch, d, generator=gen, dtype=dtype) + 0.1
    return Gaussian(torch.randn(*batch, d, generator=gen, dtype=dtype), var=var)


def _mc_moments(samples):
    mean = samples.mean(0)
    centred = samples - mean
    cov = torch.einsum("s...i,s...j->...ij", centred, centred) / (samples.shape[0] - 1)
    return mean, cov


def _cov(g):
    return g.cov if g.is_full else torch.diag_embed(g.var)


@pytest.mark.parametrize("kinds", [("full", "full"), ("full", "diag"), ("diag", "diag")])
def test_add_independent_matches_monte_carlo(kinds):
    torch.manual_seed(0)
    make = {"full": _full, "diag": _diag}
    a, b = make[kinds[0]]((2,), 3, 1), make[kinds[1]]((1,), 3, 2)  # batch dims broadcast
    out = M.add_independent(a, b)
    assert out.is_full == ("full" in kinds)
    mean, cov = _mc_moments(a.sample((N_MC,)) + b.sample((N_MC,)))
    torch.testing.assert_close(out.mean, mean, rtol=0, atol=TOL)
    torch.testing.assert_close(_cov(out), cov, rtol=0, atol=TOL)


def test_add_a_constant_shifts_the_mean_only():
    g = _full((4,), 3, 3)
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    out = M.add_independent(c, g)
    torch.testing.assert_close(out.mean, g.mean + c)
    assert torch.equal(out.cov, g.cov)
    assert torch.equal(M.add_independent(_diag((2,), 3, 4), 1.0).var, _diag((2,), 3, 4).var)


def test_add_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="last dimensions differ"):
        M.add_independent(_diag((2,), 1, 0), _diag((2,), 3, 1))
    with pytest.raises(ValueError, match="would broadcast"):
        M.add_independent(_diag((2,), 3, 0), torch.zeros(5, 2, 3))
    with pytest.raises(ValueError, match="at least one Gaussian"):
        M.add_independent(torch.zeros(3), 1.0)


@pytest.mark.parametrize("kind", ["full", "diag"])
def test_scale_matches_monte_carlo(kind):
    torch.manual_seed(1)
    g = {"full": _full, "diag": _diag}[kind]((2,), 3, 5)
    c = torch.tensor([2.0, -0.5, 1.5], dtype=torch.float64)
    out = M.scale_gaussian(g, c)
    mean, cov = _mc_moments(g.sample((N_MC,)) * c)
    torch.testing.assert_close(out.mean, mean, rtol=0, atol=TOL)
    torch.testing.assert_close(_cov(out), cov, rtol=0, atol=2 * TOL)  # entries up to ~5
    assert out.is_full == g.is_full
    negated = M.scale_gaussian(g, -1.0)
    assert torch.equal(negated.mean, -g.mean) and torch.equal(_cov(negated), _cov(g))
    with pytest.raises(ValueError, match="would broadcast"):
        M.scale_gaussian(g, torch.ones(4, 2, 3))


def _oracle(g, op, *args):
    """Exact joint moments of ``op(a)`` from the block-diagonal covariance of all elements."""
    n = g.mean.numel()
    big = torch.block_diag(*_cov(g).reshape(-1, g.shape[-1], g.shape[-1]))
    src = op(torch.arange(n).reshape(g.shape), *args)
    mean = g.mean.reshape(-1)[src]
    cov = big[src.unsqueeze(-1), src.unsqueeze(-2)]
    return mean, cov


@pytest.mark.parametrize(
    ("op", "args", "exact"),
    [
        (torch.Tensor.expand, (2, 4, 3), True),  # a new batch dimension: plate expand
        (torch.Tensor.__getitem__, ((slice(1, 3), [2, 0]),), True),  # batch slice, unit subset
        (torch.flip, ([-1],), True),
        (torch.Tensor.unsqueeze, (-1,), True),  # every unit its own row
        (torch.Tensor.reshape, (2, 6), False),  # rows merged: only marginals
        (torch.Tensor.transpose, (0, 1), False),  # the last dimension indexes data points
    ],
)
@pytest.mark.parametrize("kind", ["full", "diag"])
def test_reindex_gathers_the_exact_covariance_or_only_marginals(op, args, exact, kind):
    g = {"full": _full, "diag": _diag}[kind]((4,), 3, 6)
    out, got_exact = M.reindex_gaussian(g, op, *args)
    mean, cov = _oracle(g, op, *args)
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.var, cov.diagonal(dim1=-2, dim2=-1))
    assert got_exact == exact
    if exact:
        torch.testing.assert_close(_cov(out), cov)
        assert out.is_full == g.is_full
    marginals, flagged = M.reindex_gaussian(g, op, *args, joint=False)
    assert not flagged and not marginals.is_full
    torch.testing.assert_close(marginals.var, out.var)


def test_reindex_of_independent_units_with_a_repeated_unit_is_not_exact():
    g = _diag((2,), 3, 7)
    out, exact = M.reindex_gaussian(g, torch.Tensor.__getitem__, (slice(None), [0, 0, 1]))
    assert not exact  # the two copies of unit 0 are perfectly correlated, not independent
    full, exact = M.reindex_gaussian(g.to_full(), torch.Tensor.__getitem__, (..., [0, 0, 1]))
    assert exact
    torch.testing.assert_close(full.cov[:, 0, 1], g.var[:, 0])
    torch.testing.assert_close(full.var, out.var)


def test_conv2d_moments_dispatches_on_the_input_and_refuses_a_full_covariance():
    torch.manual_seed(2)
    x = torch.randn(2, 1, 5, 5)
    w_loc, w_var = torch.randn(3, 1, 3, 3), torch.rand(3, 1, 3, 3)
    out = M.conv2d_moments(x, w_loc, w_var, padding=1)
    torch.testing.assert_close(
        (out.mean, out.var), M.conv2d_deterministic(x, w_loc, w_var, None, None, 1, 1)
    )
    g = Gaussian(x, var=torch.rand_like(x))
    out = M.conv2d_moments(g, w_loc, w_var, stride=2)
    torch.testing.assert_close(
        (out.mean, out.var), M.conv2d_diag(x, g.var, w_loc, w_var, None, None, 2)
    )
    flat = Gaussian(torch.zeros(2, 3), cov=torch.eye(3).expand(2, 3, 3))
    with pytest.raises(ValueError, match="per-pixel"):
        M.conv2d_moments(flat, w_loc, w_var)


def test_torch_option_checks_name_what_is_required():
    assert unsupported_conv2d_options() is None
    assert unsupported_conv2d_options(1, [1, 1], (2, 1)) is None
    assert "dilation=1" in unsupported_conv2d_options(dilation=2)
    assert "groups=1" in unsupported_conv2d_options(groups=2)
    assert unsupported_conv2d_options(padding="same") is not None
    assert unsupported_pool2d_options() is None
    assert "padding=0" in unsupported_pool2d_options(padding=1)
    assert unsupported_pool2d_options(ceil_mode=True) is not None
    assert unsupported_pool2d_options(divisor_override=2) is not None
