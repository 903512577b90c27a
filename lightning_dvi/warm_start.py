r"""Warm start: fit the network with every weight at its posterior mean, before the ELBO.

A variational fit from a random initialisation spends most of its steps fitting the mean
function, at the cost of a moment pass per evaluation, while the KL pulls the weights back to
the prior. :func:`fit_point_estimate` does that part first and cheaply: with every weight at its
posterior mean :math:`\mu`, the network is a plain deterministic one, :math:`f(x; \mu)`
(:func:`point_forward`: one affine map per layer and the activations themselves, no moments), and

.. math::

    \hat\mu = \arg\min_\mu \frac1N \sum_{n=1}^N \ell\big(f(x_n; \mu), y_n\big)

is fitted over the means only (the posterior scales and prior variances are not touched), with
:math:`\ell` the likelihood's :meth:`~lightning_dvi.likelihoods.Likelihood.point_fit_loss`: the
squared error of the mean output for the Gaussians, the cross-entropy for
:class:`~lightning_dvi.likelihoods.Categorical`. The fit is full-batch L-BFGS
(:class:`lightning_dvi.optim.LBFGS`, strong-Wolfe line search), stopped early on held-out rows:
the held-out loss after every step, stop after ``patience`` steps without improvement, keep the
best step's means. Without held-out rows it stops when a step changes the loss by less than
``tolerance`` (relative) or after ``max_steps``.

This is the "fit the data before the KL" phase of a KL warm-up (the authors' toy run kept the KL
off for 70 % of its steps) at the price of a plain network's pass: on UCI energy (one hidden
layer of 50) a point-fit evaluation costs about a sixth of a full-covariance ELBO evaluation
(0.25 against 1.46 ms, forward and backward), and the warm-started L-BFGS fit of the ELBO
reaches the 8000-step Adam figures in a few CPU seconds (issue 31, docs/benchmarks.md). The
Lightning front end is the :class:`~lightning_dvi.callbacks.PointEstimateWarmStart` callback.

Networks: any network whose weight layers accept weight *values* through
:func:`~lightning_dvi.nn.given_weights` (:class:`~lightning_dvi.nn.BayesLinear`,
:class:`~lightning_dvi.nn.BayesLinearFullCov`, :class:`~lightning_dvi.nn.BayesConv2d`, with the
activations, residual blocks and containers around them); a layer that does not raises its own
``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor, nn

from .likelihoods import Likelihood
from .nn import BayesModule, bayes_layers, given_weights, parameter_groups
from .nn.posterior import GroupMoments
from .optim import LBFGS
from .propagation import SamplePass

__all__ = ["PointFit", "fit_point_estimate", "point_forward"]


@dataclass(frozen=True)
class PointFit:
    """What :func:`fit_point_estimate` did.

    Attributes:
        steps: L-BFGS steps run (each of up to ``iterations`` iterations).
        best_step: the step whose means were kept (1-based; 0: none improved on the start).
        train_loss: the mean point-fit loss on the training rows at the kept means.
        val_loss: the same on the held-out rows (``None`` without them).
        stopped: ``"patience"`` (held-out loss stopped improving), ``"converged"`` (the
            training loss stopped changing) or ``"max_steps"``.
    """

    steps: int
    best_step: int
    train_loss: float
    val_loss: float | None
    stopped: Literal["patience", "converged", "max_steps"]


def point_forward(net: nn.Module, x: Tensor) -> Tensor:
    r"""The network's output :math:`f(x; \mu)` ``[B, D]`` with every weight at its posterior mean.

    One plain pass through the modules' own ``propagate`` (the sampling path, with the means
    given as weight values): differentiable in the means, no moments and no noise.

    Raises:
        TypeError: if ``net`` is not a declared network (a :class:`~lightning_dvi.nn.BayesModule`).
        ValueError: from a layer that does not take weight values.
    """
    weights: dict[nn.Module, GroupMoments] = {
        cast(nn.Module, layer): {g.name: (g.loc, None) for g in layer.parameter_groups()}
        for layer in bayes_layers(net)
    }
    if not isinstance(net, BayesModule):
        raise TypeError(
            f"point_forward needs a declared network (lightning_dvi.nn), got {type(net).__name__}"
        )
    with given_weights(weights):
        out = net.propagate(x.unsqueeze(0), SamplePass(1))
    return cast(Tensor, out).squeeze(0)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _means(net: nn.Module) -> list[Tensor]:
    params: list[Tensor] = []
    for group in parameter_groups(net):
        loc = group.loc
        if not (loc.is_leaf and loc.requires_grad):
            raise ValueError(
                f"fit_point_estimate: the {group.name!r} means of {type(group.module).__name__} "
                "are not a trainable leaf tensor"
            )
        if not any(loc is p for p in params):
            params.append(loc)
    if not params:
        raise ValueError("fit_point_estimate: the network has no layer with a weight posterior")
    return params


def fit_point_estimate(
    net: nn.Module,
    likelihood: Likelihood,
    x: Tensor,
    y: Tensor,
    x_val: Tensor | None = None,
    y_val: Tensor | None = None,
    *,
    max_steps: int = 200,
    patience: int = 5,
    iterations: int = 20,
    history_size: int = 50,
    tolerance: float = 1e-9,
    progress: Callable[[int, float, float | None], None] | None = None,
) -> PointFit:
    r"""Fit the posterior means as a point estimate, in place (see the module docstring).

    Args:
        net: a declared network (its ``loc`` parameters are trained, nothing else).
        likelihood: supplies :meth:`~lightning_dvi.likelihoods.Likelihood.point_fit_loss`.
        x: all training inputs ``[N, ...]`` (one batch: the fit is full-batch).
        y: their targets, as the likelihood sees them (standardised for a regressor).
        x_val: held-out inputs for early stopping (``None``: none; then
            ``tolerance`` or ``max_steps`` ends the fit).
        y_val: their targets.
        max_steps: at most this many L-BFGS steps.
        patience: stop after this many steps without a lower held-out loss.
        iterations: L-BFGS iterations per step (one held-out evaluation per step).
        history_size: L-BFGS curvature pairs kept.
        tolerance: without held-out rows, stop once a step changes the training loss by less
            than ``tolerance * max(1, |loss|)``.
        progress: called as ``progress(step, train_loss, val_loss)`` with the losses at the
            start (``step=0``) and after every step (``val_loss`` ``None`` without held-out
            rows); with it the training loss is evaluated after every step (one pass without
            gradients, which changes nothing in the fit). The
            :class:`~lightning_dvi.callbacks.PointEstimateWarmStart` callback prints these
            through the run's progress callback.

    Returns:
        :class:`PointFit`.

    Raises:
        ValueError: on bad arguments, only one of ``x_val``/``y_val``, a network without weight
            posteriors, or a layer that does not take weight values.
        TypeError: if ``net`` is not a declared network.
        FloatingPointError: if the training or held-out loss at the start is not finite.
    """
    max_steps, patience = _positive_int("max_steps", max_steps), _positive_int("patience", patience)
    iterations = _positive_int("iterations", iterations)
    history_size = _positive_int("history_size", history_size)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    if (x_val is None) != (y_val is None):
        raise ValueError("fit_point_estimate: pass both x_val and y_val, or neither")
    params = _means(net)
    dtype = params[0].dtype
    x = x.to(dtype)
    x_val = None if x_val is None else x_val.to(dtype)

    def loss_at(inputs: Tensor, targets: Tensor) -> Tensor:
        return likelihood.point_fit_loss(point_forward(net, inputs), targets).mean()

    def evaluate(inputs: Tensor | None, targets: Tensor | None) -> float | None:
        if inputs is None or targets is None:
            return None
        with torch.no_grad():
            return float(loss_at(inputs, targets))

    optimizer = LBFGS(params, max_iter=iterations, history_size=history_size)

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = loss_at(x, y)
        loss.backward()
        return loss

    start = evaluate(x, y)
    if start is None or not math.isfinite(start):
        raise FloatingPointError(
            f"fit_point_estimate: the point-fit loss at the start is {start}; check the inputs "
            "and targets for NaN/Inf or extreme values"
        )
    best_val = evaluate(x_val, y_val)
    if best_val is not None and not math.isfinite(best_val):
        raise FloatingPointError(
            f"fit_point_estimate: the held-out point-fit loss at the start is {best_val}; check "
            "x_val and y_val for NaN/Inf or extreme values"
        )
    if progress is not None:
        progress(0, start, best_val)
    best = [p.detach().clone() for p in params]
    best_step, previous = 0, start
    stopped: Literal["patience", "converged", "max_steps"] = "max_steps"
    step = 0
    for step in range(1, max_steps + 1):
        optimizer.step(closure)
        val = evaluate(x_val, y_val)
        # the training loss: needed without held-out rows, and for the progress lines
        train = evaluate(x, y) if progress is not None or val is None else None
        if progress is not None:
            progress(step, cast(float, train), val)
        if val is not None and best_val is not None:
            if val < best_val:
                best_val, best_step = val, step
                best = [p.detach().clone() for p in params]
            elif step - best_step >= patience:
                stopped = "patience"
                break
            continue
        current = cast(float, train)
        if not math.isfinite(current):  # keep the last finite step's means
            break
        best_step, best = step, [p.detach().clone() for p in params]
        if abs(previous - current) <= tolerance * max(1.0, abs(current)):
            stopped = "converged"
            break
        previous = current
    with torch.no_grad():
        for p, value in zip(params, best, strict=True):
            p.copy_(value)
    for p in params:
        p.grad = None
    return PointFit(
        steps=step,
        best_step=best_step,
        train_loss=cast(float, evaluate(x, y)),
        val_loss=best_val,  # the kept step's held-out loss, already evaluated
        stopped=stopped,
    )
