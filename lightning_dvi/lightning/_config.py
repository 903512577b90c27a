r"""Argument groups of the DVI LightningModules, each checked once by the object it becomes.

:class:`OptimiserConfig` (Adam and its learning-rate schedule, or full-batch L-BFGS with a line
search), :class:`KLScheduleConfig` (the
KL warm-up and ramp, in steps or as fractions of the run) and :func:`make_prior` take the
constructor's arguments as given and raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import nn

from ..nn import bayes_layers
from ..objective import KLSchedule
from ..optim import LBFGS
from ..priors import Prior
from ..priors.config import SHORTHANDS as PRIOR_SHORTHANDS
from ..priors.config import resolve_prior
from ..propagation import Mode, Propagation, propagation
from ._validation import check, fraction, one_of, positive_float, positive_int

__all__ = [
    "KLScheduleConfig",
    "LRSchedule",
    "OptimiserConfig",
    "OptimizerName",
    "make_prior",
    "param_groups",
    "posterior_scale_parameters",
]

LRSchedule = Literal["constant", "cosine"]
OptimizerName = Literal["adam", "lbfgs"]


@dataclass
class OptimiserConfig:
    r"""The optimiser: Adam with a learning-rate schedule, or L-BFGS with a line search.

    Adam (``optimizer="adam"``, the default) takes ``lr``, ``lr_schedule``, ``min_lr``,
    ``weight_decay`` and ``scale_lr``: the posterior scales' parameters (the raw ``softplus``
    arguments of the standard deviations, a full covariance's factor; see
    :func:`posterior_scale_parameters`) train at :math:`\eta_s` = ``scale_lr``, the means and
    everything else at :math:`\eta` = ``lr`` (``scale_lr=None``: one rate). Adam moves every
    raw scale by about :math:`\eta_s` per step whatever its gradient's size, and for a small
    standard deviation the raw scale is its logarithm (:math:`\operatorname{softplus}(r)\approx
    e^r`), so a standard deviation that the data barely constrain grows as
    :math:`e^{\eta_s t}` until its gradient changes sign: :math:`\eta_s` is a relative pace,
    without the weights' units, which sets the posterior's noise level within a budget of
    steps apart from the means' rate (docs/calibration.md measures it). L-BFGS (``optimizer="lbfgs"``, :class:`lightning_dvi.optim.LBFGS`:
    :class:`torch.optim.LBFGS`'s method with the strong-Wolfe line search, at a per-iteration cost
    independent of the history) is for a deterministic objective, DVI/dDVI on full batches (or
    large fixed ones): one optimisation step runs up to ``lbfgs_iterations`` quasi-Newton
    iterations, each step length chosen by the line search from a unit first trial, with the
    curvature of the last ``lbfgs_history`` steps; a step ends early once the largest gradient
    entry is below ``1e-7`` or the loss changes by less than ``1e-9`` between iterations. ``lr``
    is Adam's and L-BFGS does not use it; a learning-rate schedule or weight decay with L-BFGS
    is an error (the line search picks step lengths; the objective is the ELBO, nothing added).

    Args:
        lr: Adam's learning rate :math:`\eta > 0`.
        lr_schedule: ``"constant"`` or ``"cosine"`` (per-step cosine decay to ``min_lr``).
        min_lr: :math:`\eta_{\min}`, where the cosine ends (``0 <= min_lr <= lr``).
        weight_decay: Adam's weight decay (``>= 0``).
        optimizer: ``"adam"`` or ``"lbfgs"``.
        lbfgs_iterations: L-BFGS iterations per optimisation step (``>= 1``).
        lbfgs_history: curvature pairs L-BFGS keeps (``>= 1``).
        scale_lr: the posterior scales' learning rate :math:`\eta_s > 0`; ``None``: ``lr``.
            The cosine schedule multiplies both rates alike.
    """

    lr: float = 1e-3
    lr_schedule: LRSchedule = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.0
    optimizer: OptimizerName = "adam"
    lbfgs_iterations: int = 20
    lbfgs_history: int = 20
    scale_lr: float | None = None

    def __post_init__(self) -> None:
        lr, min_lr = self.lr, self.min_lr
        self.lr = positive_float("lr", lr)
        self.weight_decay = positive_float("weight_decay", self.weight_decay, allow_zero=True)
        one_of("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        self.min_lr = positive_float("min_lr", min_lr, allow_zero=True)
        check(self.min_lr <= self.lr, f"min_lr ({min_lr}) must not exceed lr ({lr})")
        one_of("optimizer", self.optimizer, ("adam", "lbfgs"))
        self.lbfgs_iterations = positive_int("lbfgs_iterations", self.lbfgs_iterations)
        self.lbfgs_history = positive_int("lbfgs_history", self.lbfgs_history)
        if self.scale_lr is not None:
            self.scale_lr = positive_float("scale_lr", self.scale_lr)
        if self.optimizer == "lbfgs":
            check(
                self.lr_schedule == "constant" and self.weight_decay == 0.0,
                "optimizer='lbfgs' takes no lr_schedule or weight_decay (its line search picks "
                f"each step length), got lr_schedule={self.lr_schedule!r}, "
                f"weight_decay={self.weight_decay}; use optimizer='adam' for those",
            )
            check(
                self.scale_lr is None,
                "optimizer='lbfgs' takes no lr_schedule or weight_decay (its line search picks "
                f"each step length), nor scale_lr (got {self.scale_lr}); use optimizer='adam' "
                "for it, or scale_lr=None",
            )

    def for_mode(self, mode: Mode | Propagation) -> OptimiserConfig:
        """This configuration, checked against the propagation mode; L-BFGS needs ``full``/``diag``.

        Raises:
            ValueError: for ``optimizer="lbfgs"`` with a Monte Carlo mode (``sample``/``local``).
        """
        how = propagation(mode)
        if self.optimizer == "lbfgs" and how.samples:
            raise ValueError(
                f"optimizer='lbfgs' needs a deterministic objective (mode='full' or 'diag'); "
                f"mode={how.name!r} draws new samples at every evaluation, which breaks its line "
                "search. Use optimizer='adam' for Monte Carlo modes"
            )
        return self

    def configure(
        self,
        parameters: Iterable[nn.Parameter],
        total_steps: Callable[[], int],
        scale_parameters: Iterable[nn.Parameter] = (),
    ) -> torch.optim.Optimizer | dict[str, Any]:
        """The optimiser over ``parameters``, with the cosine schedule of ``lr_schedule="cosine"``.

        ``scale_parameters`` (those among ``parameters``) form a second Adam parameter group at
        ``scale_lr`` when it is set and differs from ``lr`` (:func:`param_groups`); the schedule
        multiplies both rates alike.

        The schedule (:meth:`DVIModule.configure_optimizers
        <lightning_dvi.lightning._base.DVIModule.configure_optimizers>`) calls ``total_steps``
        once, at step 1: estimating the run's steps loads the training data, which before a
        checkpoint is restored would lose a resumed loader's position.
        """
        if self.optimizer == "lbfgs":
            return LBFGS(
                parameters,
                lr=1.0,
                max_iter=self.lbfgs_iterations,
                # the line search's evaluations count too; a quarter more than the iterations
                max_eval=self.lbfgs_iterations + max(1, self.lbfgs_iterations // 4),
                history_size=self.lbfgs_history,
                tolerance_grad=1e-7,
                tolerance_change=1e-9,
            )
        groups = param_groups(parameters, scale_parameters, self.lr, self.scale_lr)
        optimiser = torch.optim.Adam(groups, lr=self.lr, weight_decay=self.weight_decay)
        if self.lr_schedule == "constant":
            return optimiser
        floor = self.min_lr / self.lr
        horizon: list[int] = []

        def factor(step: int) -> float:
            if step == 0:
                return 1.0  # cos(0) = 1 for any horizon
            if not horizon:
                horizon.append(total_steps())
            steps = horizon[0]
            return floor + (1.0 - floor) * 0.5 * (
                1.0 + math.cos(math.pi * min(step, steps) / steps)
            )

        schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, factor)
        return {"optimizer": optimiser, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def param_groups(
    parameters: Iterable[nn.Parameter],
    scale_parameters: Iterable[nn.Parameter],
    lr: float,
    scale_lr: float | None,
) -> list[dict[str, Any]]:
    """Optimiser parameter groups: ``parameters`` at ``lr``, the scale ones at ``scale_lr``.

    One group when ``scale_lr`` is ``None`` or ``lr``, or no scale parameter is among
    ``parameters`` (those not in ``parameters``, e.g. frozen ones, are ignored); otherwise the
    other parameters first, then the scales, each in the order given.

    Examples:
        >>> a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
        >>> [(len(g["params"]), g["lr"]) for g in param_groups([a, b], [b], 0.1, 0.05)]
        [(1, 0.1), (1, 0.05)]
    """
    params = list(parameters)
    split = scale_lr is not None and scale_lr != lr
    scale_ids = {id(p) for p in scale_parameters} if split else set()
    scales = [p for p in params if id(p) in scale_ids]
    if not scales:
        return [{"params": params, "lr": lr}]
    rest = [p for p in params if id(p) not in scale_ids]
    groups = [{"params": rest, "lr": lr}] if rest else []
    return [*groups, {"params": scales, "lr": scale_lr}]


def posterior_scale_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module``'s posterior scales: every parameter a layer with a posterior holds itself that is not one of its groups' means.

    Found by the :class:`~lightning_dvi.nn.HasPosterior` protocol, not by name: a
    ``BayesLinear``'s ``weight_raw_scale`` and ``bias_raw_scale``, a full-covariance layer's
    Cholesky factor and diagonal, a user layer's own scale parameters. Each parameter once.
    """
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for layer in bayes_layers(module):
        means = {id(group.loc) for group in layer.parameter_groups()}
        for parameter in cast(nn.Module, layer).parameters(recurse=False):
            if id(parameter) not in means and id(parameter) not in seen:
                seen.add(id(parameter))
                out.append(parameter)
    return out


