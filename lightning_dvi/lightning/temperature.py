r"""Post-hoc temperature scaling of a classifier's predictive, fitted on validation data.

Temperature scaling (Guo et al., 2017) rescales the predictive log-probabilities by one scalar
:math:`T > 0`,

.. math::
    p_T(y\mid x) = \frac{p(y\mid x)^{1/T}}{\sum_k p(k\mid x)^{1/T}}
    = \operatorname{softmax}\big(\log p(\cdot\mid x) / T\big)_y,

with :math:`T` minimising the negative log-likelihood on held-out (validation) data. It keeps
the arg-max (so accuracy) and only changes the confidence. It is *not* part of the Bayesian
model: report tempered and untempered numbers separately (docs/calibration.md).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["TemperatureScaling", "fit_temperature", "temper_probs"]

_TINY = 1e-30


class _Calibrated(Protocol):
    """What :class:`TemperatureScaling` needs of the module (a ``DVIClassifier``)."""

    predictive_temperature: Tensor

    def predictive(self, x: Tensor) -> Tensor: ...


def temper_probs(probs: Tensor, temperature: Tensor | float) -> Tensor:
    r""":math:`\operatorname{softmax}(\log p / T)` along the last dimension.

    Args:
        probs: class probabilities ``[..., K]`` (floored at 1e-30 before the log).
        temperature: :math:`T > 0`.

    Returns:
        The tempered probabilities, same shape.

    Examples:
        >>> p = torch.tensor([0.7, 0.2, 0.1])
        >>> torch.allclose(temper_probs(p, 1.0), p)
        True
        >>> bool(temper_probs(p, 0.5)[0] > 0.7)
        True
    """
    t = torch.as_tensor(temperature, dtype=probs.dtype, device=probs.device)
    return torch.softmax(probs.clamp_min(_TINY).log() / t, dim=-1)


def fit_temperature(probs: Tensor, target: Tensor, max_iter: int = 100) -> float:
    r"""The :math:`T` minimising the mean NLL of :func:`temper_probs` on ``(probs, target)``.

    One-dimensional and convex in :math:`1/T`; optimised over :math:`\log T` by L-BFGS in
    float64.

    Args:
        probs: class probabilities ``[N, K]``.
        target: integer labels ``[N]``.
        max_iter: L-BFGS iterations.

    Returns:
        :math:`T > 0`.

    Raises:
        ValueError: on empty or mismatched inputs.

    Examples:
        >>> probs = torch.tensor([[0.6, 0.4], [0.6, 0.4], [0.6, 0.4], [0.4, 0.6]])
        >>> t = fit_temperature(probs, torch.tensor([0, 0, 0, 1]))
        >>> t < 1  # always right: sharpen
        True
    """
    if probs.dim() != 2 or target.shape != probs.shape[:1] or probs.shape[0] == 0:
        raise ValueError(
            f"fit_temperature needs probs [N, K] and target [N] with N > 0, got "
            f"{tuple(probs.shape)} and {tuple(target.shape)}"
        )
    log_p = probs.detach().double().clamp_min(_TINY).log()
    target = target.long()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(log_p / log_t.exp(), target)
        loss.backward()
        return loss

    opt.step(closure)
    t = float(log_t.detach().exp())
    if not math.isfinite(t) or t <= 0:
        raise FloatingPointError(f"temperature fit diverged (T = {t})")
    return t


class TemperatureScaling(Callback):
    """Fit a predictive temperature on the validation data at the end of ``fit``.

    After training, runs the model's ``predictive`` over ``trainer.datamodule``'s
    validation loader (or the ``val_dataloaders`` given to ``fit``), fits :math:`T` by
    :func:`fit_temperature` and writes it into the module's ``predictive_temperature`` buffer
    (saved in checkpoints), so later ``test``/``predict`` use the tempered predictive. The
    fitted value and the validation NLL before and after are kept in :attr:`result`. Under
    DDP the validation predictions of all processes are gathered first, so every process fits
    the same :math:`T`.

    Works with :class:`~lightning_dvi.DVIClassifier` (any module with ``predictive`` and a
    ``predictive_temperature`` buffer).

    Attributes:
        result: ``{"temperature", "val_nll_before", "val_nll_after"}`` after fitting.

    Examples:
        >>> TemperatureScaling()
        TemperatureScaling()
    """

    def __init__(self) -> None:
        self.result: dict[str, float] = {}

    def __repr__(self) -> str:
        return "TemperatureScaling()"

    def _val_loader(self, trainer: Trainer) -> Any:
        loaders = trainer.val_dataloaders
        datamodule = getattr(trainer, "datamodule", None)  # set by Lightning, not declared
        if loaders is None and datamodule is not None:
            loaders = datamodule.val_dataloader()
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        return loaders

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Fit :math:`T` on the validation rows and store it in the module."""
        if not hasattr(pl_module, "predictive_temperature") or not hasattr(pl_module, "predictive"):
            raise ValueError(
                "TemperatureScaling needs a classifier with predictive() and a "
                f"predictive_temperature buffer, got {type(pl_module).__name__}"
            )
        classifier = cast(_Calibrated, pl_module)  # checked above
        loader = self._val_loader(trainer)
        if loader is None:
            raise ValueError("TemperatureScaling needs validation data (val_fraction > 0)")
        was_training = pl_module.training
        pl_module.eval()
        classifier.predictive_temperature.fill_(1.0)
        probs, target = [], []
        with torch.no_grad():
            for batch in loader:
                x, y = batch[0], batch[1]
                probs.append(classifier.predictive(x.to(pl_module.device)).cpu())
                target.append(y.cpu())
        p, y = torch.cat(probs), torch.cat(target)
        if trainer.world_size > 1:
            # all_gather of a tensor is a tensor
            p = cast(Tensor, pl_module.all_gather(p.to(pl_module.device)))
            y = cast(Tensor, pl_module.all_gather(y.to(pl_module.device)))
            p, y = p.reshape(-1, p.shape[-1]).cpu(), y.reshape(-1).cpu()
        t = fit_temperature(p, y)
        nll = torch.nn.functional.nll_loss
        before = float(nll(p.double().clamp_min(_TINY).log(), y.long()))
        after = float(nll(temper_probs(p.double(), t).clamp_min(_TINY).log(), y.long()))
        classifier.predictive_temperature.fill_(t)
        self.result = {"temperature": t, "val_nll_before": before, "val_nll_after": after}
        pl_module.train(was_training)
