r"""``DVIRegressor``: a Bayesian MLP for regression trained by DVI, dDVI or MCVI in Lightning."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MetricCollection

from ..gaussian import Gaussian
from ..likelihoods import HeteroscedasticGaussian, HomoscedasticGaussian
from ..metrics import RegressionMetrics
from ..nn import BayesModule
from ._base import Activation, DVIModule, EBMode, Mode, PriorName

__all__ = ["DVIRegressor"]


class DVIRegressor(DVIModule):
    r"""Regression with a Bayesian MLP; the predictive is Gaussian, reported in original units.

    The network sees standardised targets :math:`\tilde y = (y - \text{target\_loc}) /
    \text{target\_scale}`; metrics, ``predict_step`` and :meth:`predictive` map back,
    :math:`\mu = \tilde\mu s + m`, :math:`\sigma^2 = \tilde\sigma^2 s^2`, so the reported NLL is
    per point in the original units (the standardised NLL plus :math:`\log s`).

    Predictive. ``full``/``diag``: the likelihood's closed-form moments,
    :math:`\mathcal N(\langle m\rangle, \Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2})`
    (heteroscedastic) or :math:`\mathcal N(\langle m\rangle, \Sigma_{mm} + e^\lambda)`
    (homoscedastic). ``sample``/``local``: ``num_samples`` network samples give a mixture of
    Gaussians :math:`\frac1S\sum_s\mathcal N(m_s, v_s)`; the predictive is the Gaussian with the
    mixture's exact moments, mean :math:`\bar m` and variance :math:`\overline{v} +
    \frac1S\sum_s(m_s-\bar m)^2`.

    Args:
        in_features: input size (linked from ``data.in_features`` by the CLI).
        hidden: hidden-layer widths.
        activation: ``"relu"`` or ``"heaviside"``.
        residual: skip connections between equal-width hidden layers.
        mode: ``"full"`` (DVI), ``"diag"`` (dDVI), ``"sample"`` (MCVI) or ``"local"`` (local
            reparameterisation).
        num_samples: network samples per step in ``sample``/``local`` mode (default 1; also used
            for the validation/test predictive); must be unset otherwise.
        likelihood: ``"heteroscedastic"`` (outputs :math:`(m, \ell)`, noise :math:`e^\ell`) or
            ``"homoscedastic"`` (one output, a learned global log-variance).
        prior: ``"empirical_bayes"`` (inverse-gamma hyper-prior, per-group optimum) or
            ``"gaussian"`` (fixed variance).
        prior_alpha: inverse-gamma shape :math:`\alpha`.
        prior_beta: inverse-gamma scale :math:`\beta`.
        prior_variance: the fixed prior variance (``"gaussian"``), or the initial value of the
            empirical-Bayes buffers until the first refresh (``eb_mode="buffer"``).
        eb_mode: ``"in_graph"`` (optimum inside the loss, the authors' choice) or ``"buffer"``
            (set by the :class:`~lightning_dvi.callbacks.EmpiricalBayes` callback).
        num_data: training-set size :math:`N`; ``None`` takes ``trainer.datamodule.num_train``.
        kl_warmup_steps: optimisation steps with the KL switched off.
        kl_anneal_steps: steps of the linear KL ramp that follows.
        lr: Adam learning rate.
        lr_schedule: ``"constant"`` (default) or ``"cosine"``: cosine decay from ``lr`` to
            ``min_lr`` over the trainer's optimisation steps, per step.
        min_lr: the learning rate the cosine schedule ends at (``0 <= min_lr <= lr``).
        compile: run the ELBO's hot path (network, likelihood, KL) through ``torch.compile``:
            ``True``, or a ``torch.compile`` mode such as ``"reduce-overhead"`` (CUDA graphs);
            value checks stay on, outside the compiled region (:mod:`lightning_dvi.compile`).
        weight_decay: Adam weight decay.
        init_scale: initial posterior std of the weights (default: the layer's,
            :math:`0.1/\sqrt{\text{fan\_in}}`).
        init_log_noise: initial log noise variance: the bias of the :math:`\ell` output
            (heteroscedastic) or :math:`\lambda` (homoscedastic). Starting low lets the mean fit
            before the noise explains the data away.
        target_loc: mean of the training targets (standardisation), kept in a persistent buffer.
        target_scale: std of the training targets, kept in a persistent buffer.
        net: a user-built :mod:`lightning_dvi.nn` network to use instead of the MLP (then
            ``hidden``, ``activation``, ``residual``, ``init_scale`` and ``init_log_noise`` for
            the heteroscedastic bias are not used). Not saved in the hyper-parameters: pass it
            again to ``load_from_checkpoint`` unless the run came from the CLI.

    Examples:
        >>> model = DVIRegressor(in_features=1, hidden=[16], num_data=100)
        >>> out = model(torch.zeros(4, 1))
        >>> tuple(out.mean.shape), tuple(out.cov.shape)
        ((4, 2), (4, 2, 2))
    """

    def __init__(
        self,
        in_features: int | None = None,
        hidden: list[int] = [128, 128],  # noqa: B006 (jsonargparse and the CLI help show it)
        activation: Activation = "relu",
        residual: bool = False,
        mode: Mode = "full",
        num_samples: int | None = None,
        likelihood: Literal["heteroscedastic", "homoscedastic"] = "heteroscedastic",
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
        init_log_noise: float = -3.0,
        target_loc: float | None = None,
        target_scale: float | None = None,
        net: BayesModule | None = None,
        compile: bool | str = False,
    ) -> None:
        if likelihood == "heteroscedastic":
            lik: HeteroscedasticGaussian | HomoscedasticGaussian = HeteroscedasticGaussian()
        elif likelihood == "homoscedastic":
            lik = HomoscedasticGaussian(init_log_variance=init_log_noise)
        else:
            raise ValueError(
                f"likelihood must be 'heteroscedastic' or 'homoscedastic', got {likelihood!r}"
            )
        super().__init__(
            in_features=in_features,
            out_features=lik.num_outputs,
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
        self.likelihood = lik
        if likelihood == "heteroscedastic" and net is None:
            with torch.no_grad():
                self._last_layer().bias_loc[1] = float(init_log_noise)  # type: ignore[index]
        loc = 0.0 if target_loc is None else float(target_loc)
        scale = 1.0 if target_scale is None else float(target_scale)
        if not (torch.isfinite(torch.tensor(loc)) and scale > 0 and scale < float("inf")):
            raise ValueError(
                f"target_loc must be finite and target_scale finite and > 0, got {target_loc!r}, "
                f"{target_scale!r}"
            )
        # Persistent buffers: checkpoints carry the standardisation with the weights.
        self.register_buffer("target_loc", torch.tensor(loc))
        self.register_buffer("target_scale", torch.tensor(scale))
        self.val_metrics = RegressionMetrics(prefix="val/")
        self.test_metrics = RegressionMetrics(prefix="test/")

    def setup(self, stage: str) -> None:
        """Also take the target statistics from the datamodule, when it has them."""
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if not (hasattr(datamodule, "target_loc") and hasattr(datamodule, "target_scale")):
            return
        loc, scale = float(datamodule.target_loc), float(datamodule.target_scale)  # type: ignore[union-attr]
        for name, given, new in (
            ("target_loc", self.hparams.get("target_loc"), loc),
            ("target_scale", self.hparams.get("target_scale"), scale),
        ):
            if given is not None and abs(float(given) - new) > 1e-6 * max(1.0, abs(new)):
                rank_zero_warn(
                    f"DVIRegressor: {name}={given} differs from the datamodule's {new}; using "
                    "the datamodule's, which standardised the data"
                )
            self.hparams[name] = new
        self.target_loc.fill_(loc)
        self.target_scale.fill_(scale)

    # ------------------------------------------------------------------ predictive
    def predictive_standardized(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Predictive ``(mean, var)`` of the standardised target, each ``[B]``."""
        out = self(x)
        if isinstance(out, Gaussian):
            dist = self.likelihood.predictive(out)
            return dist.mean, dist.variance
        # One Gaussian per network sample (zero output variance), then the mixture's moments.
        per_sample = self.likelihood.predictive(Gaussian(out, var=torch.zeros_like(out)))
        means, variances = per_sample.mean, per_sample.variance
        return means.mean(0), variances.mean(0) + means.var(0, correction=0)

    def predictive(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Predictive ``(mean, var)`` of ``y`` in its original units, each ``[B]``."""
        mean, var = self.predictive_standardized(x)
        return mean * self.target_scale + self.target_loc, var * self.target_scale.square()

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        """``{"mean": [B], "var": [B]}``: the predictive of ``y`` in its original units."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        mean, var = self.predictive(x)
        return {"mean": mean, "var": var}

    def _update_metrics(self, metrics: MetricCollection, x: Tensor, y: Tensor) -> None:
        mean, var = self.predictive(x)
        target = y.reshape(mean.shape) * self.target_scale + self.target_loc
        metrics.update(mean, var, target)

    def _curve(self, metrics: MetricCollection) -> dict[str, Tensor]:
        expected, observed = metrics["calibration"].curve()
        return {"expected": expected, "observed": observed}
