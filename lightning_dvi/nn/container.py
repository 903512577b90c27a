"""Containers: Sequential chains and Residual (skip-connection) blocks."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from .base import BayesModule, Moments, as_mode

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
    def image_output(self) -> bool | None:  # type: ignore[override]
        """Whether the chain returns per-pixel moments (its last non-elementwise module's)."""
        for layer in reversed(self.layers):
            if layer.image_output is not None:
                return layer.image_output
        return None

    def __iter__(self) -> Iterator[BayesModule]:
        return iter(self.layers)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, idx: int) -> BayesModule:
        return self.layers[idx]  # type: ignore[return-value]

    def propagate(self, x: Moments, mode: str) -> Moments:
        """Run the layers in order."""
        for layer in self.layers:
            x = layer.propagate(x, mode)
        return x

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: str) -> Tensor:
        """Carry a cross-covariance through the layers in order."""
        for layer in self.layers:
            cross = layer.propagate_cross(cross, x, mode)
            x = layer.propagate(x, mode)  # type: ignore[assignment]
        return cross


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

    def propagate(self, x: Moments, mode: str) -> Moments:
        """Moments or samples of ``x + branch(x)``."""
        if not isinstance(x, Gaussian):
            delta = self.branch.propagate(x, mode)
            if isinstance(delta, Gaussian):  # deterministic skip input: no cross term
                return _shift(delta, x)
            return x + delta
        x = as_mode(x, mode)
        cross, delta = self._branch_with_cross(x, mode)
        self._check_width(x, delta)
        if x.is_full:
            mean, cov = M.residual_full(x.mean, x.cov, delta.mean, delta.cov, cross)  # type: ignore[arg-type]
            return Gaussian(mean, cov=cov, validate=False)
        mean, var = M.residual_diag(x.mean, x.var, delta.mean, delta.var, cross)
        return Gaussian(mean, var=var, validate=False)

    def _branch_with_cross(self, x: Gaussian, mode: str) -> tuple[Tensor, Gaussian]:
        cross = x.cov if x.is_full else torch.diag_embed(x.var)
        h: Moments = x
        for layer in self.branch:
            cross = layer.propagate_cross(cross, h, mode)  # type: ignore[arg-type]
            h = layer.propagate(h, mode)
        if not isinstance(h, Gaussian):
            raise ValueError("Residual branch must contain a BayesLinear layer")
        return cross, h

    @staticmethod
    def _check_width(x: Gaussian, delta: Gaussian) -> None:
        if delta.mean.shape[-1] != x.mean.shape[-1]:
            raise ValueError(
                f"Residual branch maps width {x.mean.shape[-1]} to {delta.mean.shape[-1]}; "
                "a skip connection needs equal widths"
            )

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: str) -> Tensor:
        """``Cov(r, a' + delta) = Cov(r, a') + Cov(r, delta)``."""
        # Cov(r, a' + delta) = Cov(r, a') + Cov(r, delta), and delta's cross follows the branch.
        return cross + self.branch.propagate_cross(cross, as_mode(x, mode), mode)


def _shift(g: Gaussian, x: Tensor) -> Gaussian:
    if g.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"Residual branch maps width {x.shape[-1]} to {g.shape[-1]}; a skip connection "
            "needs equal widths"
        )
    if g.is_full:
        return Gaussian(g.mean + x, cov=g.cov, validate=False)
    return Gaussian(g.mean + x, var=g.var, validate=False)
