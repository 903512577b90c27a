r"""Argument groups of the DVI LightningModules, each checked once by the object it becomes.

:class:`OptimiserConfig` (Adam and its learning-rate schedule), :class:`KLScheduleConfig` (the
KL warm-up and ramp, in steps or as fractions of the run) and :func:`make_prior` take the
constructor's arguments as given and raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..objective import KLSchedule
from ..priors import EmpiricalBayes, GaussianPrior, Prior
from ._validation import check, fraction, one_of, positive_float

__all__ = ["KLScheduleConfig", "LRSchedule", "OptimiserConfig", "make_prior"]

LRSchedule = Literal["constant", "cosine"]


@dataclass
class OptimiserConfig:
    r"""Adam's learning rate, weight decay and learning-rate schedule, checked on construction.

    Args:
        lr: the learning rate :math:`\eta > 0`.
        lr_schedule: ``"constant"`` or ``"cosine"`` (per-step cosine decay to ``min_lr``).
        min_lr: :math:`\eta_{\min}`, where the cosine ends (``0 <= min_lr <= lr``).
        weight_decay: Adam's weight decay (``>= 0``).
    """

    lr: float = 1e-3
    lr_schedule: LRSchedule = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        lr, min_lr = self.lr, self.min_lr
        self.lr = positive_float("lr", lr)
        self.weight_decay = positive_float("weight_decay", self.weight_decay, allow_zero=True)
        one_of("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        self.min_lr = positive_float("min_lr", min_lr, allow_zero=True)
        check(self.min_lr <= self.lr, f"min_lr ({min_lr}) must not exceed lr ({lr})")

    def configure(
        self, parameters: Iterable[nn.Parameter], total_steps: Callable[[], int]
    ) -> torch.optim.Optimizer | dict[str, Any]:
        """Adam over ``parameters``, with the per-step cosine schedule of ``lr_schedule="cosine"``.

        The schedule (:meth:`DVIModule.configure_optimizers
        <lightning_dvi.lightning._base.DVIModule.configure_optimizers>`) calls ``total_steps``
        once, at step 1: estimating the run's steps loads the training data, which before a
        checkpoint is restored would lose a resumed loader's position.
        """
        optimiser = torch.optim.Adam(parameters, lr=self.lr, weight_decay=self.weight_decay)
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


def make_prior(prior: str, alpha: float, beta: float, variance: float, eb_mode: str) -> Prior:
    """The weight prior named ``prior``; ``variance`` is checked for either (the layers use it)."""
    positive_float("prior_variance", variance)
    one_of("prior", prior, ("empirical_bayes", "gaussian"))
    if prior == "empirical_bayes":
        return EmpiricalBayes(alpha=alpha, beta=beta, mode=eb_mode)
    return GaussianPrior(variance)
