"""The Gaussian container that moment propagation passes between layers."""

from __future__ import annotations

import math
from types import EllipsisType
from typing import cast

import torch
from torch import Tensor

from ._tracing import tracing
from .propagation import MODES, Mode, propagation

__all__ = [
    "MODES",
    "MOMENT_MODES",
    "MONTE_CARLO_MODES",
    "Gaussian",
    "Mode",
    "NonFiniteMomentsError",
    "validate_mode",
]


class NonFiniteMomentsError(ValueError):
    """A :class:`Gaussian`'s mean or (co)variance holds NaN or Inf (a ``ValueError``).

    Its own class so that a search over settings (a posterior-scale factor, say) can score a
    setting whose moments overflow as infinitely bad instead of stopping.
    """


MOMENT_MODES = ("full", "diag")
"""The shorthands of the modes that propagate moments (a Gaussian out)."""
MONTE_CARLO_MODES = ("sample", "local")
"""The shorthands of the modes that draw samples (a tensor ``[S, B, D]`` out)."""


def all_finite(x: Tensor) -> bool:
    """``torch.isfinite(x).all()`` in two ops in the common case instead of five.

    A finite sum implies finite entries (a NaN or an infinity makes the sum NaN or infinite);
    only a non-finite sum, which may also be an overflow of finite entries, gets the exact check.
    One host read either way. While ``torch.compile`` traces it answers ``True`` (a host read
    would split the graph): the caller checks outside (:mod:`lightning_dvi.compile` validates
    inputs and targets before the compiled region).
    """
    if tracing():
        return True
    return math.isfinite(x.sum().item()) or bool(torch.isfinite(x).all())


_IndexItem = int | slice | EllipsisType | Tensor | list[int] | None
BatchIndex = _IndexItem | tuple[_IndexItem, ...]
"""What :meth:`Gaussian.__getitem__` accepts: an index of the batch dimensions, as for a tensor."""


def validate_mode(mode: object) -> Mode:
    """Return ``mode`` (typed :data:`Mode`) if it is one of ``full``, ``diag``, ``sample``, ``local``.

    The shorthand check of :func:`lightning_dvi.propagation.propagation`, kept for callers of
    this name.

    Raises:
        ValueError: naming the unknown mode and the valid ones.
    """
    return propagation(mode).name  # type: ignore[arg-type]  # a str is checked there