@dataclass
class KLScheduleConfig:
    """The KL warm-up and linear ramp as the module's arguments give them.

    Either in optimisation steps (:class:`~lightning_dvi.objective.KLSchedule` checks those) or
    as fractions of the run, turned into steps once the run's length is known; not both.

    Args:
        warmup_steps: steps with the KL switched off.
        anneal_steps: steps of the linear ramp that follows.
        warmup_fraction: the warm-up as a fraction of the run, in ``[0, 1]``.
        anneal_fraction: the ramp as a fraction of the run; the two fractions sum to at most 1.
    """

    warmup_steps: int = 0
    anneal_steps: int = 0
    warmup_fraction: float = 0.0
    anneal_fraction: float = 0.0
    _in_steps: KLSchedule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._in_steps = KLSchedule(self.warmup_steps, self.anneal_steps)  # checks the steps
        warmup, anneal = self.warmup_fraction, self.anneal_fraction
        self.warmup_fraction = fraction("kl_warmup_fraction", warmup)
        self.anneal_fraction = fraction("kl_anneal_fraction", anneal)
        check(
            self.warmup_fraction + self.anneal_fraction <= 1.0,
            f"kl_warmup_fraction + kl_anneal_fraction must not exceed 1, got {warmup} + {anneal}",
        )
        check(
            not (self.by_fraction and (self.warmup_steps or self.anneal_steps)),
            "give the KL schedule either in steps (kl_warmup_steps, kl_anneal_steps) or as "
            "fractions of the run (kl_warmup_fraction, kl_anneal_fraction), not both",
        )

    @property
    def by_fraction(self) -> bool:
        """Whether the schedule is given as fractions of the run."""
        return bool(self.warmup_fraction or self.anneal_fraction)

    def schedule(self, total_steps: int | None = None) -> KLSchedule:
        """The schedule in steps; fractions need the run's ``total_steps`` (``None``: no KL ramp yet)."""
        if not self.by_fraction:
            return self._in_steps  # checked once, in __post_init__
        if total_steps is None:
            return KLSchedule()
        return KLSchedule(
            round(self.warmup_fraction * total_steps), round(self.anneal_fraction * total_steps)
        )


