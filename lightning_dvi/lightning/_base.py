r"""Shared machinery of the DVI LightningModules: network, prior, ELBO steps, logging, optimiser.

Every step calls :func:`lightning_dvi.objective.elbo`, the one implementation of the per-datum
objective

.. math::
    \mathcal L = \frac1B\sum_b\mathbb E_q\log p(y_b\mid x_b, w) - \beta_t\,\frac{\mathrm{KL}(q\,\|\,p)}{N},

with :math:`N` the training-set size and :math:`\beta_t` the KL schedule at optimisation step
:math:`t`. Under DDP each process averages over its share of the global batch and the gradient
all-reduce averages across processes, so the update is that of the global batch.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torchmetrics import MetricCollection

from ..gaussian import Gaussian
from ..likelihoods import Likelihood
from ..nn import BayesLinear, BayesModule, bayes_layers, mlp
from ..objective import ELBOTerms, KLSchedule, elbo
from ..priors import EmpiricalBayes, GaussianPrior, Prior

__all__ = ["DVIModule", "logs_this_step"]

Mode = Literal["full", "diag", "sample", "local"]
Activation = Literal["relu", "heaviside"]
PriorName = Literal["empirical_bayes", "gaussian"]
EBMode = Literal["in_graph", "buffer"]

_MODES = ("full", "diag", "sample", "local")
_MC_MODES = ("sample", "local")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_float(name: str, value: object, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)  # type: ignore[operator]
    _check(ok, f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def logs_this_step(trainer: Trainer) -> bool:
    """Whether the trainer writes step-level logged values after the current training batch.

    Lightning keeps only every ``log_every_n_steps``-th step's values; each ``self.log`` call
    still costs about half a millisecond on CPU, a quarter of a small network's step, so
    step-level values are only logged when they will be written. The answer depends only on
    the step count, so every DDP process agrees (which ``sync_dist`` needs).
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


