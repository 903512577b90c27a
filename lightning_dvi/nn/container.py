"""Containers: Sequential chains and Residual (skip-connection) blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..propagation import Propagation
from .base import BayesModule, Moments, as_mode
from .registry import register_layer

__all__ = ["Residual", "Sequential"]


def _check_modules(owner: str, modules: tuple[nn.Module, ...]) -> None:
    if not modules:
        raise ValueError(f"{owner} needs at least one module")
    for m in modules:
        if not isinstance(m, BayesModule):
            raise TypeError(
                f"{owner} accepts lightning_dvi.nn modules only (BayesLinear, ReLU, Heaviside, "
                f"Residual, Sequential); got {type(m).__name__}"
            )


@register_layer("sequential", kind="container")
class Sequential(BayesModule):
    """Chain of declared modules, run in any of the four modes.

    Examples:
        >>> from lightning_dvi.nn import BayesLinear, ReLU
        >>> net = Sequential(BayesLinear(1, 16), ReLU(), BayesLinear(16, 2))
        >>> out = net(torch.randn(8, 1), mode="full")
        >>> tuple(out.mean.shape), tuple(out.cov.shape)
        ((8, 2), (8, 2, 2))
        >>> tuple(net(torch.randn(8, 1), mode="sample", num_samples=3).shape)
        (3, 8, 2)
    """

    def __init__(self, *modules: BayesModule) -> None:
        super().__init__()
        _check_modules("Sequential", modules)
        self.layers = nn.ModuleList(modules)

    @property
    def image_output(self) -> bool | None:
        """Whether the chain returns per-pixel moments (its last non-elementwise module's)."""
        for layer in reversed(list(self)):
            if layer.image_output is not None:
                return layer.image_output
        return None

    @property
    def accepts_integer_input(self) -> bool:  # type: ignore[override]  # a property here
        """Whether the first layer takes integer ids (an embedding table)."""
        return bool(self[0].accepts_integer_input)

    def __iter__(self) -> Iterator[BayesModule]:
        return cast(Iterator[BayesModule], iter(self.layers))  # _check_modules admits no other

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, idx: int) -> BayesModule:
        return cast(BayesModule, self.layers[idx])

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Run the layers in order."""
        for layer in self:
            x = layer.propagate(x, mode)
        return x

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """Carry a cross-covariance through the layers in order."""
        return self.propagate_with_cross(cross, x, mode)[0]

    def propagate_with_cross(
        self, cross: Tensor, x: Gaussian, mode: Propagation
    ) -> tuple[Tensor, Moments]:
        """The cross-covariance and the moments through the layers, in one walk."""
        h: Moments = x
        for layer in self:
            # a Gaussian in a moment mode gives a Gaussian out of every layer
            cross, h = layer.propagate_with_cross(cross, cast(Gaussian, h), mode)
        return cross, h


@register_layer("residual", kind="container")
class Residual(BayesModule):
    r"""Skip connection :math:`a = a' + \delta(a')` around a branch of declared modules.

    The branch (e.g. ``ReLU(), BayesLinear(d, d)``) must map width ``d`` to width ``d``. In the
    moment modes the cross-covariance :math:`\operatorname{Cov}(a', \delta)` is carried through
    the branch (see :mod:`lightning_dvi.moments.residual`), so
    :math:`\operatorname{Cov}(a) = \Sigma' + \Sigma_\delta + X + X^\top` (paper appendix C).
    In ``diag`` mode only the diagonal of the result is kept.
    """

    def __init__(self, *modules: BayesModule) -> None:
        super().__init__()
        _check_modules("Residual", modules)
        self.branch = Sequential(*modules)

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Moments or samples of ``x + branch(x)``."""
        if not isinstance(x, Gaussian):
            delta = self.branch.propagate(x, mode)
            if isinstance(delta, Gaussian):  # deterministic skip input: no cross term
                return _shift(delta, x)
            return x + delta
        return self._skip(x, None, mode)[1]

    def _skip(
        self, x: Gaussian, cross: Tensor | None, mode: Propagation
    ) -> tuple[Tensor, Gaussian]:
        r"""``(Cov(r, a' + delta), a' + delta)``, walking the branch once.

        :math:`\operatorname{Cov}(a', \delta)` and, when ``cross`` is given,
        :math:`\operatorname{Cov}(r, \delta)` both follow the branch row by row, so they travel
        stacked as one ``[..., D_r + D, D]`` cross-covariance.
        """
        x = as_mode(x, mode)
        own = M.skip_covariance(x)
        rows = 0
        if cross is not None:
            rows = cross.shape[-2]
            batch = torch.broadcast_shapes(cross.shape[:-2], own.shape[:-2])
            own = torch.cat(
                [cross.expand(*batch, *cross.shape[-2:]), own.expand(*batch, *own.shape[-2:])], -2
            )
        stacked, delta = self.branch.propagate_with_cross(own, x, mode)
        if not isinstance(delta, Gaussian):
            raise ValueError("Residual branch must contain a BayesLinear layer")
        out = M.residual_moments(x, delta, stacked[..., rows:, :])
        outer = stacked if cross is None else cross + stacked[..., :rows, :]
        return outer, out

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """``Cov(r, a' + delta) = Cov(r, a') + Cov(r, delta)``."""
        return self._skip(x, cross, mode)[0]

    def propagate_with_cross(
        self, cross: Tensor, x: Gaussian, mode: Propagation
    ) -> tuple[Tensor, Moments]:
        """The cross-covariance and the moments of ``a' + delta`` in one walk of the branch."""
        return self._skip(x, cross, mode)


def _shift(g: Gaussian, x: Tensor) -> Gaussian:
    if g.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"Residual branch maps width {x.shape[-1]} to {g.shape[-1]}; a skip connection "
            "needs equal widths"
        )
    return M.add_independent(g, x)  # a constant shift keeps g's storage
