r"""``DVIClassifier``: a Bayesian MLP for softmax classification trained by DVI in Lightning."""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.utilities import dim_zero_cat

from ..likelihoods import Categorical
from ..metrics import ClassificationMetrics
from ..nn import BayesModule
from ._base import Activation, DVIModule, EBMode, Mode, PredictiveMethod, PriorName, resolve_method
from ._data import DataView

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

    Shapes from the data. ``in_features``, ``num_classes`` and ``num_data`` left unset are read
    in ``setup()`` from ``trainer.datamodule`` (``in_features``, ``num_classes``,
    ``num_train``) or, with plain dataloaders, from the first batch, the largest training label
    plus one, and the training dataset's length; the network is built then.

    Args:
        in_features: input size; ``None`` reads it from the data (the CLI links
            ``data.in_features``).
        num_classes: number of classes :math:`K`; ``None`` reads it from the data (the CLI
            links ``data.num_classes``).
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
        num_data: training-set size :math:`N`; ``None`` takes ``trainer.datamodule.num_train``
            or the length of the training dataset.
        kl_warmup_steps: steps with the KL switched off (an error if the run ends first).
        kl_anneal_steps: steps of the linear KL ramp.
        kl_warmup_fraction: the warm-up as a fraction of the run's optimisation steps;
            exclusive with the ``*_steps`` arguments.
        kl_anneal_fraction: the ramp as a fraction of the run's optimisation steps.
        lr: Adam learning rate.
        lr_schedule: ``"constant"`` (default) or ``"cosine"``: cosine decay from ``lr`` to
            ``min_lr`` over the trainer's optimisation steps, per step.
        min_lr: the learning rate the cosine schedule ends at (``0 <= min_lr <= lr``).
        weight_decay: Adam weight decay.
        init_scale: initial posterior std of the weights (default: the layer's).
        ece_bins: confidence bins of the expected calibration error and reliability diagram.
        net: a user-built :mod:`lightning_dvi.nn` network with ``num_classes`` outputs (see
            :class:`~lightning_dvi.DVIRegressor` for how checkpoints treat it).

    Examples:
        >>> model = DVIClassifier(in_features=4, num_classes=3, hidden=[8], num_data=10)
        >>> model.predictive(torch.zeros(2, 4)).sum(-1)
        tensor([1., 1.])
    """

    def __init__(
        self,
        in_features: int | None = None,
        num_classes: int | None = None,
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
        kl_warmup_fraction: float = 0.0,
        kl_anneal_fraction: float = 0.0,
        lr: float = 1e-3,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        min_lr: float = 0.0,
        weight_decay: float = 0.0,
        init_scale: float | None = None,
        ece_bins: int = 15,
        net: BayesModule | None = None,
    ) -> None:
        # Checked now even when the number of classes comes from the data later.
        Categorical(num_classes or 2, likelihood_method, likelihood_mc_samples)
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
            kl_warmup_fraction=kl_warmup_fraction,
            kl_anneal_fraction=kl_anneal_fraction,
            lr=lr,
            lr_schedule=lr_schedule,
            min_lr=min_lr,
            weight_decay=weight_decay,
            init_scale=init_scale,
            net=net,
        )
        self.save_hyperparameters(ignore=["net"])
        self._finish_hparams()
        self.likelihood_method = likelihood_method
        self.likelihood_mc_samples = likelihood_mc_samples
        self.ece_bins = ece_bins
        self.num_classes: int | None = None
        if num_classes is None and self.net_injected:
            num_classes = self._last_layer().out_features
            self.hparams["num_classes"] = num_classes
        if num_classes is not None:
            self._set_num_classes(num_classes)

    def _set_num_classes(self, num_classes: int) -> None:
        """Create the likelihood and metrics for ``num_classes`` classes."""
        self.likelihood = Categorical(
            num_classes, self.likelihood_method, self.likelihood_mc_samples
        )
        self.num_classes = self.out_features = num_classes
        self.val_metrics = ClassificationMetrics(num_classes, prefix="val/", n_bins=self.ece_bins)
        self.test_metrics = ClassificationMetrics(num_classes, prefix="test/", n_bins=self.ece_bins)

    def _resolve_from_data(self, view: DataView) -> None:
        """Also read the number of classes: ``datamodule.num_classes`` or the largest label + 1."""
        if self.num_classes is None:
            num_classes = view.attribute("num_classes")
            if num_classes is None:
                labels = view.targets() if view.stage == "fit" else None
                if labels is None:
                    raise ValueError(
                        "DVIClassifier: num_classes was not given and cannot be read from the "
                        "data (no datamodule with `num_classes` and no training labels); pass "
                        "num_classes="
                    )
                if labels.is_floating_point() and not bool((labels == labels.round()).all()):
                    raise ValueError("DVIClassifier: class labels must be integers")
                num_classes = int(labels.max()) + 1
                if num_classes < 2:
                    raise ValueError(
                        f"DVIClassifier: the training labels hold only class {num_classes - 1}; "
                        "pass num_classes="
                    )
            self._set_num_classes(int(num_classes))
            self.hparams["num_classes"] = self.num_classes
        super()._resolve_from_data(view)

    @torch.no_grad()
    def predictive(
        self, x: Tensor, method: PredictiveMethod | None = None, num_samples: int | None = None
    ) -> Tensor:
        r"""Predictive class probabilities ``[B, K]``, detached.

        Args:
            x: inputs ``[B, D]``.
            method: ``"closed_form"``: the logit Gaussian through :meth:`Categorical.predictive_probs
                <lightning_dvi.likelihoods.Categorical.predictive_probs>` (the delta method of
                appendix B.4, or Monte Carlo over logit draws with ``likelihood_method="mc"``;
                in ``full`` mode for a model trained in ``sample``/``local`` mode). ``"mc"``: the
                average :math:`\frac1S\sum_s\operatorname{softmax}(a_s)` over ``num_samples``
                draws of the **weights** (pre-activation draws in ``local`` mode). Default:
                ``"closed_form"`` for ``full``/``diag`` models, ``"mc"`` with the model's
                ``num_samples`` for ``sample``/``local`` ones.
            num_samples: weight draws for ``"mc"`` (default: the model's ``num_samples`` in
                ``sample``/``local`` mode, else 100).
        """
        return self._probs(x, method, num_samples)

    def _probs(self, x: Tensor, method: PredictiveMethod | None, num_samples: int | None) -> Tensor:
        if resolve_method(self.mode, method) == "closed_form":
            out = self.net(x, mode=self.mode if self.mode in ("full", "diag") else "full")
            return self.likelihood.predictive_probs(out)
        return torch.softmax(self._weight_draws(x, num_samples), dim=-1).mean(0)

    def predict_proba(self, x: Tensor) -> Tensor:
        """Deprecated alias of :meth:`predictive` (kept for one release)."""
        warnings.warn(
            "DVIClassifier.predict_proba is deprecated; use predictive()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.predictive(x)

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Predictive class probabilities ``[B, K]``."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.predictive(x)

    def _update_metrics(self, metrics: MetricCollection, x: Tensor, y: Tensor) -> None:
        metrics.update(self.predictive(x), y.long())

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
