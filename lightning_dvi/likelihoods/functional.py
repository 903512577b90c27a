r"""Closed-form expected log-likelihoods and predictives on tensors (no state, torch only).

One implementation of each formula; the likelihood modules and the Pyro front-end call these.
Every formula is checked against Monte Carlo in ``tests/test_likelihoods.py`` and written out,
with the paper's typos corrected, in ``docs/likelihoods_and_priors.md``.

Categorical functions take the logit covariance ``cov`` either **full** (shape ``[..., K, K]``)
or **diag** (per-logit variances, shape ``[..., K]``, the same shape as ``mean``). The kind is
read off the shapes, which is unambiguous: a diag ``cov`` has exactly the shape of ``mean``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "categorical_delta_expected_log_prob",
    "categorical_delta_predictive",
    "heteroscedastic_expected_log_prob",
    "heteroscedastic_predictive_moments",
    "normal_expected_log_prob",
]

_LOG_2PI = math.log(2 * math.pi)


def normal_expected_log_prob(mean: Tensor, var: Tensor, y: Tensor, noise_var: Tensor) -> Tensor:
    r"""Expected Gaussian log-density under a Gaussian mean.

    .. math::
        \mathbb E_{f\sim\mathcal N(\mu, v)}\log\mathcal N(y; f, \sigma^2)
        = -\tfrac12\Big[\log 2\pi\sigma^2 + \frac{(y-\mu)^2 + v}{\sigma^2}\Big].

    Args:
        mean: :math:`\mu`. All arguments broadcast elementwise.
        var: :math:`v \ge 0`.
        y: targets.
        noise_var: observation variance :math:`\sigma^2 > 0`.

    Returns:
        The expected log-density, the broadcast shape of the inputs.

    Examples:
        >>> z = torch.zeros(())
        >>> round(normal_expected_log_prob(z, z, z, torch.ones(())).item(), 4)
        -0.9189
    """
    noise_var = torch.as_tensor(noise_var, dtype=mean.dtype, device=mean.device)
    return -0.5 * (_LOG_2PI + noise_var.log() + ((y - mean).square() + var) / noise_var)


def heteroscedastic_expected_log_prob(
    mean_m: Tensor, var_m: Tensor, mean_l: Tensor, var_l: Tensor, cov_ml: Tensor | None, y: Tensor
) -> Tensor:
    r"""Expected log-likelihood of :math:`p(y\mid m,\ell) = \mathcal N(y; m, e^\ell)`, (m, ℓ) Gaussian.

    Paper eq. (regLikelihood), section 3.2 / appendix B.2:

    .. math::
        \mathbb E\log p(y\mid m,\ell) = -\tfrac12\Big[\log 2\pi + \langle\ell\rangle
        + \big(\Sigma_{mm} + (\langle m\rangle - \Sigma_{m\ell} - y)^2\big)
          e^{-\langle\ell\rangle + \Sigma_{\ell\ell}/2}\Big].

    Tilting the Gaussian by :math:`e^{-\ell}` multiplies its mass by
    :math:`e^{-\langle\ell\rangle+\Sigma_{\ell\ell}/2}` and shifts the mean of :math:`m` by
    :math:`-\Sigma_{m\ell}`. The exponent is formed before the single ``exp`` so that neither
    :math:`e^{\langle\ell\rangle}` nor :math:`e^{\Sigma_{\ell\ell}/2}` overflows on its own.

    Args:
        mean_m: :math:`\langle m\rangle`. All arguments broadcast elementwise.
        var_m: :math:`\Sigma_{mm}`.
        mean_l: :math:`\langle\ell\rangle` (the mean log noise variance).
        var_l: :math:`\Sigma_{\ell\ell}`.
        cov_ml: :math:`\Sigma_{m\ell}` (zero for a diag output; ``None`` means zero and
            saves two ops).
        y: targets.

    Returns:
        The expected log-likelihood, the broadcast shape of the inputs.
    """
    scale = torch.exp(var_l * 0.5 - mean_l)
    shifted = mean_m - y if cov_ml is None else mean_m - cov_ml - y
    quad = var_m + shifted.square()
    return -0.5 * (_LOG_2PI + mean_l + quad * scale)


def heteroscedastic_predictive_moments(
    mean_m: Tensor, var_m: Tensor, mean_l: Tensor, var_l: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of the predictive :math:`\int p(y\mid m,\ell)\,q(m,\ell)`, appendix B.3.

    .. math::
        \mathbb E[y] = \langle m\rangle, \qquad
        \operatorname{Var}[y] = \Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}.

    Both are exact (law of total variance and the log-normal mean); only the Gaussian *shape* of
    the predictive is an approximation.

    Returns:
        ``(mean, var)``, the broadcast shape of the inputs.
    """
    return mean_m, var_m + torch.exp(mean_l + var_l * 0.5)


