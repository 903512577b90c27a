r"""``DVIClassifier``: a Bayesian MLP for softmax classification trained by DVI in Lightning."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.utilities import dim_zero_cat

from ..gaussian import Gaussian
from ..likelihoods import Categorical
from ..metrics import ClassificationMetrics
from ..nn import BayesModule
from ._base import Activation, DVIModule, EBMode, Mode, PriorName
from .temperature import temper_probs

__all__ = ["DVIClassifier"]


class DVIClassifier(DVIModule):
    r"""Classification with a Bayesian MLP whose logits are Gaussian; predicts class probabilities.

    Predictive. ``full``/``diag``: :meth:`Categorical.predictive_probs
    <lightning_dvi.likelihoods.Categorical.predictive_probs>` on the logit Gaussian (the
    pairwise mean-field probit closed form, or Monte Carlo over logits with
    ``likelihood_method="mc"``).
    ``sample``/``local``: the average of :math:`\operatorname{softmax}(a_s)` over
    ``num_samples`` network samples.

    Metrics (``val/`` and ``test/``): accuracy, NLL, Brier score and ECE
    (:class:`~lightning_dvi.metrics.ClassificationMetrics`), synced across processes.

    Args:
        in_features: input size (linked from ``data.in_features`` by the CLI).
        num_classes: number of classes :math:`K` (linked from ``data.num_classes``).
        hidden: hidden-layer widths.
        activation: ``"relu"`` or ``"heaviside"``.
        residual: skip connections between equal-width hidden layers.
        mode: ``"full"``, ``"diag"``, ``"sample"`` or ``"local"``.
        num_samples: network samples in ``sample``/``local`` mode (default 1); unset otherwise.
        likelihood_method: how the expected log-likelihood integrates over the logit
            Gaussian: ``"clark"`` (default; closed form valid for any logit variance,
            :func:`~lightning_dvi.likelihoods.functional.categorical_clark_expected_log_prob`),
            ``"delta"`` (the paper's second-order delta method, appendix B.4) or ``"mc"``
            (DVI-MC: Monte Carlo over the logits only). The delta method's penalty on the
            logit variance vanishes on confidently classified points, so with long training
            the KL inflates the logit variances without check and the predictive becomes
            under-confident (docs/calibration.md); hence the default.
        likelihood_mc_samples: logit draws for ``likelihood_method="mc"``.
        prior: ``"empirical_bayes"`` or ``"gaussian"``.
        prior_alpha: inverse-gamma shape.
        prior_beta: inverse-gamma scale.
        prior_variance: fixed prior variance, or the initial empirical-Bayes buffer value.
        eb_mode: ``"in_graph"`` or ``"buffer"``.
        num_data: training-set size :math:`N`; ``None`` takes ``trainer.datamodule.num_train``.
        kl_warmup_steps: steps with the KL switched off.
        kl_anneal_steps: steps of the linear KL ramp.
        kl_weight: constant factor :math:`\lambda` on the KL in the training loss (default 1:
            the ELBO). :math:`\lambda < 1` trains a tempered posterior, which is no longer
            the ELBO's optimum but can be better calibrated on small data sets (measured in
            docs/calibration.md); validation and test still report the untempered ELBO.
        lr: Adam learning rate.
        lr_schedule: ``"constant"`` (default) or ``"cosine"``: cosine decay from ``lr`` to
            ``min_lr`` over the trainer's optimisation steps, per step.
        min_lr: the learning rate the cosine schedule ends at (``0 <= min_lr <= lr``).
        weight_decay: Adam weight decay.
        init_scale: initial posterior std of the weights (default: the layer's).
        ece_bins: confidence bins of the expected calibration error and reliability diagram.
        net: a user-built :mod:`lightning_dvi.nn` network with ``num_classes`` outputs.

    Examples:
        >>> model = DVIClassifier(in_features=4, num_classes=3, hidden=[8], num_data=10)
        >>> probs = model.predict_proba(torch.zeros(2, 4))
        >>> torch.allclose(probs.sum(-1), torch.ones(2))
        True
    """

    def __init__(
        self,
        in_features: int | None = None,
        num_classes: int = 10,
        hidden: list[int] = [64],  # noqa: B006 (jsonargparse and the CLI help show it)
        activation: Activation = "relu",
        residual: bool = False,
        mode: Mode = "full",
        num_samples: int | None = None,
        likelihood_method: Literal["clark", "delta", "mc"] = "clark",
        likelihood_mc_samples: int = 32,
        prior: PriorName = "empirical_bayes",
        prior_alpha: float = 1.0,
        prior_beta: float = 10.0,
        prior_variance: float = 1.0,
        eb_mode: EBMode = "in_graph",
        num_data: int | None = None,
        kl_warmup_steps: int = 0,
        kl_anneal_steps: int = 0,
        kl_weight: float = 1.0,
        lr: float = 1e-3,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        min_lr: float = 0.0,
        weight_decay: float = 0.0,
        init_scale: float | None = None,
        ece_bins: int = 15,
        net: BayesModule | None = None,
    ) -> None:
        likelihood = Categorical(num_classes, likelihood_method, likelihood_mc_samples)
        if isinstance(ece_bins, bool) or not isinstance(ece_bins, int) or ece_bins < 1:
            raise ValueError(f"ece_bins must be a positive int, got {ece_bins!r}")
        super().__init__(
            in_features=in_features,
            out_features=num_classes,
            hidden=hidden,
            activation=activation,
            residual=residual,
            mode=mode,
            num_samples=num_samples,
            prior=prior,
            prior_alpha=prior_alpha,
            prior_beta=prior_beta,
            prior_variance=prior_variance,
            eb_mode=eb_mode,
            num_data=num_data,
            kl_warmup_steps=kl_warmup_steps,
            kl_anneal_steps=kl_anneal_steps,
            kl_weight=kl_weight,
            lr=lr,
            lr_schedule=lr_schedule,
            min_lr=min_lr,
            weight_decay=weight_decay,
            init_scale=init_scale,
            net=net,
        )
        self.save_hyperparameters(ignore=["net"])
        self.likelihood = likelihood
        self.num_classes = num_classes
        self.ece_bins = ece_bins
        self.val_metrics = ClassificationMetrics(num_classes, prefix="val/", n_bins=ece_bins)
        self.test_metrics = ClassificationMetrics(num_classes, prefix="test/", n_bins=ece_bins)
        # Post-hoc temperature of the predictive (1: the Bayesian predictive itself); set by
        # lightning_dvi.callbacks.TemperatureScaling, kept in checkpoints.
        self.register_buffer("predictive_temperature", torch.ones(()))

    def predict_proba(self, x: Tensor) -> Tensor:
        """Predictive class probabilities ``[B, K]`` (tempered if ``predictive_temperature != 1``)."""
        out = self(x)
        if isinstance(out, Gaussian):
            probs = self.likelihood.predictive_probs(out)
        else:
            probs = torch.softmax(out, dim=-1).mean(0)
        if bool(self.predictive_temperature != 1):
            probs = temper_probs(probs, self.predictive_temperature)
        return probs

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checkpoints written before the temperature buffer existed load with temperature 1."""
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):
            state.setdefault("predictive_temperature", torch.ones(()))

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Predictive class probabilities ``[B, K]``."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.predict_proba(x)

    def _update_metrics(self, metrics: MetricCollection, x: Tensor, y: Tensor) -> None:
        metrics.update(self.predict_proba(x), y.long())

    def _curve(self, metrics: MetricCollection) -> dict[str, Tensor]:
        """Reliability-diagram bins from the ECE metric's (synced) confidences and hits."""
        ece = metrics["ece"]
        with ece.sync_context(should_sync=ece._to_sync):
            confidence = dim_zero_cat(ece.confidences).double()
            accuracy = dim_zero_cat(ece.accuracies).double()
        edges = torch.linspace(
            0.0, 1.0, self.ece_bins + 1, dtype=torch.float64, device=confidence.device
        )
        # Bins are [lo, hi), as in torchmetrics' ECE; a confidence of exactly 1 joins the last bin.
        index = (torch.bucketize(confidence, edges, right=True) - 1).clamp(0, self.ece_bins - 1)
        count = torch.zeros(self.ece_bins, dtype=torch.float64, device=confidence.device)
        count.index_add_(0, index, torch.ones_like(confidence))
        conf_sum = torch.zeros_like(count).index_add_(0, index, confidence)
        acc_sum = torch.zeros_like(count).index_add_(0, index, accuracy)
        safe = count.clamp_min(1)
        return {
            "bin_edges": edges,
            "count": count,
            "confidence": conf_sum / safe,
            "accuracy": acc_sum / safe,
        }