#: The front ends' defaults of the arguments that only the prior shorthands read.
_SHORTHAND_DEFAULTS = {"prior_alpha": 1.0, "prior_beta": 10.0, "eb_mode": "in_graph"}


def make_prior(
    prior: str | Prior | Mapping[str, Any],
    alpha: float,
    beta: float,
    variance: float,
    eb_mode: str,
) -> tuple[Prior, float]:
    """The weight prior a front end was given, and the variance the built-in MLP's layers start at.

    The prior is a shorthand, an object or a recorded configuration.

    A shorthand (:data:`~lightning_dvi.priors.SHORTHANDS`) is built from ``alpha``, ``beta``,
    ``eb_mode`` and ``variance``; an object or a configuration
    (:func:`~lightning_dvi.priors.resolve_prior`) carries its own settings, so those arguments
    must keep their defaults, and ``variance`` (which the built-in MLP's layers start from) must
    agree with the prior's :meth:`~lightning_dvi.priors.Prior.initial_variance`. ``variance``
    is checked for every kind.

    Raises:
        ValueError: for a bad shorthand or configuration, or arguments that contradict an object.
    """
    positive_float("prior_variance", variance)
    if isinstance(prior, str):
        one_of("prior", prior, tuple(PRIOR_SHORTHANDS))
    options = {"prior_alpha": alpha, "prior_beta": beta, "eb_mode": eb_mode}
    resolved = resolve_prior(prior, {**options, "prior_variance": variance}, "the model")
    if resolved.shorthand is not None:
        return resolved.prior, variance
    name = type(resolved.prior).__name__
    changed = sorted(k for k, default in _SHORTHAND_DEFAULTS.items() if options[k] != default)
    if changed:
        raise ValueError(
            f"{', '.join(changed)} configure the prior shorthands; the {name} object given as "
            "prior= carries its own settings (set them on the object)"
        )
    initial = positive_float(
        f"the {name} prior's initial_variance", resolved.prior.initial_variance(variance)
    )
    if variance != 1.0 and initial != variance:
        raise ValueError(
            f"prior_variance={variance} contradicts the {name} prior's variance {initial}; "
            "leave prior_variance unset with a prior object"
        )
    return resolved.prior, initial
