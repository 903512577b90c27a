r"""``DVIClassifier``: a Bayesian MLP for softmax classification trained by DVI in Lightning."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.utilities import dim_zero_cat

from ..gaussian import Gaussian
from ..likelihoods import Categorical
from ..metrics import ClassificationMetrics
from ..nn import BayesModule
from ._base import Activation, DVIModule, EBMode, Mode, PriorName

__all__ = ["DVIClassifier"]


class DVIClassifier(DVIModule):
    r"""Classification with a Bayesian MLP whose logits are Gaussian; predicts class probabilities.

    Predictive. ``full``/``diag``: :meth:`Categorical.predictive_probs
    <lightning_dvi.likelihoods.Categorical.predictive_probs>` on the logit Gaussian (the
    delta method, or Monte Carlo over logits with ``likelihood_method="mc"``).
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
        likelihood_method: ``"delta"`` (closed form, appendix B.4) or ``"mc"`` (DVI-MC:
            Monte Carlo over the logit Gaussian only).
        likelihood_mc_samples: logit draws for ``likelihood_method="mc"``.
        prior: ``"empirical_bayes"`` or ``"gaussian"``.
        prior_alpha: inverse-gamma shape.
        prior_beta: inverse-gamma scale.
        prior_variance: fixed prior variance, or the initial empirical-Bayes buffer value.
        eb_mode: ``"in_graph"`` or ``"buffer"``.
        num_data: training-set size :math:`N`; ``None`` takes ``trainer.datamodule.num_train``.
        kl_warmup_steps: steps with the KL switched off.
        kl_anneal_steps: steps of the linear KL ramp.
        lr: Adam learning rate.
        lr_schedule: ``"constant"`` (default) or ``"cosine"``: cosine decay from ``lr`` to
            ``min_lr`` over the trainer's optimisation steps, per step.
        min_lr: the learning rate the cosine schedule ends at (``0 <= min_lr <= lr``).
        compile: run the ELBO's hot path (network, likelihood, KL) through ``torch.compile``:
            ``True``, or a ``torch.compile`` mode such as ``"reduce-overhead"`` (CUDA graphs);
            value checks stay on, outside the compiled region (:mod:`lightning_dvi.compile`).
        weight_decay: Adam weight decay.
        init_scale: initial posterior std of the weights (default: the layer's).
        ece_bins: confidence bins of the expected calibration error and reliability diagram.
        net: a user-built :mod:`lightning_dvi.nn` network with ``num_classes`` outputs.

    Examples:
        >>> model = DVIClassifier(in_features=4, num_classes=3, hidden=[8], num_data=10)
        >>> model.predict_proba(torch.zeros(2, 4)).sum(-1)
        tensor([1., 1.], grad_fn=<SumBackward1>)
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
        likelihood_method: Literal["delta", "mc"] = "delta",
        likelihood_mc_samples: int = 32,
        prior: PriorName = "empirical_bayes",
        prior_alpha: float = 1.0,
        prior_beta: float = 10.0,
        prior_variance: float = 1.0,
        eb_mode: EBMode = "in_graph",
        num_data: int | None = None,
        kl_warmup_steps: int = 0,
        kl_anneal_steps: int = 0,
        lr: float = 1e-3,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        min_lr: float = 0.0,
        weight_decay: float = 0.0,
        init_scale: float | None = None,
        ece_bins: int = 15,
        net: BayesModule | None = None,
        compile: bool | str = False,
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
            lr=lr,
            lr_schedule=lr_schedule,
            min_lr=min_lr,
            compile=compile,
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

    def predict_proba(self, x: Tensor) -> Tensor:
        """Predictive class probabilities ``[B, K]``."""
        out = self(x)
        if isinstance(out, Gaussian):
            return self.likelihood.predictive_probs(out)
        return torch.softmax(out, dim=-1).mean(0)

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
