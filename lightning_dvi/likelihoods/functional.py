r"""Closed-form expected log-likelihoods and predictives on tensors (no state, torch only).

One implementation of each formula; the likelihood modules and the Pyro front-end call these.
The logistic-normal integrals (softplus and sigmoid against a Gaussian) and the bounds built on
them live in :mod:`lightning_dvi.likelihoods.logistic_normal` and are re-exported here.
Every formula is checked against Monte Carlo in ``tests/test_likelihoods.py`` and written out,
with the paper's typos corrected, in ``docs/likelihoods_and_priors.md``.

Categorical functions take the logit covariance ``cov`` either **full** (shape ``[..., K, K]``)
or **diag** (per-logit variances, shape ``[..., K]``, the same shape as ``mean``). The kind is
read off the shapes, which is unambiguous: a diag ``cov`` has exactly the shape of ``mean``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..moments._cache import cached
from ..moments._quadrature import constant, gauss_hermite
from ..moments.special import lambert_w_of_exp
from .logistic_normal import (
    bernoulli_expected_log_prob,
    categorical_bound_expected_log_prob,
    categorical_tight_expected_log_prob,
    sigmoid_normal_mean,
    softplus_normal_bound,
)

__all__ = [
    "bernoulli_expected_log_prob",
    "categorical_bound_expected_log_prob",
    "categorical_clark_expected_log_prob",
    "categorical_delta_expected_log_prob",
    "categorical_delta_predictive",
    "categorical_mean_field_predictive",
    "categorical_tight_expected_log_prob",
    "heteroscedastic_conditional",
    "heteroscedastic_expected_log_prob",
    "heteroscedastic_expected_log_prob_packed",
    "heteroscedastic_predictive_log_prob",
    "heteroscedastic_predictive_moments",
    "normal_expected_log_prob",
    "poisson_expected_log_prob",
    "sigmoid_normal_mean",
    "softplus_normal_bound",
]

_LOG_2PI = math.log(2 * math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)
#: Probit constant of the pairwise mean-field predictive, ``sigmoid(x) ~ Phi(sqrt(pi/8) x)``.
PROBIT_LAMBDA = math.pi / 8
#: Per-logit smoothing variance :math:`\tau^2` of the Clark expected log-likelihood,
#: :math:`\tau = \log 2\,\sqrt{2\pi}` (about 3.02); chosen by the measurement in
#: ``recipes/categorical_closed_forms.py`` (docs/likelihoods_and_priors.md).
CLARK_SMOOTHING_VAR = (math.log(2) * math.sqrt(2 * math.pi)) ** 2
#: Gauss–Hermite nodes of :func:`heteroscedastic_predictive_log_prob` (around the integrand's mode).
PREDICTIVE_NODES = 32
#: Newton steps of :func:`heteroscedastic_predictive_log_prob`'s mode search (from a closed-form
#: start that is exact when :math:`\Sigma_{mm} = 0`).
PREDICTIVE_NEWTON_STEPS = 6
#: Data per call of :func:`heteroscedastic_predictive_log_prob`'s rule (bounds its memory).
PREDICTIVE_CHUNK = 1 << 15


def normal_expected_log_prob(
    mean: Tensor, var: Tensor | float, y: Tensor, noise_var: Tensor
) -> Tensor:
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


def poisson_expected_log_prob(mean: Tensor, var: Tensor | float, y: Tensor) -> Tensor:
    r"""Expected Poisson log-likelihood with a Gaussian log-rate, exact.

    .. math::
        \mathbb E_{f\sim\mathcal N(\mu, v)}\log\operatorname{Poisson}(y; e^f)
        = y\mu - e^{\mu + v/2} - \log y!

    (the log-normal mean :math:`\mathbb E e^f = e^{\mu + v/2}`; the other terms are linear
    in :math:`f`).

    Args:
        mean: :math:`\mu`. All arguments broadcast elementwise.
        var: :math:`v \ge 0`.
        y: counts (non-negative integers, any dtype).

    Returns:
        The expected log-likelihood, the broadcast shape of the inputs.

    Examples:
        >>> y = torch.tensor([0.0, 3.0])
        >>> exact = torch.distributions.Poisson(torch.ones(2)).log_prob(y)
        >>> torch.allclose(poisson_expected_log_prob(torch.zeros(2), 0.0, y), exact)
        True
    """
    y = y.to(mean.dtype)
    return y * mean - torch.exp(mean + 0.5 * var) - torch.lgamma(y + 1)


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


def heteroscedastic_expected_log_prob_packed(
    mean: Tensor, cov: Tensor, y: Tensor, extra_variance: float = 0.0
) -> Tensor:
    r""":func:`heteroscedastic_expected_log_prob` of a packed output Gaussian, in one autograd node.

    ``mean [..., 2]`` holds :math:`(\langle m\rangle, \langle\ell\rangle)`; ``cov`` is the
    full ``[..., 2, 2]`` covariance (its entry ``[0, 1]`` is :math:`\Sigma_{m\ell}`) or the
    diagonal ``[..., 2]`` (:math:`\Sigma_{m\ell} = 0`); ``y`` has the shape ``mean[..., 0]``;
    ``extra_variance`` is added to :math:`\Sigma_{mm}` (a target resolution's
    :math:`\Delta^2/12`). The same formula, evaluated in the same order, as the unpacked
    function; its backward is written out. With :math:`r = \langle m\rangle - \Sigma_{m\ell} - y`,
    :math:`q = \Sigma_{mm} + r^2` and :math:`e = \exp(\Sigma_{\ell\ell}/2 - \langle\ell\rangle)`,
    for an output gradient :math:`\bar g`:

    .. math::
        \partial_{\langle m\rangle} = -\bar g r e, \quad
        \partial_{\Sigma_{m\ell}} = \bar g r e, \quad
        \partial_{\Sigma_{mm}} = -\tfrac12\bar g e, \quad
        \partial_{\langle\ell\rangle} = \tfrac12\bar g (q e - 1), \quad
        \partial_{\Sigma_{\ell\ell}} = -\tfrac14\bar g q e

    (the entry ``[1, 0]`` of a full ``cov`` is not read and gets a zero gradient): about 20
    aten ops for forward and backward where autograd through the unpacked formula dispatches
    about 35. ``y`` gets no gradient (callers take the unpacked function for a differentiable
    target).

    Returns:
        The expected log-likelihood, ``[...]`` (the shape of ``y``).
    """
    out: Tensor = _HeteroscedasticELL.apply(mean, cov, y, float(extra_variance))
    return out


_GRAD_SIGNS: dict[tuple[bool, torch.dtype, torch.device], Tensor] = {}


def _grad_signs(full: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The constant factors of the packed gradient columns (see :class:`_HeteroscedasticELL`)."""
    values = (-1.0, 0.5, -0.5, 1.0, 0.0, -0.25) if full else (-1.0, 0.5, -0.5, -0.25)
    return cached(
        _GRAD_SIGNS,
        (full, dtype, device),
        lambda: torch.tensor(values, dtype=dtype, device=device),
    )


