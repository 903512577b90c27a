r"""Convolutional BNN modules: ``BayesConv2d``, ``AvgPool2d``, ``MaxPool2d`` and ``Flatten``.

Thin modules over :mod:`lightning_dvi.moments.conv` and :mod:`lightning_dvi.moments.pooling`.
Image moments are diag :class:`~lightning_dvi.Gaussian` objects whose mean and variance are
``[B, C, H, W]``; in the Monte Carlo modes the tensors carry a leading sample dimension,
``[S, B, C, H, W]``.

**The full-mode rule.** Convolutional stages always propagate *diagonal* moments (per-pixel
variances); a full covariance over ``C·H·W`` units would cost :math:`O((CHW)^3)` per example.
In ``mode="full"`` a network therefore runs its conv blocks (conv, activation, pooling) in
diag storage, :class:`Flatten` hands a diag Gaussian ``[B, C·H·W]`` to the dense head, and the
first :class:`~lightning_dvi.nn.BayesLinear` after it *lifts to full*: a diag input gives the
exact full output covariance :math:`\operatorname{diag}(E[h^2]V^\top + u) +
M\operatorname{diag}(\operatorname{Var} h)M^\top` (dense units share inputs, so they are
correlated even when the inputs are not). From there on the dense head is full DVI. In
``mode="diag"`` everything is diagonal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..propagation import MomentPass, Propagation
from .base import BayesModule, Moments
from .linear import FactorisedLayer, ScaleTransform, init_factorised_posterior
from .registry import ConversionOptions, copy_torch_posterior, register_layer

__all__ = [
    "AvgPool2d",
    "BayesConv2d",
    "Flatten",
    "MaxPool2d",
    "unsupported_conv2d_options",
    "unsupported_pool2d_options",
]


def _pair(v: int | tuple[int, ...], name: str) -> tuple[int, int]:
    pair = (v, v) if isinstance(v, int) else tuple(int(i) for i in v)
    if len(pair) != 2 or any(isinstance(i, bool) for i in pair):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    return pair[0], pair[1]


def _is_one(v: Any) -> bool:
    return v in (1, (1, 1), [1, 1])


def unsupported_conv2d_options(
    groups: int = 1, dilation: Any = 1, padding: Any = 0, padding_mode: str = "zeros"
) -> str | None:
    """What :class:`BayesConv2d` requires of torch ``conv2d`` options they break, else ``None``.

    One check for every front-end: :func:`~lightning_dvi.nn.from_torch` converting an
    ``nn.Conv2d`` and the Pyro moment pass running ``F.conv2d``.
    """
    if groups != 1 or not _is_one(dilation) or isinstance(padding, str) or padding_mode != "zeros":
        return "groups=1, dilation=1, padding_mode='zeros' and numeric padding"
    return None


def unsupported_pool2d_options(
    padding: Any = 0,
    ceil_mode: bool = False,
    dilation: Any = 1,
    divisor_override: int | None = None,
    return_indices: bool = False,
    allow_padding: bool = False,
) -> str | None:
    """What :class:`AvgPool2d`/:class:`MaxPool2d` require of torch pooling options, else ``None``.

    Shared as :func:`unsupported_conv2d_options` is. ``allow_padding``: max pooling pads
    (with units that never win); average pooling does not.
    """
    if allow_padding:
        padding = 0
    if (
        padding not in (0, (0, 0), [0, 0])
        or ceil_mode
        or not _is_one(dilation)
        or divisor_override is not None
        or return_indices
    ):
        padded = "" if allow_padding else "padding=0 and "
        return f"{padded}ceil_mode=False (and the default dilation, divisor and indices)"
    return None


def _image_shape(owner: str, x: Moments, mode: Propagation) -> tuple[int, ...]:
    """Check that ``x`` is an image batch and return the user-facing shape ``[B, C, H, W]``."""
    if isinstance(x, Gaussian) and x.is_full:
        raise ValueError(
            f"{owner} needs per-pixel (diag) moments, got a full-covariance Gaussian of shape "
            f"{tuple(x.shape)}; image stages run before the dense head (see lightning_dvi.nn.conv)"
        )
    shape = tuple(x.shape)
    image = shape[1:] if mode.samples and isinstance(x, Tensor) else shape
    if len(image) != 4:
        raise ValueError(f"{owner} expects an image batch [B, C, H, W] (4-D), got shape {image}")
    return image


def _flat_samples(x: Tensor) -> tuple[Tensor, tuple[int, int]]:
    s, b = x.shape[:2]
    return x.reshape(s * b, *x.shape[2:]), (s, b)


def _conv_values(x: Tensor, weight: Tensor, bias: Tensor | None, conv: dict[str, Any]) -> Tensor:
    """The convolution of ``x [S, B, C, H, W]`` with given weight *values*.

    ``weight`` is ``[C_out, C_in, kH, kW]`` or one per sample, ``[S, C_out, ...]`` (a draw, or
    a Pyro sample through :func:`~lightning_dvi.nn.given_weights`, whose batch of draws
    broadcasts against ``S``).
    """
    s = max(x.shape[0], weight.shape[0] if weight.dim() == 5 else 1)
    weight = weight.expand(s, *weight.shape[-4:])
    bias = None if bias is None else bias.expand(s, bias.shape[-1])
    return M.conv2d_sample(x.expand(s, *x.shape[1:]), weight, bias, **conv)


def _from_torch_conv2d(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Conv2d)  # the registry converts only its torch_modules
    required = unsupported_conv2d_options(
        module.groups, module.dilation, module.padding, module.padding_mode
    )
    if required is not None:
        raise NotImplementedError(f"only Conv2d with {required} is supported")
    padding = cast("int | tuple[int, ...]", module.padding)  # a str padding was refused above
    layer = BayesConv2d(
        module.in_channels,
        module.out_channels,
        _pair(module.kernel_size, "kernel_size"),
        stride=_pair(module.stride, "stride"),
        padding=_pair(padding, "padding"),
        bias=module.bias is not None,
        **options.layer_kwargs,
    ).to(device=module.weight.device, dtype=module.weight.dtype)
    copy_torch_posterior(layer, module, options)
    return layer


def _from_torch_pool2d(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, (nn.AvgPool2d, nn.MaxPool2d))
    required = unsupported_pool2d_options(
        module.padding,
        module.ceil_mode,
        getattr(module, "dilation", 1),
        getattr(module, "divisor_override", None),
        getattr(module, "return_indices", False),
        allow_padding=isinstance(module, nn.MaxPool2d),
    )
    if required is not None:
        raise NotImplementedError(f"only {type(module).__name__} with {required} is supported")
    if isinstance(module, nn.MaxPool2d):
        return MaxPool2d(module.kernel_size, module.stride, padding=module.padding)
    return AvgPool2d(module.kernel_size, module.stride)


@register_layer("conv2d", kind="weight", torch_modules=(nn.Conv2d,), convert=_from_torch_conv2d)
class BayesConv2d(FactorisedLayer):
    r"""2-D convolution with a factorised Gaussian posterior over kernels and bias.

    :math:`a = \operatorname{conv}(h, W) + b` with :math:`q(W_{o,c,u,v}) = \mathcal N(M, S^2)`
    per kernel entry, parameterised like :class:`~lightning_dvi.nn.BayesLinear` (softplus or
    exp scales, persistent prior-variance buffers, one prior group for the kernel and one for
    the bias), so priors, empirical Bayes and the KL treat it like a dense layer.

    Modes: ``diag`` (and ``full``, see the module docstring) propagate per-pixel moments by
    :func:`~lightning_dvi.moments.conv2d_diag`; ``sample`` draws one whole kernel per sample
    (a grouped convolution); ``local`` samples each output unit from its exact Gaussian given
    the input (local reparameterisation).

    Args:
        in_channels: input channels :math:`C_\text{in}`.
        out_channels: output channels :math:`C_\text{out}`.
        kernel_size: ``k`` or ``(kH, kW)``.
        stride: convolution stride.
        padding: zero padding on each side.
        bias: learn a Gaussian bias per output channel.
        init_loc_std: std of the initial kernel means; default He,
            :math:`\sqrt{2/\text{fan\_in}}` with :math:`\text{fan\_in} = C_\text{in} k_H k_W`.
        init_scale: initial posterior std; default :math:`0.1\sqrt{1/\text{fan\_in}}`.
        init_bias_scale: initial posterior std of the bias; default ``init_scale / 10``.
        prior_variance: initial value of the prior-variance buffers.
        scale_transform: ``"softplus"`` or ``"exp"``.

    Examples:
        >>> import torch
        >>> conv = BayesConv2d(1, 4, 3, padding=1)
        >>> out = conv(torch.randn(2, 1, 8, 8), mode="diag")
        >>> tuple(out.mean.shape), tuple(out.var.shape)
        ((2, 4, 8, 8), (2, 4, 8, 8))
    """

    image_output = True

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = True,
        *,
        init_loc_std: float | None = None,
        init_scale: float | None = None,
        init_bias_scale: float | None = None,
        prior_variance: float = 1.0,
        scale_transform: ScaleTransform = "softplus",
    ) -> None:
        super().__init__()
        if in_channels < 1 or out_channels < 1:
            raise ValueError(f"channels must be positive, got ({in_channels}, {out_channels})")
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.padding = _pair(padding, "padding")
        if min(self.kernel_size) < 1 or min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(
                "kernel_size and stride must be positive and padding non-negative, got "
                f"{self.kernel_size}, {self.stride}, {self.padding}"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        fan_in = in_channels * self.kernel_size[0] * self.kernel_size[1]
        init_factorised_posterior(
            self, (out_channels, in_channels, *self.kernel_size), fan_in, bias,
            init_loc_std, init_scale, init_bias_scale, prior_variance, scale_transform,
        )  # fmt: skip
        self.reset_parameters()

    # ------------------------------------------------------------------ propagation
    def check_input(self, x: Moments, mode: Propagation) -> None:
        """Refuse an input of another dtype than the kernels, not an image, or of other channels."""
        if x.dtype != self.weight_loc.dtype:
            raise ValueError(
                f"BayesConv2d parameters are {self.weight_loc.dtype} but the input is "
                f"{x.dtype}; convert one of them (e.g. net.double() or x.float())"
            )
        shape = _image_shape("BayesConv2d", x, mode)
        if shape[1] != self.in_channels:
            raise ValueError(
                f"BayesConv2d expected {self.in_channels} input channels, got {shape[1]} "
                f"(input shape {shape}, read as [B, C, H, W])"
            )

    def propagate_moments(self, x: Tensor | Gaussian, mode: MomentPass) -> Gaussian:
        """Per-pixel output moments in every storage (:func:`~lightning_dvi.moments.conv2d_moments`)."""
        w_loc, w_var, b_loc, b_var = self._moments()
        conv = {"stride": self.stride, "padding": self.padding}
        return M.conv2d_moments(x, w_loc, cast(Tensor, w_var), b_loc, b_var, **conv)

    def propagate_given(self, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor:
        """The convolution of ``x [S, B, C, H, W]`` with kernel values (one per sample, or shared)."""
        conv = {"stride": self.stride, "padding": self.padding}
        return _conv_values(x, weights["weight"], weights.get("bias"), conv)

    def extra_repr(self) -> str:
        """Shapes and options for ``repr``."""
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, bias={self.bias_loc is not None}, "
            f"scale_transform={self.scale_transform!r}"
        )


class _Pool2d(BayesModule):
    _name: str
    image_output = True

    def __init__(
        self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else _pair(stride, "stride")
        if min(self.kernel_size) < 1 or min(self.stride) < 1:
            raise ValueError(
                f"kernel_size and stride must be positive, got {self.kernel_size}, {self.stride}"
            )

    def _tensor(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _moments(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:  # pragma: no cover
        raise NotImplementedError

    padding = (0, 0)

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Pool a tensor (any mode) or per-pixel moments (``full``/``diag``)."""
        shape = _image_shape(self._name, x, mode)
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        if shape[2] + 2 * ph < kh or shape[3] + 2 * pw < kw:
            raise ValueError(
                f"{self._name}: pooling window {self.kernel_size} is larger than the image "
                f"{tuple(shape[2:])}"
            )
        if isinstance(x, Tensor):
            if mode.samples:
                flat, (s, b) = _flat_samples(x)
                out = self._tensor(flat)
                return out.reshape(s, b, *out.shape[1:])
            return self._tensor(x)
        mean, var = self._moments(x.mean, x.var)
        return Gaussian(mean, var=var, validate=False)

    def extra_repr(self) -> str:
        """Window and stride for ``repr``."""
        return f"kernel_size={self.kernel_size}, stride={self.stride}"


