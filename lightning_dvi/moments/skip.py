r"""Rules for a skip connection :math:`y = x + f(x)` whose branch is a whole sub-network.

The exact second moment of a sum needs the cross-covariance of its two terms,

.. math::
    \operatorname{Cov}(y) = \operatorname{Cov}(x) + \operatorname{Cov}(f(x))
        + X + X^\top,\qquad X = \operatorname{Cov}(x, f(x)).

Two rules (:data:`SKIP_RULES`), chosen per transformer block
(:class:`~lightning_dvi.nn.TransformerEncoderLayer`, ``skip_rule``):

* ``"carried"`` (the default): :math:`X` is carried through the branch layer by layer
  (:mod:`lightning_dvi.moments.residual`: :math:`X \mapsto X M^\top` through a linear layer,
  :math:`X \mapsto X\operatorname{diag}E[f'(a)]` through an activation by Stein's lemma, the
  first-order Jacobian through a normalization and through attention). Per token it is a
  ``[D, D_h]`` matrix through every branch layer of width :math:`D_h`, in ``diag`` mode too,
  where only its diagonal is used: :math:`D` times the work of the variances.
* ``"independent"`` (SUQ's): :math:`X = 0`,

  .. math::
      E[y] = E[x] + E[f(x)],\qquad \operatorname{Var}(y) = \operatorname{Var}(x)
          + \operatorname{Var}(f(x)),

  exact when the skip input is deterministic (then only the branch's weights are random)
  and otherwise off by :math:`2\operatorname{diag}X`. To first order
  :math:`\operatorname{diag}X_{ii} = \operatorname{Var}(x_i)\,J_{ii}`, :math:`J` the branch's
  (statistical) Jacobian: small behind a LayerNorm (pre-norm blocks, :math:`J \propto
  \gamma/\sigma_{\text{token}}`), and of either sign. Its size against Monte Carlo is
  tabulated in ``docs/transformers.md`` ("Skip connections"); a post-hoc scale calibration
  (:func:`lightning_dvi.nn.posthoc.calibrate_scales`) absorbs a systematic part of it.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

__all__ = ["SKIP_RULES", "SkipRule", "check_skip_rule", "skip_independent"]

SkipRule = Literal["carried", "independent"]
"""How a transformer block's skip connections treat :math:`\\operatorname{Cov}(x, f(x))`."""
SKIP_RULES: tuple[SkipRule, ...] = ("carried", "independent")


def check_skip_rule(rule: str) -> SkipRule:
    """``rule`` if it is one of :data:`SKIP_RULES`.

    Raises:
        ValueError: for another value.
    """
    if rule not in SKIP_RULES:
        raise ValueError(f"skip_rule must be one of {SKIP_RULES}, got {rule!r}")
    return rule


def skip_independent(
    skip_mean: Tensor, skip_second: Tensor, delta_mean: Tensor, delta_second: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Moments of :math:`x + f(x)` with :math:`\operatorname{Cov}(x, f(x))` taken as zero.

    :math:`(\mu_x + \mu_f,\ S_x + S_f)` where :math:`S` is the variance ``[..., D]`` (``diag``
    storage) or the covariance ``[..., D, D]`` (``full`` storage) of each term, both in the
    same storage.

    Args:
        skip_mean: :math:`E[x]` ``[..., D]``.
        skip_second: :math:`\operatorname{Var}(x)` ``[..., D]`` or :math:`\operatorname{Cov}(x)`
            ``[..., D, D]``.
        delta_mean: :math:`E[f(x)]` ``[..., D]``.
        delta_second: the branch output's variance or covariance, as ``skip_second``.

    Raises:
        ValueError: when the two terms differ in width or in storage.
    """
    if skip_mean.shape[-1] != delta_mean.shape[-1]:
        raise ValueError(
            f"skip connection: the branch maps width {skip_mean.shape[-1]} to "
            f"{delta_mean.shape[-1]}; a skip connection needs equal widths"
        )
    if skip_second.dim() - skip_mean.dim() != delta_second.dim() - delta_mean.dim():
        raise ValueError("skip connection: both terms need the same storage (diag or full)")
    return skip_mean + delta_mean, skip_second + delta_second
