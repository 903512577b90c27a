r"""The softmax grid of ``recipes/categorical_closed_forms.py`` and its reference forms.

Logits :math:`a\sim\mathcal N(\mu, C)` in float64 over K classes, logit variance scales v,
mean gaps g (one class g above the others, "top", or means spread uniformly over [0, g],
"spread") and three covariance kinds: isotropic :math:`vI`, random diagonal (v times U(0.2,
1.8)) and random correlated full (:math:`vAA^\top` normalised to mean diagonal v). Also the
comparison predictives the recipe tabulates next to the library's (per-class probit, Laplace
bridge), Jensen's bound, and the Monte Carlo draws that serve as the oracle.

Issue 41's objective grid (:func:`objective_grid`: 10 classes, random means and correlated
covariances per logit variance) and the candidate lower bounds that
``recipes/categorical_tight_bound.py`` compares with the library's
(:func:`boehning_expected_log_prob`, :func:`tempered_jensen_expected_log_prob`,
:func:`bouchard_expected_log_prob`, :func:`one_vs_each_expected_log_prob`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dvi.likelihoods import functional as F
from lightning_dvi.likelihoods import logistic_normal as L

__all__ = [
    "CLASSES",
    "GAPS",
    "KINDS",
    "OBJECTIVE_SCALES",
    "SCALES",
    "boehning_expected_log_prob",
    "bouchard_expected_log_prob",
    "gaussian_draws",
    "grid",
    "jensen_expected_log_prob",
    "laplace_bridge",
    "objective_grid",
    "one_vs_each_expected_log_prob",
    "probit_softmax",
    "tempered_jensen_expected_log_prob",
]

SCALES = (1e-2, 1e-1, 1.0, 10.0, 100.0)
GAPS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
CLASSES = (2, 3, 10)
KINDS = ("iso", "diag", "full")
#: Logit variances of issue 41's objective grid (:func:`objective_grid`).
OBJECTIVE_SCALES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


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


def objective_grid(
    gen: torch.Generator,
    scales: tuple[float, ...] = OBJECTIVE_SCALES,
    rows: int = 64,
    classes: int = 10,
) -> dict[float, tuple[Tensor, Tensor, Tensor]]:
    r"""Issue 41's grid: per logit variance v, ``rows`` random ``(mean, full_cov, label)``, float64.

    Means :math:`2\,\mathcal N(0, I)`; covariances :math:`AA^\top` (:math:`A` standard normal)
    scaled to trace :math:`Kv`; labels uniform over the ``classes``.

    Returns:
        ``{v: (mean [rows, K], cov [rows, K, K], y [rows])}``.
    """
    out = {}
    for v in scales:
        mean = 2 * torch.randn(rows, classes, generator=gen, dtype=torch.float64)
        a = torch.randn(rows, classes, classes, generator=gen, dtype=torch.float64)
        cov = a @ a.transpose(-1, -2)
        cov = cov * (classes * v) / cov.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
        out[v] = (mean, cov, torch.randint(classes, (rows,), generator=gen))
    return out


def _label(mean: Tensor, y: Tensor) -> Tensor:
    return mean.gather(-1, y.unsqueeze(-1)).squeeze(-1)


def boehning_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""Böhning's quadratic lower bound (Böhning 1992).

    :math:`\operatorname{logsumexp}(a) \le \operatorname{logsumexp}(\mu) + p^\top(a - \mu) +
    \tfrac12(a - \mu)^\top A(a - \mu)`, :math:`A = \tfrac12(I - \mathbf 1\mathbf 1^\top/K)
    \succeq` every Hessian of logsumexp, so :math:`\mathbb E\log\operatorname{softmax}(a)_y \ge
    \mu_y - \operatorname{logsumexp}\mu - \tfrac14(\operatorname{tr}C - \mathbf 1^\top C\mathbf
    1/K)`. ``cov`` full or diag.
    """
    k = mean.shape[-1]
    if cov.shape == mean.shape:
        spread = cov.sum(-1) * (1 - 1 / k)
    else:
        spread = cov.diagonal(dim1=-2, dim2=-1).sum(-1) - cov.sum((-1, -2)) / k
    return _label(mean, y) - torch.logsumexp(mean, -1) - 0.25 * spread


def _referenced(mean: Tensor, cov: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    centre, ref, ref_var = L._reference_terms(mean, cov, w)
    return centre.squeeze(-1), ref, ref_var


def tempered_jensen_expected_log_prob(
    mean: Tensor, cov: Tensor, y: Tensor, reference: str = "softmax"
) -> Tensor:
    r"""Tempered Jensen alone, :math:`t` the best of :data:`~lightning_dvi.likelihoods.logistic_normal.TEMPERATURES`.

    ``reference``: ``"softmax"`` (:math:`w = \operatorname{softmax}\mu`, the library's),
    ``"label"`` (:math:`w = e_y`: the differences :math:`d_k = a_k - a_y`), ``"zero"`` (the
    plain logits), or ``"softmax_t1"`` (the softmax reference at :math:`t = 1` only).
    """
    if reference in ("softmax", "softmax_t1"):
        w = torch.softmax(mean, -1)
    elif reference == "label":
        w = torch.nn.functional.one_hot(y, mean.shape[-1]).to(mean.dtype)
    else:
        w = torch.zeros_like(mean)
    centre, ref, ref_var = _referenced(mean, cov, w)
    shift = (_label(mean, y) - centre).unsqueeze(-1)
    at_one = (shift - torch.logsumexp(ref + 0.5 * ref_var, -1, keepdim=True)).squeeze(-1)
    if reference == "softmax_t1":
        return at_one
    return L._tempered(shift, ref, ref_var, at_one)


def bouchard_expected_log_prob(
    mean: Tensor, cov: Tensor, y: Tensor, reference: str = "mean"
) -> Tensor:
    r"""Bouchard's bound alone (Knowles & Minka 2011's shift), at the ``"mean"`` logit or ``"zero"``."""
    k = mean.shape[-1]
    w = torch.full_like(mean, 1 / k) if reference == "mean" else torch.zeros_like(mean)
    centre, ref, ref_var = _referenced(mean, cov, w)
    return _label(mean, y) - centre - L._bouchard(ref, ref_var)


def one_vs_each_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""Titsias's one-vs-each alone: :math:`-\sum_{k\ne y}\mathbb E\operatorname{softplus}(a_k - a_y)`."""
    w = torch.nn.functional.one_hot(y, mean.shape[-1]).to(mean.dtype)
    _, ref, ref_var = _referenced(mean, cov, w)
    return -(F.softplus_normal_bound(ref, ref_var) * (1 - w)).sum(-1)
