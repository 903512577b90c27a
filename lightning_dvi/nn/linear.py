"""Bayesian linear layer with a factorised Gaussian posterior over weights and bias."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, cast

import torch
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..propagation import MomentPass, Propagation
from .base import BayesModule, Moments, WeightLayer
from .posterior import (
    ParameterGroup,
    WeightMoments,
    _scale_from_raw,
    cached_scale,
    given_weights,
    posterior_moments,
    shared_scales,
)
from .registry import ConversionOptions, copy_torch_posterior, register_layer

__all__ = [
    "BayesLinear",
    "FactorisedLayer",
    "ParameterGroup",
    "WeightMoments",
    "given_weights",
    "shared_scales",
]

ScaleTransform = Literal["softplus", "exp"]


def _affine_values(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if weight.dim() > 2 and x.dim() > weight.dim():
        # one weight draw per leading sample index [S, out, in], shared by every further batch
        # dimension of x [S, B, ..., in] (tokens of a sequence): [S, 1, ..., out, in]
        ones = (1,) * (x.dim() - weight.dim())
        weight = weight.reshape(*weight.shape[:-2], *ones, *weight.shape[-2:])
        if bias is not None:
            bias = bias.reshape(*bias.shape[:-1], *ones, bias.shape[-1])
    out = x @ weight.transpose(-1, -2)  # batched weights [..., out, in] broadcast too
    return out if bias is None else out + bias.unsqueeze(-2)


def check_linear_input(
    layer: nn.Module, x: Moments, weight_dtype: torch.dtype, in_features: int
) -> None:
    """Refuse an input of another dtype than the weights, or of another width.

    Raises:
        ValueError: naming the layer's class, both dtypes or both widths.
    """
    name = type(layer).__name__
    if x.dtype != weight_dtype:
        raise ValueError(
            f"{name} parameters are {weight_dtype} but the input is {x.dtype}; "
            "convert one of them (e.g. net.double() or x.float())"
        )
    d = x.mean.shape[-1] if isinstance(x, Gaussian) else x.shape[-1]
    if d != in_features:
        raise ValueError(
            f"{name} expected input with last dimension {in_features}, got {d} "
            f"(input shape {tuple(x.shape)})"
        )


def _inverse_softplus(x: float) -> float:
    return x + math.log(-math.expm1(-x))


class FactorisedLayer(WeightLayer):
    """What :class:`BayesLinear` and :class:`~lightning_dvi.nn.BayesConv2d` share.

    The factorised Gaussian posterior that :func:`init_factorised_posterior` registers (its
    attributes are declared here for the type checker), the positivity transform of the
    scales, the prior groups (:class:`~lightning_dvi.nn.HasPosterior`) and the weight moments.
    A new weight layer may subclass it (and write :meth:`~WeightLayer.propagate_moments` and
    :meth:`~WeightLayer.propagate_given`), subclass :class:`~lightning_dvi.nn.WeightLayer`, or
    implement the protocol on its own.
    """

    weight_loc: nn.Parameter
    weight_raw_scale: nn.Parameter
    bias_loc: nn.Parameter | None
    bias_raw_scale: nn.Parameter | None
    weight_prior_variance: Tensor
    bias_prior_variance: Tensor | None
    scale_transform: str
    init_loc_std: float
    init_scale: float
    init_bias_scale: float

    def _raw(self, scale: float) -> float:
        return _inverse_softplus(scale) if self.scale_transform == "softplus" else math.log(scale)

    def _positive(self, raw: Tensor) -> Tensor:
        return _scale_from_raw(raw, self.scale_transform)

    def reset_parameters(self) -> None:
        """Re-draw the means and reset the scales to their initial values."""
        with torch.no_grad():
            self.weight_loc.normal_(0.0, self.init_loc_std)
            self.weight_raw_scale.fill_(self._raw(self.init_scale))
            if self.bias_loc is not None and self.bias_raw_scale is not None:
                self.bias_loc.zero_()
                self.bias_raw_scale.fill_(self._raw(self.init_bias_scale))

    def _scale(self, raw: Tensor, which: str) -> Tensor:
        return cached_scale(self, raw, which, self._positive)

    def raw_scales(self) -> list[tuple[str, Tensor]]:
        """``(group name, raw scale)`` of the softplus-transformed scales (none for ``exp``).

        What :func:`~lightning_dvi.nn.shared_scales` computes up front for a whole network.
        """
        if self.scale_transform != "softplus":
            return []
        out: list[tuple[str, Tensor]] = [("weight", self.weight_raw_scale)]
        if self.bias_raw_scale is not None:
            out.append(("bias", self.bias_raw_scale))
        return out

    @property
    def weight_scale(self) -> Tensor:
        """Posterior standard deviations of the weights ``[out, in]``."""
        return self._scale(self.weight_raw_scale, "weight")

    @property
    def bias_scale(self) -> Tensor | None:
        """Posterior standard deviations of the bias ``[out]`` (``None`` without bias)."""
        return None if self.bias_raw_scale is None else self._scale(self.bias_raw_scale, "bias")

    def parameter_groups(self) -> list[ParameterGroup]:
        """The weight matrix and bias vector as separate prior groups (paper section 4)."""
        groups = [
            ParameterGroup(
                "weight", self.weight_loc, self.weight_scale, self.weight_prior_variance, self
            )
        ]
        if self.bias_loc is not None:
            # bias_loc, bias_raw_scale and bias_prior_variance are registered together
            b_scale, b_prior = cast(Tensor, self.bias_scale), cast(Tensor, self.bias_prior_variance)
            groups.append(ParameterGroup("bias", self.bias_loc, b_scale, b_prior, self))
        return groups

    def _moments(self) -> WeightMoments:
        groups = posterior_moments(self)
        w_loc, w_var = groups["weight"]
        b_loc, b_var = groups.get("bias", (None, None))
        return w_loc, w_var, b_loc, b_var


def posterior_init_settings(
    fan_in: int,
    init_loc_std: float | None,
    init_scale: float | None,
    init_bias_scale: float | None,
    prior_variance: float,
    scale_transform: str,
) -> tuple[float, float, float]:
    r"""Validate a weight layer's posterior arguments; its ``(init_loc_std, init_scale, init_bias_scale)``.

    Shared by every Gaussian weight layer (:func:`init_factorised_posterior`,
    :class:`~lightning_dvi.nn.BayesLinearFullCov`): ``init_loc_std`` defaults to
    :math:`\sqrt{2/\mathrm{fan_{in}}}` (He), ``init_scale`` to
    :math:`0.1/\sqrt{\mathrm{fan_{in}}}` and ``init_bias_scale`` to a tenth of
    ``init_scale``. Each of the three and ``prior_variance`` must be finite and
    positive, and ``scale_transform`` one of ``"softplus"``, ``"exp"``.
    """
    if scale_transform not in ("softplus", "exp"):
        raise ValueError(f"scale_transform must be 'softplus' or 'exp', got {scale_transform!r}")
    if not (math.isfinite(prior_variance) and prior_variance > 0):
        raise ValueError(f"prior_variance must be finite and positive, got {prior_variance}")
    loc_std = math.sqrt(2.0 / fan_in) if init_loc_std is None else init_loc_std
    scale = 0.1 * math.sqrt(1.0 / fan_in) if init_scale is None else init_scale
    bias_scale = scale / 10 if init_bias_scale is None else init_bias_scale
    for name, value in (
        ("init_loc_std", loc_std),
        ("init_scale", scale),
        ("init_bias_scale", bias_scale),
    ):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and positive, got {value!r}")
    return loc_std, scale, bias_scale


def init_factorised_posterior(
    layer: FactorisedLayer,
    weight_shape: tuple[int, ...],
    fan_in: int,
    bias: bool,
    init_loc_std: float | None,
    init_scale: float | None,
    init_bias_scale: float | None,
    prior_variance: float,
    scale_transform: str,
) -> None:
    r"""Validate and register a factorised Gaussian posterior on ``layer`` (weights and bias).

    Shared by :class:`BayesLinear` and :class:`~lightning_dvi.nn.BayesConv2d`: the parameters
    ``weight_loc``/``weight_raw_scale`` (``weight_shape``) and ``bias_loc``/``bias_raw_scale``
    (``weight_shape[0]``, or ``None``), the persistent prior-variance buffers, and the
    initialisation defaults from ``fan_in`` (means :math:`\mathcal N(0, 2/\mathrm{fan_{in}})`,
    scales :math:`0.1/\sqrt{\mathrm{fan_{in}}}`, bias scales a tenth of that). The caller then
    calls ``reset_parameters()``.
    """
    layer.init_loc_std, layer.init_scale, layer.init_bias_scale = posterior_init_settings(
        fan_in, init_loc_std, init_scale, init_bias_scale, prior_variance, scale_transform
    )
    layer.scale_transform = scale_transform
    layer.weight_loc = nn.Parameter(torch.empty(weight_shape))
    layer.weight_raw_scale = nn.Parameter(torch.empty(weight_shape))
    layer.register_buffer("weight_prior_variance", torch.tensor(float(prior_variance)))
    if bias:
        layer.bias_loc = nn.Parameter(torch.empty(weight_shape[0]))
        layer.bias_raw_scale = nn.Parameter(torch.empty(weight_shape[0]))
        layer.register_buffer("bias_prior_variance", torch.tensor(float(prior_variance)))
    else:
        layer.register_parameter("bias_loc", None)
        layer.register_parameter("bias_raw_scale", None)
        layer.register_buffer("bias_prior_variance", None)


def _from_torch_linear(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Linear)  # the registry converts only its torch_modules
    layer = BayesLinear(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        **options.layer_kwargs,
    ).to(device=module.weight.device, dtype=module.weight.dtype)
    copy_torch_posterior(layer, module, options)
    return layer


@register_layer("linear", kind="weight", torch_modules=(nn.Linear,), convert=_from_torch_linear)
class BayesLinear(FactorisedLayer):
    r"""Linear layer :math:`a = hW^\top + b` with :math:`q(W_{kj}) = \mathcal N(M_{kj}, S_{kj}^2)`.

    Posterior scales are parameterised through ``softplus`` (default) or ``exp`` of an
    unconstrained tensor, so they stay positive under any optimiser.

    Args:
        in_features: input size.
        out_features: output size.
        bias: learn a Gaussian bias.
        init_loc_std: std of the initial weight means; default He, :math:`\sqrt{2/\text{fan\_in}}`.
        init_scale: initial posterior std of the weights; default
            :math:`0.1\sqrt{1/\text{fan\_in}}` (small, so the data term dominates early).
        init_bias_scale: initial posterior std of the bias; default a tenth of ``init_scale``.
        prior_variance: initial value of the persistent prior-variance buffers (used by the
            empirical-Bayes prior in buffer mode and logged by callbacks).
        scale_transform: ``"softplus"`` or ``"exp"``.

    Examples:
        >>> layer = BayesLinear(3, 2)
        >>> out = layer(torch.randn(5, 3), mode="full")
        >>> tuple(out.cov.shape)
        (5, 2, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
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
        self.in_features = in_features
        self.out_features = out_features
        init_factorised_posterior(
            self, (out_features, in_features), in_features, bias,
            init_loc_std, init_scale, init_bias_scale, prior_variance, scale_transform,
        )  # fmt: skip
        self.reset_parameters()

    # ------------------------------------------------------------------ propagation
    def check_input(self, x: Moments, mode: Propagation) -> None:
        """Refuse an input of another dtype than the weights, or of another width."""
        check_linear_input(self, x, self.weight_loc.dtype, self.in_features)

    def propagate_moments(self, x: Tensor | Gaussian, mode: MomentPass) -> Gaussian:
        """The output Gaussian (:func:`~lightning_dvi.moments.linear_moments`)."""
        w_loc, w_var, b_loc, b_var = self._moments()
        return M.linear_moments(x, w_loc, cast(Tensor, w_var), b_loc, b_var, mode=mode)

    def propagate_given(self, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor:
        """``x W^T + b`` for weight values; sequences ``x [S, B, T, in]`` share sample ``s``'s draw."""
        return _affine_values(x, weights["weight"], weights.get("bias"))

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """``Cov(r, hW^T + b) = Cov(r, h) M^T`` (weights independent of ``r``)."""
        return M.cross_through_linear(cross, self._moments()[0])

    def extra_repr(self) -> str:
        """Shapes and options for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias_loc is not None}, scale_transform={self.scale_transform!r}"
        )
