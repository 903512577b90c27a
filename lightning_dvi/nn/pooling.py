r"""Adaptive average pooling (``nn.AdaptiveAvgPool2d``) for declared and converted networks.

With an output size that divides the input, adaptive average pooling is average pooling with
window and stride :math:`(H/H_o, W/W_o)`, so its moments are those of
:func:`~lightning_dvi.moments.avg_pool2d_diag`, exact on independent Gaussian pixels:
:math:`E = \operatorname{avgpool}(E[h])`,
:math:`\operatorname{Var} = \operatorname{avgpool}(\operatorname{Var} h)/(k_H k_W)`. ResNet's
global pool (output ``(1, 1)``) is the mean over all pixels of each channel. An output size that
does not divide the input (torch's overlapping windows) is refused.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..propagation import Propagation
from .base import BayesModule, Moments
from .registry import ConversionOptions, register_layer

__all__ = ["AdaptiveAvgPool2d"]

_OutputSize = int | tuple[int | None, int | None] | list[int | None] | None


def _output_pair(size: _OutputSize) -> tuple[int | None, int | None]:
    pair = (size, size) if size is None or isinstance(size, int) else tuple(size)
    if len(pair) != 2 or any(
        v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in pair
    ):
        raise ValueError(f"output_size must be a positive int or a pair of them, got {size!r}")
    return pair[0], pair[1]


def _from_torch(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.AdaptiveAvgPool2d)
    return AdaptiveAvgPool2d(module.output_size)


@register_layer(
    "adaptive_avg_pool2d",
    kind="pooling",
    torch_modules=(nn.AdaptiveAvgPool2d,),
    torch_functions=(F.adaptive_avg_pool2d,),
    convert=_from_torch,
    from_call=lambda output_size: AdaptiveAvgPool2d(output_size),
)
class AdaptiveAvgPool2d(BayesModule):
    """Average pooling to a fixed output size that divides the input (exact moments).

    Args:
        output_size: ``(H_o, W_o)``, an int for both, or ``None`` in a place to keep that size.

    Raises:
        ValueError: on propagation, when the output size does not divide the input's.

    Examples:
        >>> import torch
        >>> from lightning_dvi import Gaussian
        >>> g = Gaussian(torch.zeros(1, 1, 2, 2), var=torch.ones(1, 1, 2, 2))
        >>> AdaptiveAvgPool2d(1)(g, mode="diag").var.flatten().tolist()
        [0.25]
    """

    image_output = True

    def __init__(self, output_size: _OutputSize) -> None:
        super().__init__()
        self.output_size = _output_pair(output_size)

    def window(self, height: int, width: int) -> tuple[int, int]:
        """The window (= stride) ``(H/H_o, W/W_o)`` for an input of this size."""
        window = []
        for size, out in zip((height, width), self.output_size, strict=True):
            out = size if out is None else out
            if size % out:
                raise ValueError(
                    f"AdaptiveAvgPool2d: output size {self.output_size} does not divide the input "
                    f"size {(height, width)}; only evenly dividing sizes are supported (exact "
                    "average pooling)"
                )
            window.append(size // out)
        return window[0], window[1]

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Pool a tensor (any mode) or per-pixel moments (``full``/``diag``)."""
        if (isinstance(x, Gaussian) and x.is_full) or len(x.shape) < 4:
            raise ValueError(
                f"AdaptiveAvgPool2d expects an image batch [B, C, H, W] with per-pixel moments, "
                f"got {'a full-covariance Gaussian of ' if isinstance(x, Gaussian) else ''}"
                f"shape {tuple(x.shape)}"
            )
        window = self.window(x.shape[-2], x.shape[-1])
        if isinstance(x, Tensor):
            flat = x.reshape(-1, *x.shape[-3:])
            out = F.avg_pool2d(flat, window, window)
            return out.reshape(*x.shape[:-3], *out.shape[-3:])
        mean, var = M.avg_pool2d_diag(x.mean, x.var, window, window)
        return Gaussian(mean, var=var, validate=False)

    def extra_repr(self) -> str:
        """The output size for ``repr``."""
        return f"output_size={self.output_size}"
