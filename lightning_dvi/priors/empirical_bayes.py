"""The hierarchical inverse-gamma prior of paper section 4, fitted by empirical Bayes."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn import ParameterGroup
from .base import Prior, named_parameter_groups
from .functional import grouped_gaussian_kl, inverse_gamma_log_prob, optimal_variance

__all__ = ["EmpiricalBayes"]

_MODES = ("in_graph", "buffer")


class EmpiricalBayes(Prior):
    r"""Empirical-Bayes prior: :math:`s_\lambda\sim\mathrm{IG}(\alpha,\beta)`, :math:`w_i^\lambda\sim\mathcal N(0,s_\lambda)`.

    One prior variance per group :math:`\lambda` (weight matrix or bias vector), set to the
    type-2 MAP optimum

    .. math::
        s_\lambda^* = \arg\min_s\big\{\mathrm{KL}(q_\lambda\,\|\,\mathcal N(0,s))
        - \log\mathrm{IG}(s;\alpha,\beta)\big\}
        = \frac{\sum_{i\in\lambda}(\sigma_i^2+\mu_i^2) + 2\beta}{n_\lambda + 2\alpha + 2}.

    :meth:`kl` returns :math:`\sum_\lambda\mathrm{KL}(q_\lambda\,\|\,\mathcal N(0, s_\lambda))`
    **without** the hyper-prior term :math:`-\log\mathrm{IG}(s_\lambda)`, so it is a true KL
    between Gaussians; :meth:`hyperprior_log_prob` gives that term separately for anyone who
    wants the paper's full type-2 MAP objective (it does not change :math:`s^*` in buffer mode,
    and in in-graph mode it only adds an :math:`O(1)` term per group).

    Modes:

    * ``"in_graph"`` (the authors' choice): :math:`s^*` is computed inside :meth:`kl` from the
      current posterior, gradients flow through it, and its detached value is copied into the
      layer's ``{weight,bias}_prior_variance`` buffer so checkpoints and loggers see it.
    * ``"buffer"``: :meth:`kl` uses the buffers as constants; :meth:`refresh` recomputes
      :math:`s^*` without gradient and writes the buffers (the Lightning callback calls it every
      k steps). The buffers start at the layers' ``prior_variance`` until the first refresh.

    Args:
        alpha: inverse-gamma shape :math:`\alpha > 0`.
        beta: inverse-gamma scale :math:`\beta > 0`.
        mode: ``"in_graph"`` or ``"buffer"``.

    Examples:
        >>> from lightning_dvi.nn import mlp
        >>> net = mlp(1, [8], 2)
        >>> prior = EmpiricalBayes(mode="buffer")
        >>> sorted(prior.refresh(net))
        ['layers.0.bias', 'layers.0.weight', 'layers.2.bias', 'layers.2.weight']
    """

    def __init__(self, alpha: float = 1.0, beta: float = 10.0, mode: str = "in_graph") -> None:
        super().__init__()
        for name, value in (("alpha", alpha), ("beta", beta)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"EmpiricalBayes {name} must be a finite number > 0, got {value!r}"
                )
        if mode not in _MODES:
            raise ValueError(
                f"EmpiricalBayes mode must be one of {', '.join(_MODES)}, got {mode!r}"
            )
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.mode = mode

    def optimal_variance(self, loc: Tensor, scale: Tensor) -> Tensor:
        r""":math:`s^* = (\sum(\sigma^2+\mu^2) + 2\beta) / (n + 2\alpha + 2)`, 0-dim, differentiable."""
        return optimal_variance(loc, scale, self.alpha, self.beta)

    def variance(self, group: ParameterGroup) -> Tensor:
        """:math:`s^*` with gradient (``in_graph``) or the group's buffer (``buffer``)."""
        if self.mode == "in_graph":
            return self.optimal_variance(group.loc, group.scale)
        return group.prior_variance.to(dtype=group.loc.dtype)

    def group_kl(self, group: ParameterGroup) -> Tensor:
        r""":math:`\mathrm{KL}(q_\lambda\,\|\,\mathcal N(0, s_\lambda))`; in-graph mode also records :math:`s^*`."""
        s = self.variance(group)
        if self.mode == "in_graph":
            with torch.no_grad():
                group.prior_variance.copy_(s.detach())
        return self._kl_at(group, s)

    def _grouped_kl(self, groups: list[ParameterGroup]) -> Tensor | None:
        if self._overrides(EmpiricalBayes, "variance", "group_kl", "_kl_at", "optimal_variance"):
            return None
        locs, scales = [g.loc for g in groups], [g.scale for g in groups]
        buffers = [g.prior_variance for g in groups]
        if self.mode == "buffer":
            kl, _ = grouped_gaussian_kl(locs, scales, torch.stack(buffers))
            return kl
        kl, s = grouped_gaussian_kl(locs, scales, None, self.alpha, self.beta)
        with torch.no_grad():
            torch._foreach_copy_(buffers, s.unbind())
        return kl

    @torch.no_grad()
    def refresh(self, net: nn.Module) -> dict[str, float]:
        """Recompute :math:`s^*` for every group without gradient and store it in the buffers.

        Returns:
            ``{"layers.0.weight": s, ...}`` with names from ``net.named_modules()``.
        """
        values: dict[str, float] = {}
        for name, group in named_parameter_groups(net):
            s = self.optimal_variance(group.loc, group.scale)
            group.prior_variance.copy_(s)
            values[name] = float(s)
        return values

    def hyperprior_log_prob(self, net: nn.Module) -> Tensor:
        r""":math:`\sum_\lambda\log\mathrm{IG}(s_\lambda;\alpha,\beta)` at the variances :meth:`kl` uses (0-dim)."""
        terms = [
            inverse_gamma_log_prob(self.variance(g), self.alpha, self.beta)
            for _, g in named_parameter_groups(net)
        ]
        if not terms:
            raise ValueError(f"{type(net).__name__} has no BayesLinear layers")
        return torch.stack(terms).sum()

    def extra_repr(self) -> str:
        """Hyper-parameters and mode."""
        return f"alpha={self.alpha}, beta={self.beta}, mode={self.mode!r}"
