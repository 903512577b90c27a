r"""Skip connections :math:`a = a' + \delta(a')` (paper appendix C).

.. math::
    \operatorname{Cov}(a) = \operatorname{Cov}(a') + \operatorname{Cov}(\delta)
        + X + X^\top,\qquad X_{ik} = \operatorname{Cov}(a'_i, \delta_k).

:math:`X` is carried through the residual branch layer by layer: a linear layer (weights
independent of :math:`a'`) maps :math:`X \mapsto X M^\top`; an elementwise activation maps
:math:`X_{ij} \mapsto X_{ij}\,E[f'(a_j)]` (Stein's lemma, exact for jointly Gaussian
:math:`(a', a)`). For one ReLU + linear branch this is the paper's
:math:`X_{ik} = \sum_j \Sigma'_{ij}\Phi(\mu'_j)M_{kj}`.
"""

from __future__ import annotations

from torch import Tensor

from .linear import symmetrize

__all__ = ["cross_through_activation", "cross_through_linear", "residual_diag", "residual_full"]


def cross_through_activation(cross: Tensor, slope: Tensor) -> Tensor:
    r""":math:`\operatorname{Cov}(x, f(a)) = \operatorname{Cov}(x, a)\operatorname{diag}(E[f'(a)])`.

    Args:
        cross: ``[..., Dx, Da]``.
        slope: ``[..., Da]``, e.g. :func:`~lightning_dvi.moments.activations.relu_slope`.
    """
    return cross * slope.unsqueeze(-2)


def cross_through_linear(cross: Tensor, w_loc: Tensor) -> Tensor:
    r""":math:`\operatorname{Cov}(x, hW^\top + b) = \operatorname{Cov}(x, h)\,M^\top`."""
    return cross @ w_loc.transpose(-1, -2)


def residual_full(
    skip_mean: Tensor, skip_cov: Tensor, delta_mean: Tensor, delta_cov: Tensor, cross: Tensor
) -> tuple[Tensor, Tensor]:
    """Moments of ``a' + delta`` given ``cross = Cov(a', delta) [..., D, D]``."""
    return skip_mean + delta_mean, symmetrize(
        skip_cov + delta_cov + cross + cross.transpose(-1, -2)
    )


def residual_diag(
    skip_mean: Tensor, skip_var: Tensor, delta_mean: Tensor, delta_var: Tensor, cross: Tensor
) -> tuple[Tensor, Tensor]:
    """Marginal moments of ``a' + delta``; only the diagonal of ``cross`` is used."""
    x_diag = cross.diagonal(dim1=-2, dim2=-1)
    return skip_mean + delta_mean, (skip_var + delta_var + 2 * x_diag).clamp_min(0)
