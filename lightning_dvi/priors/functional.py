r"""Prior formulas on tensors: the Gaussian KL, the empirical-Bayes optimum, the hyper-prior.

Checked in ``tests/test_priors.py`` against ``torch.distributions.kl_divergence`` and a direct
``scipy.optimize`` minimisation of the empirical-Bayes objective.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["gaussian_kl", "inverse_gamma_log_prob", "optimal_variance"]


def gaussian_kl(loc: Tensor, scale: Tensor, prior_variance: Tensor | float) -> Tensor:
    r"""Summed :math:`\mathrm{KL}(\mathcal N(\mu, \sigma^2)\,\|\,\mathcal N(0, s))` over all entries.

    .. math::
        \mathrm{KL} = \tfrac12\sum_i\Big[\frac{\sigma_i^2 + \mu_i^2}{s} - 1
        - \log\frac{\sigma_i^2}{s}\Big].

    Args:
        loc: posterior means :math:`\mu` (any shape).
        scale: posterior standard deviations :math:`\sigma > 0` (same shape).
        prior_variance: :math:`s > 0`, a scalar (0-dim tensor or float) or broadcastable.

    Returns:
        A 0-dim tensor.

    Examples:
        >>> round(gaussian_kl(torch.zeros(3), torch.ones(3), 1.0).item(), 6)
        0.0
    """
    s = torch.as_tensor(prior_variance, dtype=loc.dtype, device=loc.device)
    var = scale.square()
    return 0.5 * ((var + loc.square()) / s - 1 - 2 * scale.log() + s.log()).sum()


def optimal_variance(loc: Tensor, scale: Tensor, alpha: float, beta: float) -> Tensor:
    r"""Empirical-Bayes prior variance of one group (paper eq. ebvariance, section 4).

    .. math::
        s^* = \arg\min_s \big\{\mathrm{KL}(q\,\|\,\mathcal N(0, s)) - \log\mathrm{IG}(s;\alpha,\beta)\big\}
            = \frac{\sum_i(\sigma_i^2 + \mu_i^2) + 2\beta}{n + 2\alpha + 2},

    with :math:`n` the number of weights in the group. Differentiable in ``loc`` and ``scale``.

    Returns:
        A 0-dim tensor.
    """
    n = loc.numel()
    return ((scale.square() + loc.square()).sum() + 2 * beta) / (n + 2 * alpha + 2)


def inverse_gamma_log_prob(s: Tensor, alpha: float, beta: float) -> Tensor:
    r""":math:`\log\mathrm{IG}(s;\alpha,\beta) = \alpha\log\beta - \log\Gamma(\alpha) - (\alpha+1)\log s - \beta/s`."""
    return alpha * math.log(beta) - math.lgamma(alpha) - (alpha + 1) * s.log() - beta / s
