r"""The empirical-Bayes callback: drives the prior variances in buffer mode and logs them.

Buffer ("alternating") mode sets each group's prior variance to its closed-form optimum given
the current posterior,

.. math::
    s_\lambda^* = \frac{\sum_{i\in\lambda}(\sigma_i^2+\mu_i^2) + 2\beta}{n_\lambda + 2\alpha + 2},

on a schedule, and the loss treats :math:`s_\lambda` as a constant in between. In in-graph mode
the prior computes :math:`s^*` inside every loss evaluation and the callback only logs it.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ..priors import EmpiricalBayes as EmpiricalBayesPrior
from ..priors import named_parameter_groups
from ._base import logs_this_step

__all__ = ["EmpiricalBayes", "EmpiricalBayesRefresh"]


def _non_negative_int(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class EmpiricalBayesRefresh(Callback):
    """Refresh empirical-Bayes prior variances on a schedule (buffer mode) and log them.

    The module must have ``net`` (a :mod:`lightning_dvi.nn` network) and ``prior`` attributes,
    as :class:`~lightning_dvi.DVIRegressor` and :class:`~lightning_dvi.DVIClassifier` do.

    Schedule (buffer mode): before the forward pass of optimisation step ``t`` (``t`` =
    ``trainer.global_step``, counting finished optimiser steps), the prior's
    :meth:`~lightning_dvi.priors.EmpiricalBayes.refresh` runs if ``t >= warmup_steps``,
    ``(t - warmup_steps) % every_n_steps == 0`` and, when ``freeze_after_steps`` is set,
    ``t < freeze_after_steps``; afterwards the variances stay frozen. Under gradient accumulation
    a step refreshes at most once. Until the first refresh the buffers hold the layers' initial
    ``prior_variance``.

    In in-graph mode the schedule is ignored: the prior sets the variances in every loss
    evaluation, and the callback only logs them. With a fixed Gaussian prior it warns and logs.

    DDP: the refresh runs on every process, not only on rank zero. It is a deterministic
    function of the parameters, which DDP keeps identical across processes, and the decision
    depends only on ``trainer.global_step``, which is the same everywhere; so every replica
    computes the same buffers without communication (DDP's buffer broadcast from rank zero
    would overwrite any difference anyway). The logged values are identical on every process,
    so they are logged without a cross-process reduction.

    State: the step of the last refresh and the refresh count are saved in checkpoints under
    :attr:`state_key` and restored by ``trainer.fit(ckpt_path=...)``; the variances themselves
    are persistent buffers of the layers, so they travel with the model's ``state_dict``.

    Args:
        every_n_steps: refresh period in optimisation steps (buffer mode).
        warmup_steps: first step at which to refresh.
        freeze_after_steps: stop refreshing from this step on (``None``: never freeze).
        log: log each group's prior variance as ``prior_variance/<layer>.<weight|bias>``
            on the training steps the trainer writes (every ``log_every_n_steps``).

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> eb = EmpiricalBayesRefresh(every_n_steps=10, warmup_steps=100)
        >>> trainer = Trainer(callbacks=[eb], logger=False)  # doctest: +SKIP
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        warmup_steps: int = 0,
        freeze_after_steps: int | None = None,
        log: bool = True,
    ) -> None:
        super().__init__()
        self.every_n_steps = _non_negative_int("every_n_steps", every_n_steps, minimum=1)
        self.warmup_steps = _non_negative_int("warmup_steps", warmup_steps)
        if freeze_after_steps is not None:
            _non_negative_int("freeze_after_steps", freeze_after_steps)
        self.freeze_after_steps = freeze_after_steps
        self.log = bool(log)
        self.last_refresh_step: int | None = None
        self.num_refreshes = 0

    @property
    def state_key(self) -> str:
        """Unique per schedule, so two instances with different schedules keep separate state.

        Spelled with the callback's former name, so checkpoints written before the rename
        restore into it.
        """
        schedule = {
            "every_n_steps": self.every_n_steps,
            "warmup_steps": self.warmup_steps,
            "freeze_after_steps": self.freeze_after_steps,
        }
        return f"EmpiricalBayes{schedule!r}"

    # ------------------------------------------------------------------ schedule
    def should_refresh(self, step: int) -> bool:
        """Whether the schedule refreshes before optimisation step ``step``."""
        if step < self.warmup_steps:
            return False
        if self.freeze_after_steps is not None and step >= self.freeze_after_steps:
            return False
        return (step - self.warmup_steps) % self.every_n_steps == 0

    @staticmethod
    def _parts(pl_module: LightningModule) -> tuple[nn.Module, nn.Module]:
        net, prior = getattr(pl_module, "net", None), getattr(pl_module, "prior", None)
        if not isinstance(net, nn.Module) or not isinstance(prior, nn.Module):
            raise ValueError(
                f"EmpiricalBayes callback needs a module with `net` and `prior` attributes "
                f"(e.g. DVIRegressor), got {type(pl_module).__name__}"
            )
        return net, prior

    def _buffer_mode(self, pl_module: LightningModule) -> bool:
        prior = self._parts(pl_module)[1]
        return isinstance(prior, EmpiricalBayesPrior) and prior.mode == "buffer"

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Check the module, and warn when there is no empirical-Bayes prior to drive."""
        _, prior = self._parts(pl_module)
        if stage == "fit" and not isinstance(prior, EmpiricalBayesPrior):
            rank_zero_warn(
                f"EmpiricalBayes callback: the prior is {type(prior).__name__}, not empirical "
                "Bayes; it will only log the (fixed) prior variances"
            )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Refresh the buffers before this step's forward pass when the schedule says so."""
        step = trainer.global_step
        if not self._buffer_mode(pl_module) or step == self.last_refresh_step:
            return
        if self.should_refresh(step):
            net, prior = self._parts(pl_module)
            cast(EmpiricalBayesPrior, prior).refresh(net)  # _buffer_mode checked the type
            self.last_refresh_step = step
            self.num_refreshes += 1

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Log each group's prior variance (the value this step's loss used)."""
        if not (self.log and logs_this_step(trainer)):
            return
        net, _ = self._parts(pl_module)
        for name, group in named_parameter_groups(net):
            pl_module.log(
                f"prior_variance/{name}",
                float(group.prior_variance),
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The schedule's counters (primitive values, so ``weights_only`` loading works)."""
        return {"last_refresh_step": self.last_refresh_step, "num_refreshes": self.num_refreshes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters saved by :meth:`state_dict`."""
        self.last_refresh_step = state_dict["last_refresh_step"]
        self.num_refreshes = int(state_dict["num_refreshes"])


class EmpiricalBayes(EmpiricalBayesRefresh):
    """Deprecated alias of :class:`EmpiricalBayesRefresh`; removed in the next release.

    Renamed because it shared its name with the prior :class:`lightning_dvi.priors.EmpiricalBayes`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "lightning_dvi.callbacks.EmpiricalBayes is deprecated and will be removed in the next "
            "release; use lightning_dvi.callbacks.EmpiricalBayesRefresh (same arguments)",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
