r"""The per-datum ELBO shared by every front-end, and a KL warm-up/annealing schedule.

.. math::
    \frac{\mathrm{ELBO}}{N} = \frac1B\sum_{b=1}^{B}\mathbb E_q\log p(y_b\mid x_b, w)
    - \frac{\mathrm{KL}(q(w)\,\|\,p(w))}{N},

with :math:`N` the training-set size, so a minibatch gives an unbiased estimate of the full-data
ELBO divided by :math:`N`. In ``full``/``diag`` mode the expectation is the likelihood's closed
form on the propagated output Gaussian (DVI/dDVI); in ``sample``/``local`` mode it is a Monte
Carlo average over network samples (MCVI), with the same model and prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from ._checks import deferred_value_checks
from .gaussian import Gaussian, all_finite
from .likelihoods import Likelihood
from .moments import policy
from .nn.linear import shared_scales
from .priors import Prior
from .propagation import Mode, Propagation, propagation

__all__ = ["ELBOTerms", "KLSchedule", "elbo", "expected_log_likelihood_and_kl"]


@dataclass
class ELBOTerms:
    r"""The ELBO loss and its parts, for the optimiser and for logging.

    Attributes:
        loss: scalar to minimise, :math:`-(\bar\ell - \beta_{KL}\,\mathrm{KL}/N)`.
        elbo: per-datum ELBO at full KL weight, :math:`\bar\ell - \mathrm{KL}/N` (detached).
        expected_log_likelihood: :math:`\bar\ell`, the batch mean of the expected
            log-likelihood (with gradient).
        kl: total :math:`\mathrm{KL}(q\,\|\,p)` (with gradient).
        kl_weight: the KL weight :math:`\beta_{KL}` used in ``loss``.
    """

    loss: Tensor
    elbo: Tensor
    expected_log_likelihood: Tensor
    kl: Tensor
    kl_weight: float


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class KLSchedule:
    """KL weight per optimisation step: off during warm-up, then a linear ramp to one.

    ``weight(step) = 0`` for ``step < warmup_steps``, then
    ``min(1, (step - warmup_steps + 1) / anneal_steps)``: the ramp takes exactly
    ``anneal_steps`` steps and its last step has weight 1 (1 at once if ``anneal_steps == 0``).
    The authors' toy run kept the KL off for the first 70 % of training.

    Args:
        warmup_steps: steps with zero KL weight.
        anneal_steps: length of the linear ramp.

    Examples:
        >>> sched = KLSchedule(warmup_steps=2, anneal_steps=4)
        >>> [sched(s) for s in range(7)]
        [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """

    def __init__(self, warmup_steps: int = 0, anneal_steps: int = 0) -> None:
        self.warmup_steps = _non_negative_int("warmup_steps", warmup_steps)
        self.anneal_steps = _non_negative_int("anneal_steps", anneal_steps)

    def __call__(self, step: int) -> float:
        """The KL weight at optimisation step ``step`` (0-based)."""
        step = _non_negative_int("step", step)
        if step < self.warmup_steps:
            return 0.0
        if self.anneal_steps == 0:
            return 1.0
        return min(1.0, (step - self.warmup_steps + 1) / self.anneal_steps)

    def __repr__(self) -> str:
        return f"KLSchedule(warmup_steps={self.warmup_steps}, anneal_steps={self.anneal_steps})"


def check_arguments(num_data: int, kl_weight: float, x: Tensor, y: Tensor) -> None:
    """The argument checks of :func:`elbo` that need no tensor values (types and shapes).

    The propagation is checked where it is built (:func:`~lightning_dvi.propagation.propagation`).

    Raises:
        ValueError: as documented on :func:`elbo`.
    """
    if isinstance(num_data, bool) or not isinstance(num_data, int) or num_data < 1:
        raise ValueError(f"num_data must be an int >= 1 (the training-set size), got {num_data!r}")
    if not (isinstance(kl_weight, (int, float)) and math.isfinite(kl_weight) and kl_weight >= 0):
        raise ValueError(f"kl_weight must be a finite number >= 0, got {kl_weight!r}")
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor [B, D_in]")
    if x.shape[0] == 0:
        raise ValueError("empty batch: x has no rows, so the ELBO's batch mean is undefined")
    if not isinstance(y, Tensor) or y.dim() < 1 or y.shape[0] != x.shape[0]:
        shape = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(f"targets {shape} do not match the batch of inputs {tuple(x.shape)}")


def elbo(
    net: nn.Module,
    likelihood: Likelihood,
    prior: Prior,
    x: Tensor,
    y: Tensor,
    num_data: int,
    mode: Mode | Propagation = "full",
    num_samples: int | None = None,
    kl_weight: float = 1.0,
    check_finite: bool = True,
) -> ELBOTerms:
    r"""Per-datum ELBO of a minibatch, with its parts.

    Args:
        net: a declared BNN (:mod:`lightning_dvi.nn`), called as ``net(x, mode=...)``.
        likelihood: the observation model.
        prior: the weight prior (its :meth:`~lightning_dvi.priors.Prior.kl` is used).
        x: inputs ``[B, D_in]``.
        y: targets ``[B]`` (regression also ``[B, 1]``).
        num_data: :math:`N`, the training-set size (the KL is divided by it).
        mode: ``"full"``/``"diag"`` (closed form) or ``"sample"``/``"local"`` (Monte Carlo),
            or a :class:`~lightning_dvi.propagation.Propagation` value.
        num_samples: network samples for ``sample``/``local`` (default 1); must be ``None``
            otherwise.
        kl_weight: :math:`\beta_{KL} \ge 0` multiplying the KL in ``loss`` (see
            :class:`KLSchedule`).
        check_finite: raise instead of returning a NaN/Inf loss.

    Returns:
        :class:`ELBOTerms`.

    Raises:
        ValueError: on a bad ``mode``, ``num_data``, ``num_samples`` or ``kl_weight``, or on
            inputs/targets whose batch sizes or values do not fit.
        FloatingPointError: if ``check_finite`` and the loss is NaN or Inf.

    Examples:
        >>> import torch
        >>> from lightning_dvi.nn import mlp
        >>> from lightning_dvi.likelihoods import HeteroscedasticGaussian
        >>> from lightning_dvi.priors import EmpiricalBayes
        >>> net = mlp(1, [16], 2)
        >>> x, y = torch.randn(8, 1), torch.randn(8)
        >>> terms = elbo(net, HeteroscedasticGaussian(), EmpiricalBayes(), x, y, num_data=100)
        >>> terms.loss.backward()
    """
    how = propagation(mode, num_samples)
    check_arguments(num_data, kl_weight, x, y)
    # the network and the KL compute softplus(raw scale) and its square once, in one node;
    # with check_finite, the finite check of the loss stands in for those of x and y
    with shared_scales(net), deferred_value_checks(check_finite):
        try:
            return _elbo(net, likelihood, prior, x, y, num_data, how, kl_weight, check_finite)
        except FloatingPointError:
            _name_bad_values(likelihood, x, y)
            raise


def _name_bad_values(likelihood: Likelihood, x: Tensor, y: Tensor) -> None:
    """Raise the input or target check's own ``ValueError`` if ``x`` or ``y`` is not finite."""
    if isinstance(x, Tensor) and x.dtype.is_floating_point and not all_finite(x):
        raise ValueError("input contains NaN or Inf")
    if isinstance(y, Tensor) and y.dtype.is_floating_point and not all_finite(y):
        raise ValueError(f"{type(likelihood).__name__}: targets contain NaN or Inf")


def expected_log_likelihood_and_kl(
    net: nn.Module,
    likelihood: Likelihood,
    prior: Prior,
    x: Tensor,
    y: Tensor,
    mode: Propagation,
) -> tuple[Tensor, Tensor]:
    r"""The two differentiable parts of the ELBO: :math:`\bar\ell` (batch mean) and the KL.

    The hot path of a training step with nothing but tensor work on the way (argument checks are
    :func:`elbo`'s job, and ``mode`` was built and checked by
    :func:`~lightning_dvi.propagation.propagation`): what
    :class:`lightning_dvi.compile.CompiledELBO` compiles.
    """
    if mode.samples:
        f = net(x, mode=mode)
        per_datum = likelihood.log_prob(f, y).mean(0)
    else:
        out = net(x, mode=mode)
        if not isinstance(out, Gaussian):
            raise ValueError(
                f"net(x, mode={mode.name!r}) returned {type(out).__name__}, not a Gaussian"
            )
        per_datum = likelihood.expected_log_prob(out, y)
    ell = per_datum.mean()
    return ell, prior.kl(net).to(ell.dtype)


def _elbo(
    net: nn.Module,
    likelihood: Likelihood,
    prior: Prior,
    x: Tensor,
    y: Tensor,
    num_data: int,
    mode: Propagation,
    kl_weight: float,
    check_finite: bool,
) -> ELBOTerms:
    ell, kl = expected_log_likelihood_and_kl(net, likelihood, prior, x, y, mode)
    return elbo_terms(ell, kl, num_data, kl_weight, mode, check_finite)


def elbo_terms(
    ell: Tensor, kl: Tensor, num_data: int, kl_weight: float, mode: Propagation, check_finite: bool
) -> ELBOTerms:
    r"""The loss and its parts from :math:`\bar\ell` and the KL: the one assembly of the ELBO.

    .. math::
        \text{loss} = \beta_{KL}\,\frac{\mathrm{KL}}{N} - \bar\ell, \qquad
        \text{elbo} = \bar\ell - \frac{\mathrm{KL}}{N},

    used by :func:`elbo` and by :class:`lightning_dvi.compile.CompiledELBO` (which computes
    :math:`(\bar\ell, \mathrm{KL})` in its compiled region and calls this outside it).

    Raises:
        FloatingPointError: if ``check_finite`` and the loss is NaN or Inf (one host read; skipped
            while :func:`torch.compile` traces, where the caller checks).
    """
    # -(ell - w KL / N) written as (w KL / N) - ell, the same float, with no op for w = 1
    kl_term = kl / num_data if kl_weight == 1 else kl_weight * kl / num_data
    loss = kl_term - ell
    # one host read instead of torch.isfinite's four ops and a bool() sync
    if check_finite and not policy.tracing() and not math.isfinite(loss.item()):
        raise FloatingPointError(
            f"ELBO loss is not finite (expected log-likelihood {ell.item():.4g}, KL "
            f"{kl.item():.4g}, mode {mode.name!r}); typical causes: a learning rate too high or a "
            "gradient spike (lower the rate, or clip gradients, e.g. "
            "Trainer(gradient_clip_val=5)), a log-variance output far from the data's scale, or "
            "unstandardised targets"
        )
    return ELBOTerms(
        loss=loss,
        elbo=-loss.detach() if kl_weight == 1 else (ell - kl / num_data).detach(),
        expected_log_likelihood=ell,
        kl=kl,
        kl_weight=float(kl_weight),
    )