@register_layer(
    "avg_pool2d", kind="pooling", torch_modules=(nn.AvgPool2d,), convert=_from_torch_pool2d
)
class AvgPool2d(_Pool2d):
    r"""Average pooling (no padding); exact on independent Gaussian pixels.

    :math:`E = \operatorname{avgpool}(E[h])`,
    :math:`\operatorname{Var} = \operatorname{avgpool}(\operatorname{Var}h)/(k_Hk_W)`
    (:func:`~lightning_dvi.moments.avg_pool2d_diag`).

    Examples:
        >>> import torch
        >>> from lightning_dvi import Gaussian
        >>> g = Gaussian(torch.zeros(1, 1, 2, 2), var=torch.ones(1, 1, 2, 2))
        >>> AvgPool2d(2)(g, mode="diag").var.flatten().tolist()
        [0.25]
    """

    _name = "AvgPool2d"

    def _tensor(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride)

    def _moments(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        return M.avg_pool2d_diag(mean, var, self.kernel_size, self.stride)


@register_layer(
    "max_pool2d", kind="pooling", torch_modules=(nn.MaxPool2d,), convert=_from_torch_pool2d
)
class MaxPool2d(_Pool2d):
    r"""Max pooling, moment-matched on Gaussian pixels.

    The output pixel is the Gaussian with the mean and variance of the maximum of its window's
    (independent) Gaussian pixels (:func:`~lightning_dvi.moments.max_pool2d_diag`):
    ``method="quadrature"`` (default) computes them exactly by 1-D quadrature of the CDF of the
    maximum; ``method="clark"`` applies Clark's formulas for the maximum of two Gaussians
    sequentially over the window (cheaper; exact only for two-unit windows).

    Args:
        kernel_size: window ``k`` or ``(kH, kW)``.
        stride: default ``kernel_size``.
        method: ``"quadrature"`` or ``"clark"``.
        points: quadrature nodes.
        padding: units added on each side, which never win (torch's ``-inf`` padding; at most
            half the window). ResNet's stem pools with ``kernel_size=3, stride=2, padding=1``.
    """

    _name = "MaxPool2d"

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        method: str = "quadrature",
        points: int = 64,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__(kernel_size, stride)
        self.padding = _pair(padding, "padding")
        if min(self.padding) < 0 or any(
            2 * p > k for p, k in zip(self.padding, self.kernel_size, strict=True)
        ):
            raise ValueError(
                f"padding must be >= 0 and at most half the window, got {self.padding}"
            )
        if method not in ("quadrature", "clark"):
            raise ValueError(f"method must be 'quadrature' or 'clark', got {method!r}")
        if isinstance(points, bool) or not isinstance(points, int) or points < 2:
            raise ValueError(f"points must be an int >= 2, got {points!r}")
        self.method = method
        self.points = points

    def _tensor(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def _moments(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        return M.max_pool2d_diag(
            mean, var, self.kernel_size, self.stride, self.method, self.points, self.padding
        )

    def extra_repr(self) -> str:
        """Window, stride and padding for ``repr``."""
        return f"{super().extra_repr()}, padding={self.padding}"


@register_layer("flatten", kind="shape")
class Flatten(BayesModule):
    """Flatten images ``[B, C, H, W]`` to ``[B, C·H·W]`` (means and variances alike).

    The diag Gaussian it returns is what lifts to full covariance at the next
    :class:`~lightning_dvi.nn.BayesLinear` in ``mode="full"`` (see the module docstring).

    Examples:
        >>> import torch
        >>> Flatten()(torch.zeros(2, 3, 4, 4), mode="diag").shape
        torch.Size([2, 48])
    """

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Reshape the last three dimensions into one."""
        _image_shape("Flatten", x, mode)
        if isinstance(x, Tensor):
            return x.flatten(-3)
        return Gaussian(x.mean.flatten(-3), var=x.var.flatten(-3), validate=False)
