r"""Prior formulas on tensors: the Gaussian KL, the empirical-Bayes optimum, the hyper-prior.

Checked in ``tests/test_priors.py`` against ``torch.distributions.kl_divergence`` and a direct
``scipy.optimize`` minimisation of the empirical-Bayes objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..moments import policy

__all__ = [
    "gaussian_kl",
    "gaussian_kl_elementwise",
    "grouped_gaussian_kl",
    "inverse_gamma_log_prob",
    "optimal_variance",
]


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


def gaussian_kl_elementwise(q_loc: Tensor, q_var: Tensor, p_loc: Tensor, p_var: Tensor) -> Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(\mu_q,v_q)\,\|\,\mathcal N(\mu_p,v_p))` per element (broadcast).

    .. math::
        \mathrm{KL} = \tfrac12\Big[\frac{v_q + (\mu_q-\mu_p)^2}{v_p} - 1
        - \log\frac{v_q}{v_p}\Big].

    Used by the Pyro front-end, whose weight priors may have non-zero means.

    Examples:
        >>> z, one = torch.zeros(()), torch.ones(())
        >>> round(gaussian_kl_elementwise(z, one, z, one).item(), 6)
        0.0
    """
    return 0.5 * ((q_var + (q_loc - p_loc).square()) / p_var - 1.0 - (q_var / p_var).log())


def grouped_gaussian_kl(
    locs: Sequence[Tensor],
    scales: Sequence[Tensor],
    variances: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 10.0,
) -> tuple[Tensor, Tensor]:
    r"""Summed KL of several groups against zero-mean Gaussians, one variance per group, in one pass.

    The same value as ``sum(gaussian_kl(m, s, v) for m, s, v in zip(locs, scales, variances))``
    (and, with ``variances=None``, with each ``v`` the group's :func:`optimal_variance`), as

    .. math::
        \mathrm{KL} = \sum_\lambda \tfrac12\Big[\frac{T_\lambda}{s_\lambda}
        + n_\lambda\log s_\lambda\Big] - \sum_i\log\sigma_i - \tfrac{N}{2},
        \qquad T_\lambda = \sum_{i\in\lambda}(\sigma_i^2 + \mu_i^2),

    computed with a few whole-network ``_foreach`` ops instead of a dozen per group
    (:math:`T_\lambda` as :math:`\lVert\mu\rVert^2 + \lVert\sigma\rVert^2` from
    ``_foreach_norm``, so within a few ulps of the per-group sums). The backward pass is
    written out: per entry
    :math:`\partial\mathrm{KL}/\partial\mu_i = c_\lambda\mu_i` and
    :math:`\partial\mathrm{KL}/\partial\sigma_i = c_\lambda\sigma_i - 1/\sigma_i`, with
    :math:`c_\lambda = 1/s_\lambda` for fixed variances and, through the empirical-Bayes optimum
    :math:`s_\lambda = (T_\lambda + 2\beta)/(n_\lambda + 2\alpha + 2)`,
    :math:`c_\lambda = \big(1 + (n_\lambda - T_\lambda/s_\lambda)/(n_\lambda+2\alpha+2)\big)/s_\lambda`.
    Higher derivatives (``create_graph=True``) fall back to autograd through the per-group formulas.

    Args:
        locs: posterior means :math:`\mu`, one tensor per group (any shapes; one dtype and device).
        scales: posterior standard deviations :math:`\sigma > 0`, shaped like ``locs``.
        variances: the prior variances :math:`s_\lambda`, shape ``[G]``, used as constants; or
            ``None`` for each group's empirical-Bayes optimum, differentiated through.
        alpha: inverse-gamma shape (only with ``variances=None``).
        beta: inverse-gamma scale (only with ``variances=None``).

    Returns:
        ``(kl, s)``: the 0-dim total KL and the variances used, ``[G]`` (detached).

    Examples:
        >>> locs, scales = [torch.zeros(2, 3), torch.zeros(3)], [torch.ones(2, 3), torch.ones(3)]
        >>> kl, s = grouped_gaussian_kl(locs, scales, torch.ones(2))
        >>> round(kl.item(), 6), s.tolist()
        (0.0, [1.0, 1.0])
    """
    if len(locs) != len(scales) or not locs:
        raise ValueError(f"need as many scales as locs, at least one: {len(locs)}, {len(scales)}")
    # torch.func.grad/vmap/... and graph traces: autograd through the per-group formulas, which
    # a compiler fuses (inductor has no kernel for the Function's _foreach_norm)
    if torch._C._are_functorch_transforms_active() or policy.tracing():
        kl = _reference_grouped_kl(locs, scales, variances, alpha, beta)
        if variances is None:
            s = torch.stack(
                [optimal_variance(m, v, alpha, beta) for m, v in zip(locs, scales, strict=True)]
            )
            return kl, s.detach()
        return kl, variances.detach()
    out: tuple[Tensor, Tensor] = _GroupedKL.apply(
        variances, float(alpha), float(beta), len(locs), *locs, *scales
    )
    return out


