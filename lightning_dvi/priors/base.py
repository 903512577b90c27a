"""Priors over the weights of declared BNN modules, and the fixed zero-mean Gaussian prior."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..configurable import RecordsInitArgs
from ..nn import ParameterGroup, named_parameter_groups, parameter_groups
from .functional import gaussian_kl, grouped_gaussian_kl

__all__ = ["GaussianPrior", "Prior", "named_parameter_groups"]


class Prior(RecordsInitArgs, nn.Module):
    r"""A factorised zero-mean Gaussian prior, one variance per parameter group.

    A group is a weight matrix or a bias vector of a :class:`~lightning_dvi.nn.BayesLinear`
    (see :func:`lightning_dvi.nn.parameter_groups`). Subclasses choose the variance of each
    group via :meth:`variance`; the KL against the factorised posterior is analytic.

    Every subclass records the arguments its constructor was called with (``init_args``), which
    is what a checkpoint stores of a prior given to a front end as an object
    (:func:`~lightning_dvi.priors.register_prior` allows a class of your own to be rebuilt).
    """

    def initial_variance(self, default: float) -> float:
        """The prior variance the front ends' built-in MLP starts its layers from.

        The layers' prior-variance buffers and their initial posterior scales follow it. The
        base class: ``default`` (the front end's ``prior_variance``).
        """
        return default

    def variance(self, group: ParameterGroup) -> Tensor:
        """The prior variance :math:`s` used for ``group`` (0-dim tensor)."""
        raise NotImplementedError

    def group_kl(self, group: ParameterGroup) -> Tensor:
        r""":math:`\mathrm{KL}(q\,\|\,\mathcal N(0, s))` summed over the group's entries (0-dim)."""
        return self._kl_at(group, self.variance(group))

    @staticmethod
    def _kl_at(group: ParameterGroup, variance: Tensor) -> Tensor:
        return gaussian_kl(group.loc, group.scale, variance)

    def kl(self, net: nn.Module) -> Tensor:
        r"""Total :math:`\mathrm{KL}(q(w)\,\|\,p(w))` over every group in ``net`` (0-dim).

        The built-in priors compute all groups in one pass
        (:func:`~lightning_dvi.priors.functional.grouped_gaussian_kl`); a subclass that overrides
        :meth:`variance` or :meth:`group_kl` gets the sum of its :meth:`group_kl` per group.
        A group of a correlated posterior adds its ``correlation_kl`` (prior-free), which makes
        the total the full-Gaussian KL (:mod:`lightning_dvi.moments.full_cov_linear`).

        Raises:
            ValueError: if ``net`` has no :class:`~lightning_dvi.nn.BayesLinear` layer.
        """
        groups = parameter_groups(net)
        if not groups:
            raise ValueError(
                f"{type(self).__name__}.kl: {type(net).__name__} has no BayesLinear layers, "
                "so there is no weight posterior to compare with the prior"
            )
        fused = self._grouped_kl(groups) if _same_dtype_and_device(groups) else None
        if fused is None:
            fused = torch.stack([self.group_kl(g) for g in groups]).sum()
        correlated = [g.correlation_kl for g in groups if g.correlation_kl is not None]
        if correlated:  # correlated posteriors: the KL beyond that of their marginals
            fused = fused + torch.stack([c.to(fused) for c in correlated]).sum()
        return fused

    def _grouped_kl(self, groups: list[ParameterGroup]) -> Tensor | None:
        """:meth:`kl` of ``groups`` in one pass, or ``None`` to sum :meth:`group_kl` instead."""
        return None

    def _overrides(self, owner: type, *names: str) -> bool:
        """Whether ``type(self)`` redefines any of ``names`` that ``owner`` defines."""
        cls = type(self)
        return any(getattr(cls, name) is not getattr(owner, name) for name in names)

    def forward(self, net: nn.Module) -> Tensor:
        """Calling the prior on a network returns :meth:`kl`."""
        return self.kl(net)


def _same_dtype_and_device(groups: list[ParameterGroup]) -> bool:
    loc = groups[0].loc
    dtype, device = loc.dtype, loc.device
    return all(t.dtype == dtype and t.device == device for g in groups for t in (g.loc, g.scale))


class GaussianPrior(Prior):
    r"""Fixed prior :math:`w_i \sim \mathcal N(0, s)` with the same variance for every group.

    .. math::
        \mathrm{KL}(\mathcal N(\mu,\sigma^2)\,\|\,\mathcal N(0,s))
        = \tfrac12\sum_i\Big[\frac{\sigma_i^2+\mu_i^2}{s} - 1 - \log\frac{\sigma_i^2}{s}\Big].

    Args:
        variance: :math:`s > 0`.

    Examples:
        >>> from lightning_dvi.nn import mlp
        >>> GaussianPrior(1.0).kl(mlp(1, [8], 2)).dim()
        0
    """

    def __init__(self, variance: float = 1.0) -> None:
        super().__init__()
        if not (isinstance(variance, (int, float)) and math.isfinite(variance) and variance > 0):
            raise ValueError(
                f"GaussianPrior variance must be a finite number > 0, got {variance!r}"
            )
        self.prior_variance = float(variance)

    def variance(self, group: ParameterGroup) -> Tensor:
        """The fixed :math:`s`, in the group's dtype and device."""
        return torch.tensor(self.prior_variance, dtype=group.loc.dtype, device=group.loc.device)

    def _grouped_kl(self, groups: list[ParameterGroup]) -> Tensor | None:
        if self._overrides(GaussianPrior, "variance", "group_kl", "_kl_at"):
            return None
        loc = groups[0].loc
        s = torch.full((len(groups),), self.prior_variance, dtype=loc.dtype, device=loc.device)
        kl, _ = grouped_gaussian_kl([g.loc for g in groups], [g.scale for g in groups], s)
        return kl

    def initial_variance(self, default: float) -> float:
        """The fixed :math:`s` (the layers start where the prior is)."""
        return self.prior_variance

    def extra_repr(self) -> str:
        """The fixed variance."""
        return f"variance={self.prior_variance}"