class DVIModule(LightningModule):
    """Base class of :class:`~lightning_dvi.DVIRegressor` and :class:`~lightning_dvi.DVIClassifier`.

    Subclasses build the likelihood and the metric collections, call
    ``save_hyperparameters(ignore=["net"])`` and implement :meth:`_update_metrics`,
    :meth:`_curve` and ``predict_step``. Argument meanings are documented on the subclasses.

    Attributes:
        net: the Bayesian network (``lightning_dvi.nn``).
        likelihood: the observation model.
        prior: the weight prior (its variances live in the layers' persistent buffers).
        num_data: :math:`N` of ``KL / N`` (set in :meth:`setup` from the datamodule if ``None``).
        calibration_curves: per stage (``"val"``/``"test"``), the data of the last epoch's
            calibration plot, synced across processes (read by the plot callbacks).
    """

    likelihood: Likelihood
    val_metrics: MetricCollection
    test_metrics: MetricCollection

    def __init__(
        self,
        *,
        in_features: int | None,
        out_features: int,
        hidden: list[int],
        activation: str,
        residual: bool,
        mode: str,
        num_samples: int | None,
        prior: str,
        prior_alpha: float,
        prior_beta: float,
        prior_variance: float,
        eb_mode: str,
        num_data: int | None,
        kl_warmup_steps: int,
        kl_anneal_steps: int,
        lr: float,
        weight_decay: float,
        init_scale: float | None,
        net: nn.Module | None,
        lr_schedule: str = "constant",
        min_lr: float = 0.0,
    ) -> None:
        super().__init__()
        _check(mode in _MODES, f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if mode in _MC_MODES:
            num_samples = 1 if num_samples is None else num_samples
            _check(
                _is_int(num_samples) and num_samples >= 1,  # type: ignore[operator]
                f"num_samples must be a positive int, got {num_samples!r}",
            )
        else:
            _check(
                num_samples is None,
                f"num_samples is only used by mode='sample'/'local', not {mode!r}; leave it unset",
            )
        _check(
            num_data is None or (_is_int(num_data) and num_data >= 1),
            f"num_data (the training-set size N) must be a positive int or None, got {num_data!r}",
        )
        self.mode = mode
        self.num_samples = num_samples
        self.num_data = num_data
        self.lr = _positive_float("lr", lr)
        self.weight_decay = _positive_float("weight_decay", weight_decay, allow_zero=True)
        _check(
            lr_schedule in ("constant", "cosine"),
            f"lr_schedule must be 'constant' or 'cosine', got {lr_schedule!r}",
        )
        self.lr_schedule = lr_schedule
        self.min_lr = _positive_float("min_lr", min_lr, allow_zero=True)
        _check(self.min_lr <= self.lr, f"min_lr ({min_lr}) must not exceed lr ({lr})")
        self.kl_schedule = KLSchedule(kl_warmup_steps, kl_anneal_steps)
        self.prior = self._build_prior(prior, prior_alpha, prior_beta, prior_variance, eb_mode)
        if net is None:
            self.net: nn.Module = self._build_net(
                in_features,
                out_features,
                hidden,
                activation,
                residual,
                init_scale,
                prior,
                prior_variance,
            )
        else:
            self.net = self._check_net(net, in_features, out_features)
        self.calibration_curves: dict[str, dict[str, Tensor]] = {}

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build_prior(prior: str, alpha: float, beta: float, variance: float, eb_mode: str) -> Prior:
        _positive_float("prior_variance", variance)
        if prior == "empirical_bayes":
            return EmpiricalBayes(alpha=alpha, beta=beta, mode=eb_mode)
        if prior == "gaussian":
            return GaussianPrior(variance)
        raise ValueError(f"prior must be 'empirical_bayes' or 'gaussian', got {prior!r}")

    @staticmethod
    def _build_net(
        in_features: int | None,
        out_features: int,
        hidden: list[int],
        activation: str,
        residual: bool,
        init_scale: float | None,
        prior: str,
        prior_variance: float,
    ) -> nn.Module:
        _check(
            in_features is not None,
            "in_features is required when no `net` is given (LightningCLI links it from "
            "data.in_features)",
        )
        _check(
            _is_int(in_features) and in_features >= 1,  # type: ignore[operator]
            f"in_features must be a positive int, got {in_features!r}",
        )
        _check(
            isinstance(hidden, (list, tuple)) and all(_is_int(h) and h >= 1 for h in hidden),
            f"hidden must be a list of positive ints, got {hidden!r}",
        )
        _check(
            activation in ("relu", "heaviside"),
            f"activation must be 'relu' or 'heaviside', got {activation!r}",
        )
        kwargs: dict[str, Any] = {"prior_variance": prior_variance}
        if init_scale is not None:
            kwargs["init_scale"] = _positive_float("init_scale", init_scale)
        return mlp(in_features, list(hidden), out_features, activation, bool(residual), **kwargs)  # type: ignore[arg-type]

    @staticmethod
    def _check_net(net: nn.Module, in_features: int | None, out_features: int) -> nn.Module:
        _check(
            isinstance(net, BayesModule),
            f"net must be a lightning_dvi.nn module (BayesModule), got {type(net).__name__}",
        )
        layers = list(bayes_layers(net))
        _check(bool(layers), f"net {type(net).__name__} has no BayesLinear layer")
        first, last = layers[0], layers[-1]
        _check(
            last.out_features == out_features,
            f"the injected net ends in {last.out_features} outputs but the likelihood needs "
            f"{out_features}",
        )
        _check(
            # a conv first layer checks its channels itself, on the first batch
            in_features is None
            or not isinstance(first, BayesLinear)
            or first.in_features == in_features,
            f"the injected net takes {getattr(first, 'in_features', None)} inputs but "
            f"in_features={in_features}",
        )
        return net

    def _last_layer(self) -> BayesLinear:
        return list(bayes_layers(self.net))[-1]

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Gaussian | Tensor:
        """The network output: a :class:`~lightning_dvi.Gaussian` (``full``/``diag``) or samples ``[S, B, D]``."""
        if self.mode in _MC_MODES:
            return self.net(x, mode=self.mode, num_samples=self.num_samples)
        return self.net(x, mode=self.mode)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        """Take ``N`` from ``trainer.datamodule.num_train`` when ``num_data`` was not given."""
        if stage != "fit" or self.num_data is not None:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        num_train = getattr(datamodule, "num_train", None)
        if num_train is None:
            raise ValueError(
                f"{type(self).__name__}: num_data (the training-set size N in KL / N) is not set "
                "and the trainer has no datamodule with `num_train`; pass num_data=N"
            )
        self.num_data = int(num_train)
        # Recorded so a checkpoint rebuilds the module with the same N.
        self.hparams["num_data"] = self.num_data

    def _elbo(self, batch: tuple[Tensor, Tensor], kl_weight: float, stage: str) -> ELBOTerms:
        x, y = batch
        if self.num_data is None:
            raise ValueError(
                f"{type(self).__name__}: num_data is not set; pass num_data=N or train with a "
                "datamodule that has `num_train`"
            )
        try:
            return elbo(
                self.net,
                self.likelihood,
                self.prior,
                x,
                y,
                num_data=self.num_data,
                mode=self.mode,
                num_samples=self.num_samples,
                kl_weight=kl_weight,
                check_finite=True,
            )
        except FloatingPointError as err:
            raise FloatingPointError(
                f"{stage} loss is not finite at global step {self.global_step} (epoch "
                f"{self.current_epoch}); training stopped: {err}"
            ) from err

    def _log_terms(self, terms: ELBOTerms, stage: str, batch_size: int) -> None:
        on_step = stage == "train"
        values = {
            f"{stage}/loss": terms.loss.detach(),
            f"{stage}/elbo": terms.elbo,
            f"{stage}/expected_log_likelihood": terms.expected_log_likelihood.detach(),
            f"{stage}/kl": terms.kl.detach(),
        }
        self.log_dict(
            values, on_step=on_step, on_epoch=not on_step, sync_dist=True, batch_size=batch_size
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """One ELBO step; the KL weight follows the schedule at ``global_step``."""
        kl_weight = self.kl_schedule(self.global_step)
        terms = self._elbo(batch, kl_weight, "train")
        if logs_this_step(self.trainer):
            self._log_terms(terms, "train", batch[0].shape[0])
            self.log("train/kl_weight", kl_weight, on_step=True, on_epoch=False, batch_size=1)
        return terms.loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        terms = self._elbo(batch, 1.0, stage)
        self._log_terms(terms, stage, batch[0].shape[0])
        self._update_metrics(getattr(self, f"{stage}_metrics"), *batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """ELBO at full KL weight and the predictive metrics on a validation batch."""
        self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """ELBO at full KL weight and the predictive metrics on a test batch."""
        self._eval_step(batch, "test")

    def _epoch_end(self, stage: str) -> None:
        metrics: MetricCollection = getattr(self, f"{stage}_metrics")
        if not any(m.update_called for m in metrics.values()):
            return
        # compute() and the curve sync across processes, so every rank runs them.
        values = metrics.compute()
        self.calibration_curves[stage] = {
            k: v.detach().cpu() for k, v in self._curve(metrics).items()
        }
        # Already synced; sync_dist only averages identical values (silences Lightning's warning).
        self.log_dict(values, sync_dist=True)
        metrics.reset()

    def on_validation_epoch_end(self) -> None:
        """Log the synced validation metrics and keep the calibration data for plots."""
        self._epoch_end("val")

    def on_test_epoch_end(self) -> None:
        """Log the synced test metrics and keep the calibration data for plots."""
        self._epoch_end("test")

    def configure_optimizers(self) -> Any:
        r"""Adam over the variational parameters (and any likelihood parameters).

        With ``lr_schedule="cosine"`` the learning rate follows, per optimisation step
        :math:`t` of :math:`T` (``trainer.estimated_stepping_batches``),

        .. math::
            \eta_t = \eta_{\min} + (\eta - \eta_{\min})\,\tfrac12\bigl(1 + \cos(\pi\min(t, T)/T)\bigr),

        and stays at :math:`\eta_{\min}` (``min_lr``) after :math:`T`; :math:`T` must be finite
        (set ``max_steps`` or ``max_epochs``).
        """
        optimiser = torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        if self.lr_schedule == "constant":
            return optimiser
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total) or total < 1:
            raise ValueError(
                "lr_schedule='cosine' needs a finite number of optimisation steps; set the "
                f"trainer's max_steps or max_epochs (estimated steps: {total})"
            )
        steps, floor = int(total), self.min_lr / self.lr

        def factor(step: int) -> float:
            return floor + (1.0 - floor) * 0.5 * (
                1.0 + math.cos(math.pi * min(step, steps) / steps)
            )

        schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, factor)
        return {"optimizer": optimiser, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ------------------------------------------------------------------ subclass interface
    def _update_metrics(self, metrics: MetricCollection, x: Tensor, y: Tensor) -> None:
        raise NotImplementedError

    def _curve(self, metrics: MetricCollection) -> dict[str, Tensor]:
        raise NotImplementedError
