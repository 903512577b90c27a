r"""A linear layer with a full-covariance Gaussian posterior over its weights and bias (a head).

The math is :mod:`lightning_dvi.moments.full_cov_linear`; this module holds the parameters:
the posterior mean :math:`\tilde M = [W, b]` (``weight_loc`` ``[K, D]`` and ``bias_loc``
``[K]``) and a Cholesky factor
:math:`L` of :math:`\Sigma` over :math:`\operatorname{vec}\tilde M`: its strictly lower part is
free (``tril``), its diagonal is positive through the library's scale transform
(``raw_diag``, ``softplus`` by default). Meant for a network's last layer (VBLL's dense
full-covariance head does the same for variational Bayesian last layers): ``K(D+1)`` up to a
few thousand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..moments import full_cov_linear as FC
from ..propagation import MomentPass, Propagation
from .base import Moments, WeightLayer
from .linear import (
    BayesLinear,
    ScaleTransform,
    _affine_values,
    check_linear_input,
    posterior_init_settings,
)
from .posterior import (
    ParameterGroup,
    _raw_from_scale,
    _scale_from_raw,
    cached_scale,
    substituted,
)
from .registry import register_layer

__all__ = ["BayesLinearFullCov"]


@register_layer("linear_full_cov", kind="weight")
class BayesLinearFullCov(WeightLayer):
    r"""Linear layer :math:`a = hW^\top + b` with :math:`\operatorname{vec}[W, b] \sim \mathcal N(\operatorname{vec}\tilde M, LL^\top)`.

    Unlike :class:`BayesLinear` (independent weights, so independent outputs given the input)
    the outputs are correlated: for a deterministic input
    :math:`\operatorname{Cov}(a_k, a_l) = \tilde h^\top\Sigma_{kl}\tilde h` with
    :math:`\tilde h = [h, 1]`. In ``full`` mode the output Gaussian carries that covariance
    (also for a deterministic input); ``diag`` mode keeps its diagonal, as for every layer.
    ``sample`` draws one correlated weight matrix per sample, ``local`` one per example and
    sample.

    It has a posterior (:class:`~lightning_dvi.nn.HasPosterior`): two prior groups, ``weight``
    and ``bias``, whose ``scale`` is the marginal standard deviation
    :math:`\sqrt{\Sigma_{ii}}`, and the weight group carries the correlation term of the KL
    (:func:`~lightning_dvi.moments.full_cov_linear.correlation_kl`), so the priors' KL is the
    full-Gaussian KL and empirical Bayes sees the marginals. A front-end that substitutes
    factorised moments for the groups (the Pyro pass) gets the factorised layer.

    Args:
        in_features: input size :math:`D`.
        out_features: output size :math:`K`.
        init_loc_std: std of the initial weight means (default He, :math:`\sqrt{2/D}`).
        init_scale: initial posterior std of the weights (default :math:`0.1/\sqrt{D}`);
            the initial :math:`L` is diagonal.
        init_bias_scale: initial posterior std of the bias (default a tenth of ``init_scale``).
        prior_variance: initial value of the prior-variance buffers.
        scale_transform: ``"softplus"`` or ``"exp"`` for the diagonal of :math:`L`.

    Examples:
        >>> layer = BayesLinearFullCov(3, 2)
        >>> with torch.no_grad():  # L starts diagonal (independent weights); training correlates
        ...     _ = layer.tril.normal_(0.0, 0.1)
        >>> out = layer(torch.randn(5, 3), mode="full")
        >>> tuple(out.cov.shape), bool(out.cov[0, 0, 1] != 0)
        ((5, 2, 2), True)
    """

    scale_transform: str
    init_loc_std: float
    init_scale: float
    init_bias_scale: float

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        init_loc_std: float | None = None,
        init_scale: float | None = None,
        init_bias_scale: float | None = None,
        prior_variance: float = 1.0,
        scale_transform: ScaleTransform = "softplus",
    ) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"features must be positive, got ({in_features}, {out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.init_loc_std, self.init_scale, self.init_bias_scale = posterior_init_settings(
            in_features, init_loc_std, init_scale, init_bias_scale, prior_variance, scale_transform
        )
        self.scale_transform = scale_transform
        size = out_features * (in_features + 1)
        self.weight_loc = nn.Parameter(torch.empty(out_features, in_features))
        self.bias_loc = nn.Parameter(torch.empty(out_features))
        self.tril = nn.Parameter(torch.zeros(size, size))
        self.raw_diag = nn.Parameter(torch.empty(size))
        self.weight_prior_variance: Tensor
        self.bias_prior_variance: Tensor
        self.register_buffer("weight_prior_variance", torch.tensor(float(prior_variance)))
        self.register_buffer("bias_prior_variance", torch.tensor(float(prior_variance)))
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    def _positive(self, raw: Tensor) -> Tensor:
        return _scale_from_raw(raw, self.scale_transform)

    def _raw(self, scale: Tensor) -> Tensor:
        return _raw_from_scale(scale, self.scale_transform)

    def reset_parameters(self) -> None:
        """Re-draw the means; a diagonal :math:`L` at the initial scales."""
        d = self.in_features
        with torch.no_grad():
            self.weight_loc.normal_(0.0, self.init_loc_std)
            self.bias_loc.zero_()
            scales = self.weight_loc.new_full((self.out_features, d + 1), self.init_scale)
            scales[:, d] = self.init_bias_scale
            self.raw_diag.copy_(self._raw(scales.flatten()))
            self.tril.zero_()

    @property
    def loc(self) -> Tensor:
        r"""The posterior mean :math:`\tilde M = [W, b]` ``[K, D + 1]``."""
        return torch.cat([self.weight_loc, self.bias_loc.unsqueeze(-1)], dim=-1)

    @property
    def scale_tril(self) -> Tensor:
        r""":math:`L` ``[P, P]``: the strict lower part of ``tril`` plus the positive diagonal."""
        diag = cached_scale(self, self.raw_diag, "diag", self._positive)
        return torch.tril(self.tril, diagonal=-1) + torch.diag_embed(diag)

    @property
    def covariance(self) -> Tensor:
        r""":math:`\Sigma = LL^\top` over :math:`\operatorname{vec}[W, b]` ``[P, P]``."""
        tril = self.scale_tril
        return tril @ tril.transpose(-1, -2)

    @torch.no_grad()
    def set_posterior(
        self, weight: Tensor, weight_scale: Tensor, bias: Tensor, bias_scale: Tensor
    ) -> None:
        """Set the means and a *diagonal* :math:`L` (independent weights at these stds).

        Raises:
            ValueError: on shape mismatches or negative / non-finite values.
        """
        d = self.in_features
        for name, loc, scale, shape in (
            ("weight", weight, weight_scale, (self.out_features, d)),
            ("bias", bias, bias_scale, (self.out_features,)),
        ):
            if tuple(loc.shape) != shape or tuple(scale.shape) != shape:
                raise ValueError(
                    f"{name}: expected shape {shape}, got mean {tuple(loc.shape)} and scale "
                    f"{tuple(scale.shape)}"
                )
            if (
                not torch.isfinite(loc).all()
                or not torch.isfinite(scale).all()
                or (scale < 0).any()
            ):
                raise ValueError(f"{name}: means must be finite and scales finite and >= 0")
        self.weight_loc.copy_(weight)
        self.bias_loc.copy_(bias)
        scales = torch.cat([weight_scale, bias_scale.unsqueeze(-1)], dim=-1).to(self.raw_diag)
        self.raw_diag.copy_(self._raw(scales.flatten()))
        self.tril.zero_()

    @classmethod
    def from_bayes_linear(cls, layer: BayesLinear) -> BayesLinearFullCov:
        """The full-covariance layer with ``layer``'s means and (independent) scales.

        How ``from_torch(..., head_covariance="full")`` builds its head: convert as usual,
        then swap each :class:`BayesLinear` of the head for this layer. A layer without bias
        gets a bias with mean 0 and the smallest of its weight scales (it has one here).
        """
        new = cls(
            layer.in_features,
            layer.out_features,
            prior_variance=float(layer.weight_prior_variance),
            scale_transform=cast(ScaleTransform, layer.scale_transform),
        ).to(layer.weight_loc)
        w_scale = layer.weight_scale.detach()
        b_loc: Tensor = torch.zeros_like(w_scale[:, 0])
        b_scale: Tensor = w_scale.min(-1).values
        if layer.bias_loc is not None and layer.bias_scale is not None:
            b_loc, b_scale = layer.bias_loc.detach(), layer.bias_scale.detach()
        new.set_posterior(layer.weight_loc.detach(), w_scale, b_loc, b_scale)
        return new

    def parameter_groups(self) -> list[ParameterGroup]:
        """``weight`` and ``bias`` at their marginal stds; the weight group holds the correlation KL."""
        tril = self.scale_tril
        std = FC.marginal_variances(tril).sqrt().reshape(self.out_features, -1)
        d = self.in_features
        return [
            ParameterGroup(
                "weight",
                self.weight_loc,
                std[:, :d],
                self.weight_prior_variance,
                self,
                correlation_kl=FC.correlation_kl(tril),
            ),
            ParameterGroup("bias", self.bias_loc, std[:, d], self.bias_prior_variance, self),
        ]

    # ------------------------------------------------------------------ propagation
    def check_input(self, x: Moments, mode: Propagation) -> None:
        """Refuse an input of another dtype than the weights, or of another width."""
        check_linear_input(self, x, self.weight_loc.dtype, self.in_features)

    def propagate_moments(self, x: Tensor | Gaussian, mode: MomentPass) -> Gaussian:
        """The output Gaussian, correlated across outputs (:mod:`~lightning_dvi.moments.full_cov_linear`).

        Factorised moments substituted by a front-end give the factorised layer's output.
        """
        given = substituted(self)
        if given is not None:
            w_loc, w_var = given["weight"]
            b_loc, b_var = given.get("bias", (None, None))
            return M.linear_moments(x, w_loc, cast(Tensor, w_var), b_loc, b_var, mode=mode)
        loc, tril = self.loc, self.scale_tril
        if isinstance(x, Gaussian):
            if mode.diag or x.cov is None:
                mean, cov = FC.full_cov_linear_gaussian(x.mean, x.var, loc, tril, diagonal=True)
            else:
                mean, cov = FC.full_cov_linear_gaussian(x.mean, x.cov, loc, tril, diagonal=False)
        else:
            mean, cov = FC.full_cov_linear_deterministic(x, loc, tril)
        if mode.diag:
            return Gaussian(mean, var=cov.diagonal(dim1=-2, dim2=-1).clone(), validate=False)
        return Gaussian(mean, cov=cov, validate=False)

    def propagate_given(self, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor:
        """``x W^T + b`` for weight values (as :class:`BayesLinear`)."""
        return _affine_values(x, weights["weight"], weights.get("bias"))

    def propagate_samples(self, x: Tensor) -> Tensor:
        """One correlated draw of :math:`[W, b]` per sample (:func:`~lightning_dvi.moments.full_cov_linear.full_cov_linear_sample`)."""
        if substituted(self) is not None:  # factorised moments: independent draws
            return super().propagate_samples(x)
        return FC.full_cov_linear_sample(x, self.loc, self.scale_tril)

    def propagate_local(self, x: Tensor) -> Tensor:
        """One correlated draw per example and sample: the output's exact correlated Gaussian."""
        if substituted(self) is not None:
            return super().propagate_local(x)
        return FC.full_cov_linear_local(x, self.loc, self.scale_tril)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """``Cov(r, hW^T + b) = Cov(r, h) M^T`` (weights independent of ``r``)."""
        return M.cross_through_linear(cross, self.weight_loc)

    def extra_repr(self) -> str:
        """Shapes and options for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scale_transform={self.scale_transform!r}"
        )
