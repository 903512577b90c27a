r"""L-BFGS supervision in a Lightning fit: the one owner of what ``optimizer="lbfgs"`` adds.

:class:`lightning_dvi.optim.LBFGS` runs one optimisation step; a fit around it needs four more
things, all here:

- the trainer settings its line search cannot work with are refused (gradient clipping,
  gradient accumulation) and a minibatch loader is warned about;
- the curvature memory is cleared when the KL schedule changes the objective;
- a step that leaves non-finite parameters is undone once, with the memory cleared; a second
  one in a row is an error;
- a step that moves no parameter away from a non-stationary point clears the memory (a
  restart along the steepest descent); a fit that never gets going is warned about, once.

:class:`LBFGSSupervisor` is a callback that :class:`~lightning_dvi.lightning._base.DVIModule`
adds itself (``configure_callbacks``) when ``optimizer="lbfgs"``. Its counters are checkpointed
as plain numbers (``weights_only`` safe), so a resumed fit continues the uninterrupted one;
L-BFGS's own memory is the optimiser's state, which Lightning checkpoints. Under DDP,
:func:`global_loss_value` gives every process the same loss value for the line search.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

__all__ = ["LBFGSSupervisor", "global_loss_value"]


def global_loss_value(loss: Tensor, strategy: Strategy) -> Tensor:
    r"""The processes' mean loss as the value, this process's loss as the gradient.

    Under DDP each process's loss is the per-datum ELBO of its shard, and the gradient
    all-reduce averages the shards' gradients into the global batch's. L-BFGS's line search
    also compares loss *values*: with each process's own value the processes would accept
    different step lengths and their weights drift apart (DDP synchronises gradients, not
    weights). Returning :math:`\ell_r + (\bar\ell - \ell_r)` with the difference
    detached gives every process the value :math:`\bar\ell` (the global batch's loss, for
    equal shards) and keeps :math:`\nabla\ell_r`, which DDP averages to
    :math:`\nabla\bar\ell`: every process runs the one-process L-BFGS step.
    """
    mean = strategy.reduce(loss.detach().clone(), reduce_op="mean")
    return loss + (mean - loss.detach())


def _forget_curvature(trainer: Trainer) -> None:
    for optimiser in trainer.optimizers:
        optimiser.state.clear()


class LBFGSSupervisor(Callback):
    r"""Restarts, the stall check and the non-finite undo of an L-BFGS fit (module docstring).

    The KL weight it reads is the module's ``kl_schedule(global_step)`` (a
    :class:`~lightning_dvi.lightning._base.DVIModule`); a module without one is supervised
    for non-finite and stalled steps only.

    Attributes:
        restarts: non-finite steps undone in a row (0 or 1).
        stalls: steps in a row that moved no parameter.
        first_loss: the objective at the start of the fit's first step.
        stall_warned: whether this fit warned about a stall.
        kl_weight: the KL schedule's weight at the last step.
    """

    def __init__(self) -> None:
        self.restarts = 0
        self.stalls = 0
        self.first_loss: float | None = None
        self.stall_warned = False
        self.kl_weight: float | None = None
        self._snapshot: list[Tensor] | None = None
        self._restored = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The counters, as plain numbers."""
        return {
            "restarts": self.restarts,
            "stalls": self.stalls,
            "first_loss": self.first_loss,
            "stall_warned": self.stall_warned,
            "kl_weight": self.kl_weight,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters of a resumed fit (a new fit starts from none)."""
        self.restarts = int(state_dict["restarts"])
        self.stalls = int(state_dict["stalls"])
        first, weight = state_dict["first_loss"], state_dict["kl_weight"]
        self.first_loss = None if first is None else float(first)
        self.stall_warned = bool(state_dict["stall_warned"])
        self.kl_weight = None if weight is None else float(weight)
        self._restored = True

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A new fit forgets a previous fit's stalled-step state and warning (not a resumed one's)."""
        if not self._restored:
            self.stall_warned, self.stalls, self.first_loss = False, 0, None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuse what breaks the line search; warn about minibatches."""
        if not self._restored:
            self.kl_weight = None
        self._restored = False
        if trainer.gradient_clip_val:
            raise ValueError(
                "optimizer='lbfgs' cannot be combined with gradient clipping (Trainer("
                f"gradient_clip_val={trainer.gradient_clip_val})): a clipped gradient is not the "
                "gradient of the loss its line search evaluates; drop gradient_clip_val"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "optimizer='lbfgs' evaluates the whole batch's loss several times per step and "
                "cannot accumulate gradients over batches (Trainer(accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches})); use a larger batch instead"
            )
        batches = trainer.num_training_batches
        if isinstance(batches, (int, float)) and math.isfinite(batches) and batches > 1:
            rank_zero_warn(
                f"{type(pl_module).__name__}(optimizer='lbfgs') sees {int(batches)} batches per "
                "epoch: each step's objective is then a different minibatch, which L-BFGS's "
                "curvature memory does not expect; a full-batch loader (batch_size = the "
                "training-set size) is what it is for"
            )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Forget the curvature pairs when the KL weight changes (the objective did); keep the start."""
        schedule = getattr(pl_module, "kl_schedule", None)
        if schedule is not None:
            weight = schedule(trainer.global_step)
            if self.kl_weight is not None and weight != self.kl_weight:
                _forget_curvature(trainer)
            self.kl_weight = weight
        # the parameters before the step, to restart from if it leaves them non-finite
        self._snapshot = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After a step: undo it if its parameters are not finite, restart it if it stalled.

        A finite step that moved no parameter away from a non-stationary point restarts L-BFGS
        without its curvature memory instead (:meth:`_restart_stalled`).

        An overflowing trial point can make the line search's cubic interpolation return a NaN
        step length (torch's ``_strong_wolfe`` mixed float32 gradients into it; the line search
        of :class:`lightning_dvi.optim.LBFGS` treats an infinite value as a failed trial). The
        step is then undone and the curvature memory cleared, so the next step starts along the
        steepest descent direction with a short first trial; a second failure in a row is an
        error.
        """
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        snapshot = self._snapshot
        params = list(pl_module.parameters())
        total = torch.stack([p.detach().sum() for p in params]).sum()
        moved = total.new_ones(())
        if snapshot is not None:  # a step below 10 ulps of every parameter does not count
            pairs = zip(params, snapshot, strict=True)
            step = [(p.detach() - q).abs().max() / (1 + q.abs().max()) for p, q in pairs]
            moved = (torch.stack(step).max() > 10 * torch.finfo(total.dtype).eps).to(total.dtype)
        grads = [p.grad.abs().max() for p in params if p.grad is not None]
        grad = torch.stack(grads).max().to(total.dtype) if grads else total.new_zeros(())
        value = total.new_zeros(()) if loss is None else loss.detach().to(total.dtype)
        # one host read per step
        total_host, moved_host, grad_host, loss_host = torch.stack(
            [total, moved, grad, value.reshape(())]
        ).tolist()
        if math.isfinite(total_host):
            self.restarts = 0
            tolerance = trainer.optimizers[0].defaults.get("tolerance_grad", 0.0)
            if not moved_host and grad_host > tolerance:  # not at a stationary point
                self._restart_stalled(trainer, pl_module, loss_host)
            else:
                self.stalls = 0
            if self.first_loss is None:
                self.first_loss = loss_host
            return
        if self.restarts >= 1 or snapshot is None:
            raise FloatingPointError(
                f"the parameters are not finite after L-BFGS step {trainer.global_step} (epoch "
                f"{trainer.current_epoch}), also after restarting it; training stopped. Typical "
                "causes: unstandardised inputs or targets, or a log-variance output far from "
                "the data's scale"
            )
        with torch.no_grad():
            for parameter, saved in zip(params, snapshot, strict=True):
                parameter.copy_(saved)
        _forget_curvature(trainer)
        self.restarts += 1
        rank_zero_warn(
            f"{type(pl_module).__name__}: L-BFGS step {trainer.global_step} left non-finite "
            "parameters (its line search overflowed); undone, restarting with no curvature memory"
        )

    def _restart_stalled(self, trainer: Trainer, pl_module: LightningModule, loss: float) -> None:
        r"""After an L-BFGS step that left every parameter where it was: clear its curvature memory.

        "Where it was": no parameter moved by more than 10 units of the dtype's rounding,
        :math:`\max|\Delta p| \le 10\,\varepsilon\,(1 + \max|p|)` for every tensor, while the
        largest gradient entry is above L-BFGS's own stationarity tolerance
        (``tolerance_grad``); ``loss`` is the objective at the step's start.

        How a fit gets there (UCI protein split 2, a 37,000-row full batch, measured): one
        curvature pair from a very stiff direction (:math:`y^\top y / s^\top y \approx 10^{14}`)
        sets L-BFGS's initial inverse-Hessian scale to :math:`H_0 = s^\top y / y^\top y \approx
        1.2\cdot10^{-14}`, so every later direction is about :math:`10^{-14}` of the gradient. The
        line search's trials then change the float32 loss by less than its rounding, the step
        ends on ``tolerance_change``, no new pair is stored, and every later step repeats it:
        the model scored was the initial one (test LL -28.7). Clearing the memory restarts
        along the steepest descent with a first trial of :math:`1/\lVert g\rVert_1`, which
        leaves the trap (protein split 2: loss 180.9 to 1.89 in the next step).

        If the step after a restart does not move either, the objective does not decrease at
        the dtype's resolution even along the gradient. After a fit that made progress that is
        a minimum to working precision, normal at the end of a float32 fit, and stays silent;
        a warning (once per fit) says so when the objective is still within a relative
        ``1e-3`` of where the fit started, :math:`L > L_1 - 10^{-3}\max(1, |L_1|)` with
        :math:`L_1` the objective at the first step's start: a fit that never got going.
        """
        self.stalls += 1
        _forget_curvature(trainer)
        first = loss if self.first_loss is None else self.first_loss
        stuck = loss > first - 1e-3 * max(1.0, abs(first))
        if self.stalls < 2 or not stuck or self.stall_warned:
            return
        self.stall_warned = True
        rank_zero_warn(
            f"{type(pl_module).__name__}: L-BFGS step {trainer.global_step} did not move the "
            "parameters, also after its curvature memory was cleared, and the objective is still "
            f"where the fit started ({loss:.7g}): the line search finds no decrease along the "
            "gradient at the dtype's resolution. Try Trainer(precision='64-true'), standardised "
            "inputs, or optimizer='adam'"
        )