class _HeteroscedasticELL(torch.autograd.Function):
    """:func:`heteroscedastic_expected_log_prob_packed`: forward in no-grad ops, backward written out."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, mean: Tensor, cov: Tensor, y: Tensor, extra_variance: float
    ) -> Tensor:
        full = cov.dim() == mean.dim() + 1
        mean_m, mean_l = mean.unbind(-1)
        if full:
            var_m, cov_ml, _, var_l = cov.flatten(-2).unbind(-1)
            shifted = mean_m - cov_ml - y
        else:
            var_m, var_l = cov.unbind(-1)
            shifted = mean_m - y
        scale = (var_l * 0.5).sub_(mean_l).exp_()
        if extra_variance:
            var_m = var_m + extra_variance
        quad = torch.addcmul(var_m, shifted, shifted)
        out = torch.addcmul(mean_l + _LOG_2PI, quad, scale).mul_(-0.5)
        ctx.save_for_backward(shifted, quad, scale)
        ctx.full = full  # type: ignore[attr-defined]  # FunctionCtx declares no attributes
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        shifted, quad, scale = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        full: bool = ctx.full  # type: ignore[attr-defined]  # set in forward
        u = grad * scale
        ru = shifted * u
        qu = quad * u
        # columns: d<m>, d<l>, then dSigma_mm, dSigma_ml, dSigma_lm (0), dSigma_ll (full) or
        # dSigma_mm, dSigma_ll (diag), each times its constant factor
        cols = [ru, qu - grad, u, ru, torch.zeros_like(ru), qu] if full else [ru, qu - grad, u, qu]
        packed = torch.stack(cols, -1).mul_(_grad_signs(full, u.dtype, u.device))
        g_mean = packed[..., :2]
        g_cov = packed[..., 2:].unflatten(-1, (2, 2)) if full else packed[..., 2:]
        return g_mean, g_cov, None, None


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


def heteroscedastic_predictive_log_prob(
    mean_m: Tensor,
    var_m: Tensor,
    mean_l: Tensor,
    var_l: Tensor,
    cov_ml: Tensor | None,
    y: Tensor,
    num_nodes: int = PREDICTIVE_NODES,
) -> Tensor:
    r"""Log density of the predictive :math:`p(y) = \int\mathcal N(y; m, e^\ell)\,q(m, \ell)`, without a Gaussian shape.

    :math:`q(m, \ell)` is the network's bivariate Gaussian output. Conditioning :math:`m` on
    :math:`\ell` and integrating it out exactly,

    .. math::
        p(y) = \int \mathcal N(\ell; \langle\ell\rangle, \Sigma_{\ell\ell})\,
        \mathcal N\big(y;\ \langle m\rangle + \beta(\ell - \langle\ell\rangle),\
        s + e^{\ell}\big)\,d\ell,
        \qquad \beta = \frac{\Sigma_{m\ell}}{\Sigma_{\ell\ell}},\quad
        s = \Sigma_{mm} - \beta\Sigma_{m\ell},

    a continuous scale mixture of Gaussians. It has the mean :math:`\langle m\rangle` and the
    variance :math:`\Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}` of
    :func:`heteroscedastic_predictive_moments`'s Gaussian, but heavier tails: a target many
    predicted noise deviations away is scored by the larger noise levels that
    :math:`\Sigma_{\ell\ell}` allows, not by the average one alone.

    The one-dimensional integral is by adaptive Gauss–Hermite quadrature, as
    :class:`~lightning_dvi.likelihoods.PoissonLogNormal`'s. With :math:`H(\ell)` the log of the
    integrand, :math:`d = \ell - \langle\ell\rangle`, :math:`r = y - \langle m\rangle - \beta d`,
    :math:`w = s + e^\ell` and :math:`q = e^\ell / w`,

    .. math::
        H' = -\frac d{\Sigma_{\ell\ell}} - \frac q2 + \frac{\beta r}w + \frac{r^2 q}{2w},
        \qquad
        H'' = -\frac1{\Sigma_{\ell\ell}} - \frac{q(1-q)}2 - \frac{\beta^2}w
        - \frac{2\beta r q}w + \frac{r^2 q(1 - 2q)}{2w}.

    :math:`H` can have two modes: where :math:`e^\ell` matches the squared residual, and where
    the conditional mean reaches :math:`y` (a strong :math:`\Sigma_{m\ell}`). Safeguarded Newton
    steps (:data:`PREDICTIVE_NEWTON_STEPS`, a step halved or refused where :math:`H` would
    fall; curvature :math:`c = \max(-H'', 1/(4\Sigma_{\ell\ell}))`) climb from two closed-form
    starts, each exact in a limit: :math:`\ell = \langle\ell\rangle - \Sigma_{\ell\ell}/2 +
    W\big(\tfrac12\Sigma_{\ell\ell} r^2 e^{\Sigma_{\ell\ell}/2 - \langle\ell\rangle}\big)`
    (:math:`s = 0`, :math:`\beta = 0`; :math:`W` the Lambert function) and the mode for a
    constant :math:`e^\ell`, :math:`d = \beta r v / (w + \beta^2 v)`. Each end point
    :math:`\ell_k` gets a rule :math:`\ell = \ell_k + t/\sqrt{c_k}` and a Laplace mass
    :math:`a_k = e^{H(\ell_k)}/\sqrt{c_k}`; a partition of unity,
    :math:`\pi_k = a_k\varphi_k / \sum_j a_j\varphi_j` (:math:`\varphi_k` the rule's Gaussian),
    lets rule :math:`k` integrate :math:`e^H\pi_k`, so that

    .. math::
        p(y) \approx \sum_k \sqrt{2\pi}\,c_k^{-1/2}\sum_i w_i\,e^{t_i^2/2}\,
        e^{H(\ell_{k,i})}\,\pi_k(\ell_{k,i})

    over the probabilists' nodes :math:`t_i` and weights :math:`w_i` (in log space, the
    constants of :math:`H` included). Where the two end points coincide this is one
    Gauss–Hermite rule about the mode. The centres and scales are held fixed under autograd
    (the rule is valid for any of them): gradients are the quadrature's. Accuracy against
    ``scipy.integrate.quad``: within 5e-4 nats for :math:`\Sigma_{\ell\ell} \le 1`, 3e-3 at 4. :math:`\Sigma_{\ell\ell} = 0` gives the Gaussian
    :math:`\mathcal N(y; \langle m\rangle, \Sigma_{mm} + e^{\langle\ell\rangle})` exactly
    (``tests/test_heteroscedastic_predictive.py``).

    Args:
        mean_m: :math:`\langle m\rangle`. All tensors broadcast elementwise.
        var_m: :math:`\Sigma_{mm} \ge 0`.
        mean_l: :math:`\langle\ell\rangle`.
        var_l: :math:`\Sigma_{\ell\ell} \ge 0`.
        cov_ml: :math:`\Sigma_{m\ell}`, or ``None`` for a diag output (zero).
        y: targets, in the units of :math:`m`.
        num_nodes: Gauss–Hermite nodes.

    Returns:
        :math:`\log p(y)`, the broadcast shape of the inputs, in their dtype.

    Examples:
        >>> z, one = torch.zeros(()), torch.ones(())
        >>> point = heteroscedastic_predictive_log_prob(z, z, z, z, None, one)
        >>> bool(torch.isclose(point, torch.distributions.Normal(z, one).log_prob(one)))
        True
        >>> heavy = heteroscedastic_predictive_log_prob(z, z, z, one, None, 8 * one)
        >>> gauss = torch.distributions.Normal(z, math.exp(0.25)).log_prob(8 * one)
        >>> bool(heavy > gauss)  # the same variance, heavier tails
        True
    """
    if cov_ml is None:
        cov_ml = torch.zeros_like(mean_m)
    parts = torch.broadcast_tensors(mean_m, var_m, mean_l, var_l, cov_ml, y.to(mean_m.dtype))
    shape = parts[0].shape
    if parts[0].numel() <= PREDICTIVE_CHUNK:
        return _predictive_log_prob(parts, num_nodes)
    flat = [p.reshape(-1) for p in parts]  # the rule's temporaries are 4 * num_nodes per datum
    pieces = [
        _predictive_log_prob([p[i : i + PREDICTIVE_CHUNK] for p in flat], num_nodes)
        for i in range(0, flat[0].numel(), PREDICTIVE_CHUNK)
    ]
    return torch.cat(pieces).reshape(shape)


def heteroscedastic_conditional(
    var_m: Tensor, var_l: Tensor, cov_ml: Tensor
) -> tuple[Tensor, Tensor]:
    r"""The regression of :math:`m` on :math:`\ell` in the network's Gaussian output: ``(beta, s)``.

    .. math::
        m\mid\ell \sim \mathcal N\big(\langle m\rangle + \beta(\ell - \langle\ell\rangle),\ s\big),
        \qquad \beta = \frac{\Sigma_{m\ell}}{\Sigma_{\ell\ell}},
        \qquad s = \Sigma_{mm} - \beta\Sigma_{m\ell} \ge 0,

    with :math:`\beta = 0` where :math:`\Sigma_{\ell\ell} = 0` (a point log-variance) and
    :math:`s` clamped at 0 against rounding.

    Returns:
        ``(beta, s)``, the broadcast shape of the inputs.
    """
    point = var_l <= 0
    beta = torch.where(point, torch.zeros_like(cov_ml), cov_ml / torch.where(point, 1.0, var_l))
    return beta, (var_m - beta * cov_ml).clamp_min(0)


def _predictive_log_prob(parts: Sequence[Tensor], num_nodes: int) -> Tensor:
    """:func:`heteroscedastic_predictive_log_prob` on the broadcast ``(m, Σ_mm, ℓ, Σ_ℓℓ, Σ_mℓ, y)`` of one chunk."""
    mean_m, var_m, mean_l, var_l, cov_ml, y = parts
    point = var_l <= 0
    v = torch.where(point, torch.ones_like(var_l), var_l)
    beta, rest = heteroscedastic_conditional(var_m, var_l, cov_ml)
    log_s = rest.log()  # -inf where s = 0
    r0 = y - mean_m
    args = (mean_l, v, beta, log_s, r0)

    with torch.no_grad():  # the rule's centres and scales: any choice gives a valid rule
        tiny = math.log(torch.finfo(y.dtype).tiny) + 2.0
        start = (0.5 * v).log() + r0.square().log().clamp_min(tiny) + 0.5 * v - mean_l
        balanced = mean_l - 0.5 * v + lambert_w_of_exp(start.clamp_min(tiny))
        w0 = torch.logaddexp(log_s, mean_l).exp()
        linear = mean_l + beta * r0 * v / (w0 + beta.square() * v)  # exact for a constant e^l
        centres = torch.stack([_ascend(balanced, args), _ascend(linear, args)])  # [2, ...]
        scales = _log_integrand_derivatives(centres, *args)[1].rsqrt()
        log_mass = _log_integrand(centres, *args) + scales.log()  # Laplace: each mode's weight

    nodes, weights = gauss_hermite(num_nodes)
    t = constant(nodes, y.dtype, y.device).reshape(-1, *[1] * (y.dim() + 1))  # [n, 1, ...]
    log_w = constant(tuple(math.log(w) for w in weights), y.dtype, y.device).reshape(t.shape)
    ell = centres + scales * t  # [n, 2, ...]: the nodes of both rules
    # a partition of unity: rule k integrates the mass times pi_k = a_k phi_k / sum_j a_j phi_j
    # (a_k: log_mass, phi_k: N(centre_k, scale_k^2)); at rule k's nodes a_k phi_k is
    # exp(log a_k - t^2/2 - log scale_k), the other component is evaluated
    own = log_mass - 0.5 * t.square() - scales.log()
    other_z = (ell - centres.flip(0)) / scales.flip(0)
    other = log_mass.flip(0) - 0.5 * other_z.square() - scales.flip(0).log()
    log_joint = _log_integrand(ell, *args) - 0.5 * v.log() - _LOG_2PI
    terms = log_w + log_mass + log_joint - torch.logaddexp(own, other)
    quadrature = 0.5 * _LOG_2PI + torch.logsumexp(terms.flatten(0, 1), 0)
    log_var0 = torch.logaddexp(log_s, mean_l)
    gaussian = -0.5 * (_LOG_2PI + log_var0 + r0.square() * (-log_var0).exp())
    return torch.where(point, gaussian, quadrature)


def _ascend(start: Tensor, args: tuple[Tensor, ...]) -> Tensor:
    """A local maximum of :func:`_log_integrand` from ``start``: safeguarded Newton steps."""
    mode, height = start, _log_integrand(start, *args)
    for _ in range(PREDICTIVE_NEWTON_STEPS):
        slope, curvature = _log_integrand_derivatives(mode, *args)
        for step in (slope / curvature, 0.5 * slope / curvature):  # a halved step if worse
            trial = mode + step
            trial_height = _log_integrand(trial, *args)
            better = trial_height > height
            mode = torch.where(better, trial, mode)
            height = torch.where(better, trial_height, height)
    return mode


def _log_integrand(
    ell: Tensor, mean_l: Tensor, v: Tensor, beta: Tensor, log_s: Tensor, r0: Tensor
) -> Tensor:
    r""":math:`H(\ell)` of :func:`heteroscedastic_predictive_log_prob` up to a constant in :math:`\ell`."""
    d = ell - mean_l
    log_var = torch.logaddexp(log_s, ell)
    return -0.5 * (d.square() / v + (r0 - beta * d).square() * (-log_var).exp() + log_var)


def _log_integrand_derivatives(
    ell: Tensor, mean_l: Tensor, v: Tensor, beta: Tensor, log_s: Tensor, r0: Tensor
) -> tuple[Tensor, Tensor]:
    r""":math:`H'` and :math:`\max(-H'', 1/(4v))` of :func:`heteroscedastic_predictive_log_prob`."""
    d = ell - mean_l
    log_var = torch.logaddexp(log_s, ell)
    inv_w = (-log_var).exp()
    q = (ell - log_var).exp()
    r = r0 - beta * d
    rho = r.square() * inv_w
    slope = -d / v - 0.5 * q + beta * r * inv_w + 0.5 * rho * q
    second = (
        -1.0 / v - 0.5 * q * (1 - q) - beta.square() * inv_w - 2 * beta * r * q * inv_w
        + 0.5 * rho * q * (1 - 2 * q)
    )  # fmt: skip
    return slope, torch.maximum(-second, 0.25 / v)


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

    Accurate for small logit variances (measured against Monte Carlo: at most 0.004 nats for
    variances up to 0.1, 0.11 up to 1), but the correction grows like :math:`v/2` while the
    truth grows like :math:`\sqrt v`: 2.8 nats too low at :math:`v = 10`, 39 at
    :math:`v = 100`. :func:`categorical_clark_expected_log_prob` stays within 0.61 nats there.

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

    Warning:
        Only for small logit variances. Under an isotropic :math:`C = vI` the bracket of the
        most likely class is :math:`1 + v(\sum_k p_k^2 - p_{\max}) \le 1`, so past
        :math:`v \approx 1` the ranking inverts and the largest mean gets probability exactly
        0 after the clamp (issue 17); measured total-variation error against Monte Carlo up
        to 0.68 for variances of 10 and more. The likelihood classes use
        :func:`categorical_mean_field_predictive` instead; this function is kept as the
        paper's formula for reference.

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


def _as_full_cov(mean: Tensor, cov: Tensor) -> Tensor:
    """A full ``[..., K, K]`` covariance from a full or diag ``cov`` (validated shapes)."""
    if cov.shape == mean.shape:
        return torch.diag_embed(cov)
    if cov.shape == (*mean.shape, mean.shape[-1]):
        return cov
    raise ValueError(
        f"logit covariance shape {tuple(cov.shape)} fits neither a diag ({tuple(mean.shape)}) "
        f"nor a full ({(*mean.shape, mean.shape[-1])}) covariance for logits of shape "
        f"{tuple(mean.shape)}"
    )


def _pairwise_difference_var(mean: Tensor, cov: Tensor) -> Tensor:
    r""":math:`V_{ij} = \operatorname{Var}(a_i - a_j) = C_{ii} + C_{jj} - 2C_{ij}`, ``[..., K, K]``."""
    if cov.shape == mean.shape:
        var = cov.unsqueeze(-1) + cov.unsqueeze(-2)
        return var - torch.diag_embed(2 * cov)  # zero diagonal, as for a full C
    full = _as_full_cov(mean, cov)
    diag = full.diagonal(dim1=-2, dim2=-1)
    return (diag.unsqueeze(-1) + diag.unsqueeze(-2) - 2 * full).clamp_min(0)


def categorical_mean_field_predictive(mean: Tensor, cov: Tensor) -> Tensor:
    r"""Predictive class probabilities by the pairwise mean-field probit approximation.

    Writing :math:`\operatorname{softmax}(a)_i = 1/(1 + \sum_{j\ne i} e^{-(a_i - a_j)})` and
    integrating every pairwise logistic with the probit approximation
    :math:`\mathbb E\,\sigma(d) \approx \sigma\big(\mu_d/\sqrt{1 + \lambda\sigma_d^2}\big)`,
    :math:`\lambda = \pi/8` (MacKay 1992; the "mean-field" form of Lu, Ie & Sha 2020):

    .. math::
        \tilde p_i = \Big(1 + \sum_{j\ne i}\exp\Big(-\frac{\mu_i - \mu_j}
            {\sqrt{1 + \lambda V_{ij}}}\Big)\Big)^{-1},\qquad
        V_{ij} = C_{ii} + C_{jj} - 2C_{ij},\qquad
        \mathbb E\operatorname{softmax}(a) \approx \tilde p / \textstyle\sum_k \tilde p_k.

    With a diag ``cov``, :math:`C_{ij} = 0` for :math:`i \ne j`. It is exact for
    :math:`C = 0`, within the probit error for :math:`K = 2`, and never inverts the ranking
    of the means under an isotropic :math:`C = vI` (every :math:`V_{ij}` is the same, so
    :math:`\tilde p_i` increases with :math:`\mu_i`). Unlike the second-order delta method
    (:func:`categorical_delta_predictive`) it stays a sensible distribution for any
    variance: measured against a Monte Carlo oracle over logit variances 1e-2 to 1e2, mean
    gaps 0 to 20 and K = 2, 3, 10 (diag and correlated full covariances), the total-variation
    error is at most 0.25 (mean 0.024; at most 0.018 for K = 2 and 0.014 for variances up
    to 0.1), where the delta method reaches 0.68 (docs/likelihoods_and_priors.md).
    Pairwise comparisons cannot see that a wider logit wins the arg-max more often when the
    means tie, which is the remaining error for many classes and large variances.

    Computed in log space (:math:`\log\tilde p_i = -\operatorname{logsumexp}_j(-d_{ij})`
    with :math:`d_{ii} = 0`) and floored at the smallest normal number of the dtype, so a
    finite input never yields an exact zero (float32 included) and the NLL stays finite.

    Args:
        mean: logit means ``[..., K]``.
        cov: logit covariance, full ``[..., K, K]`` or diag ``[..., K]``.

    Returns:
        Probabilities ``[..., K]``, positive and summing to one.

    Raises:
        ValueError: if ``cov`` has neither the full nor the diag shape.

    Examples:
        >>> mean = torch.tensor([7.6, 5.3, 0.0])
        >>> probs = categorical_mean_field_predictive(mean, torch.full((3,), 30.0))
        >>> bool(probs[0] > probs[1] > probs[2] > 0)
        True
    """
    var = _pairwise_difference_var(mean, cov)
    gap = (mean.unsqueeze(-1) - mean.unsqueeze(-2)) * torch.rsqrt(1 + PROBIT_LAMBDA * var)
    log_p = torch.log_softmax(-torch.logsumexp(-gap, dim=-1), dim=-1)
    probs = log_p.exp().clamp_min(torch.finfo(log_p.dtype).tiny)
    return probs / probs.sum(-1, keepdim=True)


def _clark_expected_max(mean: Tensor, var: Tensor, cov: Tensor | None = None) -> Tensor:
    r""":math:`\mathbb E\max_k a_k`, :math:`a\sim\mathcal N(\mu, C)`, by Clark (1961).

    The running maximum is replaced by the Gaussian with its exact first two moments and
    combined with the next component; its covariances with the remaining components follow
    Clark's rule :math:`\operatorname{Cov}(\max(x, y), z) = \operatorname{Cov}(x, z)\Phi(\alpha)
    + \operatorname{Cov}(y, z)\Phi(-\alpha)`. Components are taken in the given order.

    Args:
        mean: ``[..., K]``.
        var: the variances :math:`C_{kk}`, ``[..., K]``.
        cov: the full ``C`` ``[..., K, K]``, or ``None`` for a diagonal one (then the running
            maximum is uncorrelated with the components not yet taken).
    """
    floor = torch.finfo(mean.dtype).eps
    m, v = mean[..., 0], var[..., 0]
    c = None if cov is None else cov[..., 0, :]
    for k in range(1, mean.shape[-1]):
        mk, vk = mean[..., k], var[..., k]
        theta2 = v + vk if c is None else v + vk - 2 * c[..., k]
        theta = theta2.clamp_min(floor).sqrt()
        diff = m - mk
        alpha = diff / theta
        big = torch.special.ndtr(alpha)  # P(running max > a_k)
        spread = theta * torch.exp(-0.5 * alpha.square()) * _INV_SQRT_2PI
        second_k = vk + mk.square()
        m1 = mk + diff * big + spread
        m2 = second_k + (v + m.square() - second_k) * big + (m + mk) * spread
        if c is not None and cov is not None:
            row = cov[..., k, :]
            c = row + (c - row) * big.unsqueeze(-1)
        m, v = m1, (m2 - m1.square()).clamp_min(0)
    return m


def categorical_clark_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""Expected softmax log-likelihood valid for any logit variance (smoothed-max closed form).

    :math:`\mathbb E\log\operatorname{softmax}(a)_y = \langle a_y\rangle -
    \mathbb E\operatorname{logsumexp}(a)`, and the log-sum-exp is a smoothed maximum
    (:math:`\operatorname{logsumexp}(a) = \mathbb E_g\max_k(a_k + g_k) - \gamma` for i.i.d.
    Gumbel :math:`g`). Replacing the smoothing noise by a Gaussian of variance
    :math:`\tau^2` per logit (:data:`CLARK_SMOOTHING_VAR`) gives
    :math:`\mathbb E\operatorname{logsumexp}(a) \approx M(\mu, C + \tau^2 I) + c`, with
    :math:`M(\mu, \Sigma) = \mathbb E\max_k b_k`, :math:`b\sim\mathcal N(\mu,\Sigma)`, by
    Clark's moment matching (means in ascending order). The constant is fixed so the formula
    is exact at :math:`C = 0`:

    .. math::
        \mathbb E\log\operatorname{softmax}(a)_y \approx \langle a_y\rangle
        - \operatorname{logsumexp}\langle a\rangle
        - \big[M(\langle a\rangle, C + \tau^2 I) - M(\langle a\rangle, \tau^2 I)\big].

    The bracket is :math:`\ge 0`; it grows like the expected maximum of the logit noise,
    :math:`O(\sqrt v)`, as the true value does, where the delta method's correction
    (:func:`categorical_delta_expected_log_prob`) grows like :math:`v/2`. Measured against Monte
    Carlo over logit variances 1e-2 to 1e2, mean gaps 0 to 20, K = 2, 3, 10 (diag and
    correlated full covariances), the absolute error is at most 0.59 nats (mean 0.07), against
    39 nats (mean 3.2) for the delta method; for variances up to 0.1 it is at most 0.016
    (delta: 0.006). Smooth and differentiable in ``mean`` and ``cov`` (``K - 1`` elementwise
    steps), so it can serve as the training objective.

    Args:
        mean: logit means ``[..., K]``.
        cov: logit covariance, full ``[..., K, K]`` or diag ``[..., K]``.
        y: integer labels ``[...]`` in ``[0, K)``.

    Returns:
        The expected log-likelihood ``[...]``.

    Raises:
        ValueError: if ``cov`` has neither the full nor the diag shape.

    Examples:
        >>> mean, y = torch.tensor([2.0, 0.0, 0.0]), torch.tensor(0)
        >>> plug_in = torch.log_softmax(mean, -1)[0]
        >>> bool(categorical_clark_expected_log_prob(mean, torch.zeros(3), y) == plug_in)
        True
    """
    full = _as_full_cov(mean, cov)  # validates the shape
    order = mean.argsort(dim=-1)
    m = mean.gather(-1, order)
    m2 = torch.stack([m, m])  # [C + tau^2 I, tau^2 I] in one pass of K - 1 steps
    tau2 = CLARK_SMOOTHING_VAR
    if cov.shape == mean.shape:
        var = cov.gather(-1, order)
        both = _clark_expected_max(m2, torch.stack([var + tau2, torch.full_like(var, tau2)]))
    else:
        rows = full.gather(-2, order.unsqueeze(-1).expand_as(full))
        c = rows.gather(-1, order.unsqueeze(-2).expand_as(full))
        var = c.diagonal(dim1=-2, dim2=-1)
        covs = torch.stack([c, torch.zeros_like(c)])
        both = _clark_expected_max(m2, torch.stack([var + tau2, torch.full_like(var, tau2)]), covs)
    spread = both[0] - both[1]
    log_p = torch.log_softmax(mean, dim=-1).gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
    return log_p - spread