def _reference_grouped_kl(
    locs: Sequence[Tensor],
    scales: Sequence[Tensor],
    variances: Tensor | None,
    alpha: float,
    beta: float,
) -> Tensor:
    """The per-group formulas, for autograd (the double-backward path of :class:`_GroupedKL`)."""
    terms = []
    for k, (loc, scale) in enumerate(zip(locs, scales, strict=True)):
        v = optimal_variance(loc, scale, alpha, beta) if variances is None else variances[k]
        terms.append(gaussian_kl(loc, scale, v))
    return torch.stack(terms).sum()


_CONSTANTS: dict[
    tuple[tuple[int, ...], float, torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]
] = {}


def _group_constants(
    sizes: tuple[int, ...], alpha: float, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``n``, :math:`c = n + 2\alpha + 2` and :math:`c + n` of groups of ``sizes``; never written to.

    Cached per network shape (a host-to-device copy saved per step on accelerators); built
    afresh while ``torch.compile`` traces, where they become graph constants.
    """
    key = (sizes, alpha, dtype, device)
    if policy.tracing() or key not in _CONSTANTS:
        n = torch.tensor(sizes, dtype=dtype, device=device)
        made = (n, n + (2 * alpha + 2), 2 * n + (2 * alpha + 2))
        if policy.tracing():
            return made
        if len(_CONSTANTS) >= 64:
            _CONSTANTS.clear()
        _CONSTANTS[key] = made
    return _CONSTANTS[key]


class _GroupedKL(torch.autograd.Function):
    r"""Forward in no-grad ``_foreach`` ops on the groups' tensors; backward written out.

    :math:`T_\lambda = \lVert\mu_\lambda\rVert^2 + \lVert\sigma_\lambda\rVert^2` from one
    ``_foreach_norm`` of all tensors, and the per-entry gradients
    :math:`c_\lambda\mu_i` and :math:`c_\lambda\sigma_i - 1/\sigma_i` from a few
    ``_foreach`` ops: about 30 aten ops for forward and backward of four groups (one view per
    group more), where concatenating, splitting and per-group sums took about 50.
    With the empirical-Bayes optimum, :math:`k_\lambda s_\lambda = T_\lambda + 2\beta` for
    :math:`k_\lambda = n_\lambda + 2\alpha + 2`, so the gradient coefficient of
    :func:`grouped_gaussian_kl` is
    :math:`(1 + (n_\lambda - T_\lambda/s_\lambda)/k_\lambda)/s_\lambda
    = (k_\lambda + n_\lambda - T_\lambda/s_\lambda)/(T_\lambda + 2\beta)`.
    """

    # Old-style ``forward(ctx, ...)``: a ``setup_context`` would make every ``apply`` bind its
    # arguments with ``inspect.signature`` (~60 us); torch.func transforms take the reference
    # path instead (see ``grouped_gaussian_kl``).
    @staticmethod
    def forward(
        ctx: Any,
        variances: Tensor | None,
        alpha: float,
        beta: float,
        num_groups: int,
        *tensors: Tensor,
    ) -> tuple[Tensor, Tensor]:
        scales = tensors[num_groups:]
        sizes = tuple(t.numel() for t in tensors[:num_groups])
        norms = torch.stack(torch._foreach_norm(list(tensors)))  # [2G]: |mu|, then |sigma|
        t = (norms * norms).view(2, num_groups).sum(0)  # T = |mu|^2 + |sigma|^2 per group
        log_sum = torch.cat([sc.reshape(-1) for sc in scales]).log().sum()
        n, c, c_plus_n = _group_constants(sizes, alpha, t.dtype, t.device)
        if variances is None:
            t_beta = t + 2 * beta  # c s
            s = t_beta / c
        else:
            s = variances.to(dtype=t.dtype, device=t.device)
        t_over_s = t / s
        per_group = torch.addcmul(t_over_s, n, s.log())  # T/s + n log s
        kl = (per_group.sum().sub_(log_sum, alpha=2) - sum(sizes)).mul_(0.5)
        coef = (c_plus_n - t_over_s).div_(t_beta) if variances is None else s.reciprocal()
        ctx.mark_non_differentiable(s)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(coef, *tensors)
        ctx.hyper = (variances, alpha, beta, num_groups)
        return kl, s

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, _: Tensor | None) -> tuple[Tensor | None, ...]:
        if grad is None:
            return (None,) * (4 + len(ctx.saved_tensors) - 1)
        coef, *tensors = ctx.saved_tensors
        variances, alpha, beta, num_groups = ctx.hyper
        if torch.is_grad_enabled():  # create_graph=True: differentiate the per-group formulas
            with torch.enable_grad():
                kl = _reference_grouped_kl(
                    tensors[:num_groups], tensors[num_groups:], variances, alpha, beta
                )
                grads = torch.autograd.grad(kl, tensors, grad, create_graph=True, allow_unused=True)
            return (None, None, None, None, *grads)
        # c g mu for the means; c g sigma - g / sigma for the scales
        per_group = list((coef * grad).unbind())
        scales = tensors[num_groups:]
        out = torch._foreach_mul(tensors, per_group + per_group)
        scale_grads = out[num_groups:]
        torch._foreach_addcmul_(
            scale_grads, torch._foreach_reciprocal(scales), [grad.neg()] * num_groups
        )
        return (None, None, None, None, *out)
