"""Likelihood.conditional p(y | f): every density at given outputs derives from it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.special import logsumexp

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian, HomoscedasticGaussian


def test_conditionals_match_scipy_densities():
    f = torch.randn(4, 5, 2, dtype=torch.float64)
    y = torch.randn(5, dtype=torch.float64)
    het = HeteroscedasticGaussian().conditional(f)
    ref = stats.norm.logpdf(y.numpy(), f[..., 0].numpy(), np.exp(0.5 * f[..., 1].numpy()))
    np.testing.assert_allclose(het.log_prob(y).numpy(), ref, rtol=1e-12)
    homo = HomoscedasticGaussian(init_log_variance=-1.0).double()
    ref = stats.norm.logpdf(y.numpy(), f[..., 0].numpy(), math.exp(-0.5))
    np.testing.assert_allclose(homo.conditional(f[..., :1]).log_prob(y).detach().numpy(), ref)
    logits = torch.randn(4, 5, 3, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1, 1, 0])
    lp = logits.numpy() - logsumexp(logits.numpy(), -1, keepdims=True)
    ref = np.take_along_axis(lp, np.broadcast_to(labels.numpy()[None, :, None], (4, 5, 1)), -1)
    got = Categorical(3).conditional(logits).log_prob(labels)
    np.testing.assert_allclose(got.numpy(), ref[..., 0], rtol=1e-12)


def test_log_prob_and_monte_carlo_expectation_derive_from_the_conditional():
    lik = HeteroscedasticGaussian()
    f = torch.randn(3, 6, 2, dtype=torch.float64)
    y = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(lik.log_prob(f, y), lik.conditional(f).log_prob(y))
    out = Gaussian(
        torch.randn(6, 2, dtype=torch.float64), var=torch.rand(6, 2, dtype=torch.float64)
    )
    closed = lik.expected_log_prob(out, y)
    mc = super(HeteroscedasticGaussian, lik).expected_log_prob(out, y, mc_samples=200_000)
    torch.testing.assert_close(mc, closed, rtol=0, atol=0.02)


def test_mixture_log_prob_is_the_log_mean_of_the_sample_densities():
    lik = HeteroscedasticGaussian()
    f = torch.randn(7, 5, 2, dtype=torch.float64)
    y = torch.randn(5, dtype=torch.float64)
    dens = stats.norm.logpdf(y.numpy(), f[..., 0].numpy(), np.exp(0.5 * f[..., 1].numpy()))
    ref = logsumexp(dens, 0) - math.log(7)
    np.testing.assert_allclose(lik.mixture_log_prob(f, y).numpy(), ref, rtol=1e-12)
    with pytest.raises(ValueError, match=r"\[S, B, D\]"):
        lik.mixture_log_prob(f[0], y)