def _logit_cov_terms(mean: Tensor, cov: Tensor, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``diag(C)``, ``Cp`` and ``pᵀCp`` for a full or diag logit covariance."""
    if cov.shape == mean.shape:
        diag = cov
        cp = cov * p
    elif cov.shape == (*mean.shape, mean.shape[-1]):
        diag = cov.diagonal(dim1=-2, dim2=-1)
        cp = (cov @ p.unsqueeze(-1)).squeeze(-1)
    else:
        raise ValueError(
            f"logit covariance shape {tuple(cov.shape)} fits neither a diag ({tuple(mean.shape)}) "
            f"nor a full ({(*mean.shape, mean.shape[-1])}) covariance for logits of shape "
            f"{tuple(mean.shape)}"
        )
    return diag, cp, (p * cp).sum(-1, keepdim=True)


def categorical_delta_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""Expected softmax log-likelihood by the second-order delta method (appendix B.4).

    .. math::
        \mathbb E\log\operatorname{softmax}(a)_y \approx \langle a_y\rangle
        - \operatorname{logsumexp}\langle a\rangle
        - \tfrac12\big(p^\top\operatorname{diag}(C) - p^\top C p\big),
        \qquad p = \operatorname{softmax}\langle a\rangle.

    The correction is the Hessian of logsumexp, :math:`\operatorname{diag}(p) - pp^\top`,
    contracted with :math:`C`; it is :math:`\ge 0` for PSD :math:`C`, so the estimate never
    exceeds the plug-in value.

    Args:
        mean: logit means ``[..., K]``.
        cov: logit covariance, full ``[..., K, K]`` or diag ``[..., K]``.
        y: integer labels ``[...]`` in ``[0, K)``.

    Returns:
        The expected log-likelihood ``[...]``.

    Raises:
        ValueError: if ``cov`` has neither the full nor the diag shape.
    """
    log_p = torch.log_softmax(mean, dim=-1)
    p = log_p.exp()
    diag, _, pcp = _logit_cov_terms(mean, cov, p)
    correction = 0.5 * ((p * diag).sum(-1) - pcp.squeeze(-1))
    return log_p.gather(-1, y.long().unsqueeze(-1)).squeeze(-1) - correction


def categorical_delta_predictive(mean: Tensor, cov: Tensor) -> Tensor:
    r"""Predictive class probabilities by the second-order delta method (appendix B.5).

    .. math::
        \mathbb E\operatorname{softmax}(a) \approx p\odot\big[1 + p^\top C p - Cp
        + \tfrac12\operatorname{diag}(C) - \tfrac12 p^\top\operatorname{diag}(C)\big].

    The bracket sums to one against :math:`p` exactly, but for large :math:`C` entries go
    negative; they are clamped at zero and the vector renormalised, so the result is always a
    valid distribution (the clamped sum is :math:`\ge 1`, so the division is safe).

    Args:
        mean: logit means ``[..., K]``.
        cov: logit covariance, full ``[..., K, K]`` or diag ``[..., K]``.

    Returns:
        Probabilities ``[..., K]``, non-negative and summing to one.

    Raises:
        ValueError: if ``cov`` has neither the full nor the diag shape.
    """
    p = torch.softmax(mean, dim=-1)
    diag, cp, pcp = _logit_cov_terms(mean, cov, p)
    pdiag = (p * diag).sum(-1, keepdim=True)
    probs = (p * (1 + pcp - cp + 0.5 * diag - 0.5 * pdiag)).clamp_min(0)
    total = probs.sum(-1, keepdim=True)
    # Round-off under a huge covariance can leave a non-finite or zero total; fall back to p.
    ok = torch.isfinite(total) & (total > 0)
    return torch.where(ok, probs / torch.where(ok, total, torch.ones_like(total)), p)