class Gaussian:
    r"""A batch of multivariate Gaussians :math:`\mathcal N(\mu, \Sigma)` over the last dimension.

    Two storage kinds share one interface:

    * **full** (DVI): ``cov`` of shape ``[..., D, D]`` is stored and ``var`` is its diagonal;
    * **diag** (dDVI): only ``var`` of shape ``[..., D]`` is stored and ``cov`` is ``None``.

    Exactly one of ``cov`` and ``var`` must be given.

    Args:
        mean: means, shape ``[..., D]``.
        cov: full covariances, shape ``[..., D, D]`` (symmetric; checked for obvious
            non-PSD-ness, i.e. a negative diagonal).
        var: per-unit variances, shape ``[..., D]`` (non-negative).
        validate: run the shape/dtype/NaN checks (cheap; disable only in hot loops whose
            inputs were already validated).

    Raises:
        ValueError: on mismatched shapes, dtypes or devices, NaN/Inf entries, or negative
            variances.

    Examples:
        >>> g = Gaussian(torch.zeros(4, 3), var=torch.ones(4, 3))
        >>> g.is_full, tuple(g.var.shape)
        (False, (4, 3))
    """

    __slots__ = ("_cov", "_var", "mean")

    def __init__(
        self,
        mean: Tensor,
        cov: Tensor | None = None,
        var: Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        if (cov is None) == (var is None):
            raise ValueError("Gaussian needs exactly one of `cov` (full) or `var` (diag)")
        self.mean = mean
        self._cov = cov
        self._var = var
        if validate:
            self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        mean, cov, var = self.mean, self._cov, self._var
        if not isinstance(mean, Tensor):
            raise ValueError(f"Gaussian mean must be a torch.Tensor, got {type(mean).__name__}")
        if mean.dim() < 1:
            raise ValueError("Gaussian mean must have at least one dimension [..., D]")
        if not mean.dtype.is_floating_point:
            raise ValueError(f"Gaussian mean must be floating point, got dtype {mean.dtype}")
        second = cov if cov is not None else var
        name = "cov" if cov is not None else "var"
        if not isinstance(second, Tensor):
            raise ValueError(f"Gaussian {name} must be a torch.Tensor")
        if second.dtype != mean.dtype:
            raise ValueError(f"Gaussian {name} dtype {second.dtype} != mean dtype {mean.dtype}")
        if second.device != mean.device:
            raise ValueError(f"Gaussian {name} device {second.device} != mean {mean.device}")
        if cov is not None:
            expected = (*mean.shape, mean.shape[-1])
            if tuple(cov.shape) != expected:
                raise ValueError(
                    f"Gaussian cov shape {tuple(cov.shape)} does not match mean shape "
                    f"{tuple(mean.shape)}; expected {expected}"
                )
        elif tuple(second.shape) != tuple(mean.shape):
            raise ValueError(
                f"Gaussian var shape {tuple(second.shape)} does not match "
                f"mean shape {tuple(mean.shape)}"
            )
        if not all_finite(mean):
            raise NonFiniteMomentsError("Gaussian mean contains NaN or Inf")
        if not all_finite(second):
            raise NonFiniteMomentsError(f"Gaussian {name} contains NaN or Inf")
        diag = cov.diagonal(dim1=-2, dim2=-1) if cov is not None else second
        # a host read, skipped while torch.compile / torch.export trace (as in all_finite)
        if not tracing() and bool((diag < 0).any()):
            raise ValueError(f"Gaussian {name} has negative variances (not PSD)")

    # ------------------------------------------------------------------ accessors
    @property
    def cov(self) -> Tensor | None:
        """Full covariance ``[..., D, D]``, or ``None`` for a diag Gaussian."""
        return self._cov

    @property
    def var(self) -> Tensor:
        """Per-unit variances ``[..., D]`` (the diagonal of ``cov`` in full mode)."""
        if self._var is None:
            # exactly one of _cov/_var is set (checked in __init__)
            self._var = cast(Tensor, self._cov).diagonal(dim1=-2, dim2=-1)
        return self._var

    @property
    def is_full(self) -> bool:
        """Whether the full covariance is stored."""
        return self._cov is not None

    @property
    def kind(self) -> str:
        """``"full"`` or ``"diag"``."""
        return "full" if self.is_full else "diag"

    @property
    def stddev(self) -> Tensor:
        """Per-unit standard deviations ``[..., D]``."""
        return self.var.clamp_min(0).sqrt()

    @property
    def shape(self) -> torch.Size:
        """Shape of the mean, ``[..., D]``."""
        return self.mean.shape

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the moments."""
        return self.mean.dtype

    @property
    def device(self) -> torch.device:
        """Device of the moments."""
        return self.mean.device

    # ------------------------------------------------------------------ conversions
    def to_diag(self) -> Gaussian:
        """Drop the off-diagonal covariance, keeping the marginal variances."""
        if not self.is_full:
            return self
        return Gaussian(self.mean, var=self.var, validate=False)

    def to_full(self) -> Gaussian:
        """Embed the variances on the diagonal of a full covariance (independent units)."""
        if self.is_full:
            return self
        return Gaussian(self.mean, cov=torch.diag_embed(self.var), validate=False)

    def to_distribution(self) -> torch.distributions.Distribution:
        """The equivalent ``torch.distributions`` object (MultivariateNormal or Normal)."""
        if self.is_full:
            return torch.distributions.MultivariateNormal(self.mean, covariance_matrix=self._cov)
        return torch.distributions.Independent(
            torch.distributions.Normal(self.mean, self.stddev), 1
        )

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> Tensor:
        """Draw samples ``[*sample_shape, ..., D]`` (reparameterised)."""
        shape = torch.Size(sample_shape) + self.mean.shape
        eps = torch.randn(shape, dtype=self.dtype, device=self.device)
        cov = self._cov
        if cov is None:
            return self.mean + self.stddev * eps
        jitter = torch.finfo(self.dtype).eps * self.var.amax(-1, keepdim=True).clamp_min(1e-30)
        eye = torch.eye(self.mean.shape[-1], dtype=self.dtype, device=self.device)
        chol = torch.linalg.cholesky(cov + 10 * jitter.unsqueeze(-1) * eye)
        out: Tensor = self.mean + (chol @ eps.unsqueeze(-1)).squeeze(-1)
        return out

    def __getitem__(self, index: BatchIndex) -> Gaussian:
        """Index the batch dimensions (not the event dimension)."""
        if self._cov is not None:
            return Gaussian(self.mean[index], cov=self._cov[index], validate=False)
        return Gaussian(self.mean[index], var=self.var[index], validate=False)

    def __repr__(self) -> str:
        return f"Gaussian(kind={self.kind}, shape={tuple(self.mean.shape)}, dtype={self.dtype})"
