r"""The softmax grid of ``recipes/categorical_closed_forms.py`` and its reference forms.

Logits :math:`a\sim\mathcal N(\mu, C)` in float64 over K classes, logit variance scales v,
mean gaps g (one class g above the others, "top", or means spread uniformly over [0, g],
"spread") and three covariance kinds: isotropic :math:`vI`, random diagonal (v times U(0.2,
1.8)) and random correlated full (:math:`vAA^\top` normalised to mean diagonal v). Also the
comparison predictives the recipe tabulates next to the library's (per-class probit, Laplace
bridge), Jensen's bound, and the Monte Carlo draws that serve as the oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..likelihoods import functional as F

__all__ = [
    "CLASSES",
    "GAPS",
    "KINDS",
    "SCALES",
    "gaussian_draws",
    "grid",
    "jensen_expected_log_prob",
    "laplace_bridge",
    "probit_softmax",
]

SCALES = (1e-2, 1e-1, 1.0, 10.0, 100.0)
GAPS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
CLASSES = (2, 3, 10)
KINDS = ("iso", "diag", "full")


def grid(
    gen: torch.Generator, scales: tuple[float, ...] = SCALES
) -> list[tuple[int, float, float, str, str, Tensor, Tensor]]:
    """All grid points ``(K, v, gap, kind, layout, mean, full_cov)`` in float64.

    Args:
        gen: the generator of the random means, diagonals and correlations (reproducible).
        scales: the logit variance scales v.

    Returns:
        ``len(CLASSES) * len(scales) * len(GAPS) * len(KINDS) * 2`` tuples.
    """
    cases = []
    for k in CLASSES:
        for v in scales:
            for gap in GAPS:
                for kind in KINDS:
                    for layout in ("top", "spread"):
                        if layout == "top":
                            mean = torch.zeros(k, dtype=torch.float64)
                            mean[0] = gap
                        else:
                            u = torch.rand(k, generator=gen, dtype=torch.float64)
                            mean = gap * (u - u.min()) / (u.max() - u.min())
                        if kind == "iso":
                            cov = v * torch.eye(k, dtype=torch.float64)
                        elif kind == "diag":
                            d = 0.2 + 1.6 * torch.rand(k, generator=gen, dtype=torch.float64)
                            cov = torch.diag(v * d)
                        else:
                            a = torch.randn(k, k, generator=gen, dtype=torch.float64)
                            cov = a @ a.T
                            cov = v * cov / cov.diagonal().mean()
                        cases.append((k, v, gap, kind, layout, mean, cov))
    return cases


def probit_softmax(mean: Tensor, cov: Tensor) -> Tensor:
    """Per-class probit scaling ``softmax(mu / sqrt(1 + pi/8 C_kk))``."""
    var = cov if cov.shape == mean.shape else cov.diagonal(dim1=-2, dim2=-1)
    return torch.softmax(mean * torch.rsqrt(1 + F.PROBIT_LAMBDA * var), -1)


def laplace_bridge(mean: Tensor, cov: Tensor) -> Tensor:
    r"""Mean of the Laplace-bridge Dirichlet (Hobbhahn et al. 2022; diagonal of ``cov`` only).

    :math:`\alpha_k = (1 - 2/K + e^{\mu_k}\sum_j e^{-\mu_j}/K^2) / C_{kk}`, returned
    normalised, :math:`\alpha / \sum_j\alpha_j`.
    """
    k = mean.shape[-1]
    var = cov if cov.shape == mean.shape else cov.diagonal(dim1=-2, dim2=-1)
    inner = torch.exp(mean) * torch.exp(-mean).sum(-1, keepdim=True) / k**2
    alpha = (1 - 2 / k + inner) / var
    return alpha / alpha.sum(-1, keepdim=True)


def jensen_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""Jensen's lower bound on the expected log-likelihood of one label.

    :math:`\mathbb E\log\operatorname{softmax}(a)_y \ge \mu_y - \log\sum_k
    e^{\mu_k + C_{kk}/2}`: since :math:`\log` is concave, :math:`\mathbb E\log\sum_k e^{a_k} \le
    \log\sum_k \mathbb E e^{a_k}` and :math:`\mathbb E e^{a_k} = e^{\mu_k + C_{kk}/2}`.
    ``cov`` is a full ``[..., K, K]`` covariance or a ``[..., K]`` variance.
    """
    var = cov if cov.shape == mean.shape else cov.diagonal(dim1=-2, dim2=-1)
    return mean.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(mean + var / 2, -1)


def gaussian_draws(mean: Tensor, cov: Tensor, n: int, gen: torch.Generator) -> Tensor:
    r"""``n`` float64 draws ``[n, K]`` of :math:`\mathcal N(\mu, C)` (the Monte Carlo oracle).

    ``cov`` gets a 1e-12 diagonal jitter so that a singular covariance still factorises.
    """
    k = mean.shape[-1]
    chol = torch.linalg.cholesky(cov + 1e-12 * torch.eye(k, dtype=torch.float64))
    noise = torch.randn(n, k, generator=gen, dtype=torch.float64)
    return mean + torch.matmul(noise, chol.T)
