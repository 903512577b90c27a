r"""``DVIRegressor``: a Bayesian MLP for regression trained by DVI, dDVI or MCVI in Lightning."""

from __future__ import annotations

import contextlib
from typing import Any, Literal, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from torchmetrics import Metric, MetricCollection

from ..gaussian import Gaussian
from ..likelihoods import Likelihood, resolve_likelihood
from ..likelihoods.config import shorthands
from ..likelihoods.gaussian import NoiseBound, noise_bound_warned
from ..metrics import RegressionMetrics
from ..metrics.regression import RegressionCalibrationError, regression_metric_selection
from ..nn.export import PredictiveParts
from ..transforms import Standardize, checked_resolution, target_grid_step, target_statistics_of
from ._base import DVIModule, PredictiveMethod, resolve_method
from ._data import DataView
from ._validation import one_of

__all__ = ["DVIRegressor", "VarianceSplit", "target_grid_step"]


class VarianceSplit(Metric):
    r"""Root mean aleatoric and epistemic predictive variances over an epoch, synced across processes.

    ``update(aleatoric_var, epistemic_var)``; ``compute()`` returns
    :math:`(\sqrt{\overline{\sigma^2_{\rm alea}}}, \sqrt{\overline{\sigma^2_{\rm epi}}})`.
    """

    full_state_update = False
    aleatoric: Tensor  # metric states (add_state below)
    epistemic: Tensor
    count: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("aleatoric", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("epistemic", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, aleatoric: Tensor, epistemic: Tensor) -> None:
        """Add a batch of per-example variances."""
        self.aleatoric += aleatoric.detach().double().sum()
        self.epistemic += epistemic.detach().double().sum()
        self.count += aleatoric.numel()

    def compute(self) -> tuple[Tensor, Tensor]:
        """Root mean aleatoric and epistemic variance."""
        n = self.count.clamp_min(1)
        return (self.aleatoric / n).sqrt(), (self.epistemic / n).sqrt()


RegressionName = Literal["heteroscedastic", "homoscedastic", "poisson"]  # SHORTHANDS' names


def _regression_likelihood(
    likelihood: str | Likelihood | dict[str, Any],
    init_log_noise: float,
    noise_bound: NoiseBound,
    target_resolution: float | str | None,
    standardize_targets: bool,
) -> tuple[Likelihood, str | dict[str, Any], float | str | None]:
    """The likelihood (given as an object, a shorthand or a configuration), its record, the checked target resolution.

    A shorthand reads ``noise_bound`` and ``init_log_noise`` (the likelihoods' one table,
    :data:`~lightning_dvi.likelihoods.SHORTHANDS`).

    Raises:
        ValueError: for an unknown name, a classification likelihood or a bad ``noise_bound``,
            a bad ``target_resolution``, a non-bool ``standardize_targets``, or a likelihood of
            targets in their own units (Poisson) with a target resolution or standardised
            targets.
    """
    options = {"noise_bound": noise_bound, "init_log_noise": init_log_noise}
    if isinstance(likelihood, str):  # the name before the options it reads
        one_of("likelihood", likelihood, shorthands("regression"))
    one_of("noise_bound", noise_bound, ("training_range", "none"))
    resolved = resolve_likelihood(likelihood, "regression", options, "DVIRegressor")
    resolution = checked_resolution(target_resolution)
    if not isinstance(standardize_targets, bool):
        raise ValueError(f"standardize_targets must be a bool, got {standardize_targets!r}")
    lik, name = resolved.likelihood, resolved.shorthand or type(resolved.likelihood).__name__
    if resolution is not None and not lik.accepts_resolution:
        units = lik.target_units
        raise ValueError(
            "DVIRegressor: target_resolution is for the Gaussian likelihoods; "
            f"likelihood={name!r} models the {units}' grid itself"
        )
    if standardize_targets and not lik.standardizes_targets:
        raise ValueError(
            f"DVIRegressor: likelihood={name!r} models {lik.target_units} in their own units; "
            "pass standardize_targets=False"
        )
    return lik, resolved.record, resolution


_VAL_EXTRAS = ("elbo", "variance_split")  # val_metrics names beyond RegressionMetrics' members


class DVIRegressor(DVIModule):
    r"""Regression with a Bayesian MLP; the predictive is Gaussian, reported in original units.

    Targets. Batches hold ``y`` in its original units and the module standardises them itself:
    the network is trained on :math:`\tilde y = (y - m) / s` with :math:`m` = ``target_loc``,
    :math:`s` = ``target_scale``, taken (in this order) from the arguments, from a datamodule
    that declares them (:class:`~lightning_dvi.transforms.TargetStatistics`), or computed from
    the training targets in ``setup()`` (mean and ``ddof=0`` standard deviation). One object
    owns these units, ``outcome_transform`` (a :class:`~lightning_dvi.transforms.Standardize`,
    fitted once): training, the predictive, the metrics and
    :func:`~lightning_dvi.nn.export_predictive` all go through it. Metrics, ``predict_step`` and
    :meth:`predictive` map back, :math:`\mu = \tilde\mu s + m`, :math:`\sigma^2 =
    \tilde\sigma^2 s^2`, so the reported NLL is per point in the original units (the
    standardised NLL plus :math:`\log s`). For data that are already standardised pass
    ``standardize_targets=False`` (then ``target_loc``/``target_scale``, default 0 and 1, only map
    predictions back); a datamodule with ``targets_standardized = True`` says the same. A count
    likelihood (``"poisson"``) models the targets in their own units: its transform is the
    identity, and statistics given as arguments or by a datamodule are not applied. The
    statistics live in persistent float64 buffers and the hyper-parameters, so checkpoints
    carry them.

    Precision. Targets of any dtype (float64, float32, int64) are standardised in float64 and
    only then cast to the network's dtype, and the way back (predictions, metrics) is float64
    too: a target near :math:`10^8` is a multiple of 8 in float32, so a float32 inverse
    transform would round away the signal. :meth:`predictive`, :meth:`predictive_log_prob`,
    :meth:`variance_decomposition` and ``predict_step`` return float64; the ``val/`` and
    ``test/`` metrics accumulate in float64 against the batches' targets as given. A target
    that does not fit in the network's dtype after standardising is a ``ValueError``.

    Shapes from the data. ``in_features`` and ``num_data`` left unset are read in ``setup()``
    from ``trainer.datamodule`` (``in_features``, ``num_train``) or, with plain dataloaders, from
    the first batch and the training dataset's length.

    Predictive. ``full``/``diag``: the likelihood's closed-form predictive, mean and variance
    :math:`\langle m\rangle, \Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}`
    (heteroscedastic; its density, in :meth:`predictive_log_prob` and the ``nll`` metrics, is
    the exact scale mixture :class:`~lightning_dvi.likelihoods.HeteroscedasticPredictive`) or
    :math:`\mathcal N(\langle m\rangle, \Sigma_{mm} + e^\lambda)` (homoscedastic).
    ``sample``/``local``: ``num_samples`` network samples give a mixture of Gaussians
    :math:`\frac1S\sum_s\mathcal N(m_s, v_s)`; the predictive is the Gaussian with the
    mixture's exact moments, mean :math:`\bar m` and variance :math:`\overline{v} +
    \frac1S\sum_s(m_s-\bar m)^2`.

    Args:
        in_features: input size; ``None`` reads it from the data in ``setup()`` (the CLI links
            ``data.in_features``).
        hidden: hidden-layer widths.
        likelihood: ``"heteroscedastic"`` (outputs :math:`(m, \ell)`, noise :math:`e^\ell`),
            ``"homoscedastic"`` (one output, a learned global log-variance) or ``"poisson"``
            (counts: one output, the log-rate :math:`f`, :math:`y\sim\operatorname{Poisson}
            (e^f)`, :class:`~lightning_dvi.likelihoods.Poisson`; targets are counts in their own
            units, so it needs ``standardize_targets=False``; the predictive mean and variance
            are the exact Poisson log-normal ones, and so are ``val/``/``test/`` NLL and
            :meth:`predictive_log_prob`); or a
            :class:`~lightning_dvi.likelihoods.Likelihood` object (a built-in one, or a class of
            your own: docs/adding_a_likelihood.md), which the hyper-parameters record as its
            class path and constructor arguments. The strings are shorthands from one table,
            :data:`~lightning_dvi.likelihoods.SHORTHANDS`.
        init_log_noise: initial log noise variance: the bias of the :math:`\ell` output
            (heteroscedastic) or :math:`\lambda` (homoscedastic). Starting low lets the mean fit
            before the noise explains the data away.
        target_loc: :math:`m`, the mean of the training targets; ``None`` takes it from the
            datamodule or the training data (see Targets).
        target_scale: :math:`s`, the standard deviation of the training targets.
        standardize_targets: ``True`` (default): batches hold raw ``y`` and the module
            standardises it; ``False``: batches hold already-standardised ``y``.
        target_resolution: the grid step :math:`\Delta` the targets are recorded on, in their
            original units (1 for integer scores, 0.01 for two decimals): the training objective
            then reads each target as :math:`y + u`, :math:`u\sim\mathcal U(-\Delta/2,
            \Delta/2)`, which adds :math:`(\Delta/s)^2/12` to :math:`\Sigma_{mm}` in the
            expected log-likelihood (:func:`~lightning_dvi.likelihoods.gaussian.dequantisation_variance`)
            and keeps the fitted noise from collapsing where many targets are equal. ``"auto"``
            reads the largest decimal step of the training targets in ``setup()``
            (:func:`target_grid_step`; 0 for continuous targets); ``None`` (default) or 0: none
            (``None`` warns at ``fit`` when in-memory targets lie on a grid of at least a tenth
            of their standard deviation).
            Gaussian likelihoods only. The predictive and every metric are unchanged.
        noise_bound: how the heteroscedastic predictive bounds the noise variance
            :math:`e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}` away from the data.
            ``"none"`` (default): the exact :math:`\mathbb E[e^\ell]`, which a ReLU network
            lets grow like :math:`e^{c x^2}` away from the data (std 1e14 at ten times the
            training range); the default because it scored the better test NLL just outside
            the training range on the sine and toy data and the same on UCI (docs/lightning.md).
            ``"training_range"``: :math:`\langle\ell\rangle` and
            :math:`\Sigma_{\ell\ell}` are clamped to their range on the training inputs (plus
            :math:`\log 2`)
            (:meth:`~lightning_dvi.likelihoods.HeteroscedasticGaussian.bounded_log_noise`); on
            the training inputs nothing changes, far away the noise stays at what the data
            showed and the epistemic variance still grows. The range is recorded at the end of
            ``fit`` (and into each checkpoint written during it, for the weights it holds) in
            the likelihood's ``noise_range`` buffer; to bound a model trained with ``"none"``,
            set ``model.likelihood.noise_bound`` and call its ``record_noise_range``.
            Either way the variance is finite (capped below the dtype's overflow) and a
            :class:`~lightning_dvi.likelihoods.NoiseBoundWarning` names the rows bounded or
            capped. Validation during ``fit`` is never bounded. Other likelihoods ignore it.
        val_metrics: what a validation epoch computes and logs: any of ``"nll"``,
            ``"rmse"``, ``"crps"``, ``"coverage"``, ``"calibration"``, ``"sharpness"``
            (:class:`~lightning_dvi.metrics.RegressionMetrics` members), ``"elbo"``
            (``val/loss``, ``val/elbo``, ``val/expected_log_likelihood``, ``val/kl``) and
            ``"variance_split"`` (``val/aleatoric_std``, ``val/epistemic_std``); ``None``
            (default): all. A fit that validates after every step only to stop early on
            ``val/nll`` needs ``["nll"]``: each logged key costs Lightning about 0.3 ms per
            epoch, which on a UCI-size fit is more than the validation's forward pass. Test
            epochs always compute everything.
        **kwargs: the shared arguments of :class:`~lightning_dvi.lightning._base.DVIModule`:
            ``activation``, ``residual``, ``mode``, ``num_samples``, ``prior``,
            ``prior_alpha``, ``prior_beta``, ``prior_variance``, ``eb_mode``, ``num_data``,
            ``kl_warmup_steps``, ``kl_anneal_steps``, ``kl_warmup_fraction``,
            ``kl_anneal_fraction``, ``lr``, ``lr_schedule``, ``min_lr``, ``weight_decay``,
            ``init_scale``, ``net``, ``kl_weight`` (with ``net``, ``init_log_noise`` does not
            set its bias).

    Examples:
        >>> model = DVIRegressor(in_features=1, hidden=[16], num_data=100)
        >>> out = model(torch.zeros(4, 1))
        >>> tuple(out.mean.shape), tuple(out.cov.shape)
        ((4, 2), (4, 2, 2))
        >>> mean, var = model.predictive(torch.zeros(4, 1))
        >>> mean.shape, var.requires_grad
        (torch.Size([4]), False)
    """

    likelihood: Likelihood
    outcome_transform: Standardize

    def __init__(
        self,
        in_features: int | None = None,
        hidden: list[int] = [128, 128],  # noqa: B006 (jsonargparse and the CLI help show it)
        likelihood: RegressionName | Likelihood = "heteroscedastic",
        init_log_noise: float = -3.0,
        target_loc: float | None = None,
        target_scale: float | None = None,
        standardize_targets: bool = True,
        val_metrics: list[str] | None = None,
        target_resolution: float | Literal["auto"] | None = None,
        noise_bound: NoiseBound = "none",
        **kwargs: Any,
    ) -> None:
        lik, likelihood, resolution = _regression_likelihood(  # type: ignore[assignment]  # plain record
            likelihood, init_log_noise, noise_bound, target_resolution, standardize_targets
        )
        val_names = regression_metric_selection("val_metrics", val_metrics, _VAL_EXTRAS)
        super().__init__(
            in_features=in_features, hidden=hidden, out_features=lik.num_outputs, **kwargs
        )
        self.likelihood = lik
        self.init_log_noise = float(init_log_noise)
        if self.network_built and not self.net_injected:
            self._after_build()
        self._own_target_units(target_loc, target_scale, standardize_targets, resolution)
        self._sync_target_resolution()
        self._build_metrics(val_names)

    def _own_target_units(
        self,
        loc: float | None,
        scale: float | None,
        standardize: bool,
        resolution: float | str | None,
    ) -> None:
        """Create :attr:`outcome_transform`, the one owner of the target units.

        The checkpoint keeps the names of the buffers from before the transform owned them
        (``target_loc``/``target_scale``), through state-dict hooks. A count likelihood's
        targets stay in their own units: the identity, whatever statistics are given.
        """
        if not self.likelihood.standardizes_targets:
            loc = scale = None  # statistics describe counts, never map them
        self.outcome_transform = Standardize(
            loc, scale, batches_standardized=not standardize, resolution=resolution
        )
        self.register_state_dict_post_hook(_legacy_target_keys)
        self.register_load_state_dict_pre_hook(_transform_target_keys)

    # The transform's state, under the names users and checkpoints know.
    @property
    def target_loc(self) -> Tensor:
        """:math:`m`, the float64 buffer of :attr:`outcome_transform`."""
        return self.outcome_transform.loc

    @property
    def target_scale(self) -> Tensor:
        """:math:`s`, the float64 buffer of :attr:`outcome_transform`."""
        return self.outcome_transform.scale

    @property
    def standardize_targets(self) -> bool:
        """Whether batches hold raw targets (the module standardises them)."""
        return not self.outcome_transform.batches_standardized

    @standardize_targets.setter
    def standardize_targets(self, value: bool) -> None:
        self.outcome_transform.batches_standardized = not value

    @property
    def target_resolution(self) -> float | str | None:
        """The targets' grid step in original units (``"auto"`` until ``setup`` reads it)."""
        return self.outcome_transform.resolution

    def predictive_parts(self) -> PredictiveParts:
        """The network, the likelihood and the outcome transform, for :func:`~lightning_dvi.nn.export_predictive`."""
        return PredictiveParts(self.net, self.likelihood, outcome_transform=self.outcome_transform)

    def _build_metrics(self, val_names: tuple[str, ...]) -> None:
        """The validation metrics ``val_names`` selects (and the ELBO's logging), and the test metrics."""
        members = [name for name in val_names if name not in _VAL_EXTRAS]
        self.val_metrics = (
            RegressionMetrics(prefix="val/", include=members)
            if members
            else MetricCollection({}, prefix="val/")
        ).set_dtype(torch.float64)
        self.logs_val_elbo = "elbo" in val_names
        self._val_predictive = bool(members) or "variance_split" in val_names
        self.test_metrics = RegressionMetrics(prefix="test/").set_dtype(torch.float64)
        self.val_split = VarianceSplit() if "variance_split" in val_names else None
        self.test_split = VarianceSplit()

    def _after_build(self) -> None:
        biases = self.likelihood.initial_output_bias(self.init_log_noise)
        if biases:
            with torch.no_grad():
                groups = {g.name: g.loc for g in self._last_layer().parameter_groups()}
                for index, value in biases.items():
                    groups["bias"][index] = value  # the built-in MLP's head has a bias

    def _resolve_from_data(self, view: DataView) -> None:
        """Also fit the outcome transform: arguments, a datamodule's statistics, or training data."""
        super()._resolve_from_data(view)
        transform = self.outcome_transform
        data = target_statistics_of(view.datamodule, "DVIRegressor")
        counts = not self.likelihood.standardizes_targets  # never standardised
        flag = None if data is None else bool(data.targets_standardized)
        if flag is not None and flag == self.standardize_targets and not counts:
            # The datamodule knows what its batches hold.
            self.standardize_targets = not flag
            self.hparams["standardize_targets"] = self.standardize_targets
        given = self.hparams.get("target_loc"), self.hparams.get("target_scale")
        if counts:
            if flag:
                raise ValueError(
                    f"DVIRegressor: the {self.likelihood.target_units} are modelled in their own "
                    "units, but the datamodule says its batches hold standardised targets "
                    "(targets_standardized=True)"
                )
            # the datamodule's statistics describe the counts; nothing maps them
        elif data is not None:
            from_data = float(data.target_loc), float(data.target_scale)
            for name, old, new in zip(
                ("target_loc", "target_scale"), given, from_data, strict=True
            ):
                if old is not None and abs(float(old) - new) > 1e-6 * max(1.0, abs(new)):
                    rank_zero_warn(
                        f"DVIRegressor: {name}={old} differs from the datamodule's {new}; using "
                        "the datamodule's, the statistics of its training split"
                    )
            self._record_statistics(*from_data)
        elif None in given and view.stage == "fit" and self.standardize_targets:
            targets = view.targets()
            if targets is None:
                raise ValueError(
                    "DVIRegressor: cannot compute the target standardisation: the training "
                    "batches hold no targets y; pass target_loc= and target_scale=, or "
                    "standardize_targets=False for pre-standardised data"
                )
            if targets.dim() > 1 and targets[0].numel() != 1:
                raise ValueError(
                    "DVIRegressor: regression targets must be one number per example, got "
                    f"targets of shape {tuple(targets.shape)}"
                )
            transform.fit(targets)
            self._record_statistics(float(transform.loc), float(transform.scale))
        if self.target_resolution == "auto" and view.stage == "fit":
            targets = view.targets()
            if targets is None:
                raise ValueError(
                    "DVIRegressor(target_resolution='auto'): the training batches hold no "
                    "targets y to read the grid from; pass the step, e.g. target_resolution=1.0"
                )
            self.hparams["target_resolution"] = transform.fit_resolution(
                transform.original_targets(targets)
            )
        elif self.target_resolution is None and view.stage == "fit":
            self._warn_if_coarse_targets(view)
        self._sync_target_resolution()

    def _record_statistics(self, loc: float, scale: float) -> None:
        """Set the transform's ``(m, s)`` (checked) and record them in the hyper-parameters."""
        loc, scale = self.outcome_transform.set_statistics(loc, scale)
        self.hparams["target_loc"], self.hparams["target_scale"] = loc, scale

    def _warn_if_coarse_targets(self, view: DataView) -> None:
        """Warn when in-memory training targets sit on a grid coarse against their spread.

        Only for a tensor dataset (no pass over a loader) and a Gaussian likelihood: a grid step
        of at least a tenth of the targets' standard deviation is where the noise can collapse
        on equal targets (UCI wine: 1 against 0.8).
        """
        dataset = view.dataset()
        if not self.likelihood.accepts_resolution or not isinstance(dataset, TensorDataset):
            return
        if len(dataset.tensors) < 2:
            return
        step = target_grid_step(self.outcome_transform.original_targets(dataset.tensors[1]))
        if step >= 0.1 * float(self.target_scale):
            rank_zero_warn(
                f"DVIRegressor: the training targets lie on a grid of step {step:g}, "
                f"{step / float(self.target_scale):.2g} of their standard deviation; where many "
                "are equal the fitted noise can collapse towards zero and a test target one step "
                "away scores very badly. Pass target_resolution='auto' to train on dequantised "
                "targets (or target_resolution=0 to keep them as they are and silence this)"
            )

    def _sync_target_resolution(self) -> None:
        r"""Give the likelihood the grid step in the units it sees, :math:`\Delta / s`."""
        if self.likelihood.accepts_resolution:
            self.likelihood.set_target_resolution(self.outcome_transform.network_resolution())

    def _network_dtype(self) -> torch.dtype:
        parameter = next(self.net.parameters(), None)
        return torch.get_default_dtype() if parameter is None else parameter.dtype

    def _network_targets(self, y: Tensor) -> Tensor:
        """The targets the likelihood sees: the outcome transform's, cast to the network's dtype.

        Raises:
            ValueError: for a finite target that the network's dtype cannot hold afterwards.
        """
        try:
            return self.outcome_transform.forward(y, self._network_dtype())
        except ValueError as err:
            raise ValueError(f"DVIRegressor: {err}") from None

    def targets_in_original_units(self, y: Tensor) -> Tensor:
        """Batch targets ``y`` in the original units, float64 (undoes pre-standardisation if any)."""
        return self.outcome_transform.original_targets(y)

    # ------------------------------------------------------------------ noise bound
    def on_fit_start(self) -> None:
        """Also forget a recorded noise range: validation during ``fit`` is never bounded."""
        super().on_fit_start()
        self.likelihood.forget_noise_range()

    def on_fit_end(self) -> None:
        """Record the noise range on the training inputs with the final weights (see ``noise_bound``)."""
        super().on_fit_end()
        if self._bounds_noise():
            found = self._training_noise_range()
            if found is not None:
                self.likelihood.set_noise_range(found)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint written during ``fit`` holds the noise range of the weights it holds."""
        super().on_save_checkpoint(checkpoint)
        trainer = self._trainer
        if not self._bounds_noise() or trainer is None:
            return
        if trainer.state.fn != "fit" or trainer.state.status != "running":
            return  # after fit: the buffer already holds the final weights' range
        found = self._training_noise_range()
        state = checkpoint.get("state_dict")
        key = "likelihood.noise_range"
        if found is not None and isinstance(state, dict) and key in state:
            state[key] = found.to(state[key])

    def _bounds_noise(self) -> bool:
        """Whether the predictive bounds the noise, so the training range must be recorded."""
        return self.likelihood.bounds_noise

    def _training_noise_range(self) -> Tensor | None:
        """The range of the log-variance moments on the training inputs, or ``None`` without them.

        One forward pass in the closed-form predictive's mode, in eval mode and without
        gradients, over the training split's tensors (no loader: the training RNG is not
        touched) or, for other datasets, the training loader under a forked RNG. Under DDP the
        processes' ranges are combined.
        """
        view = DataView(self.trainer, "fit")
        dataset = view.dataset()
        if isinstance(dataset, TensorDataset):
            inputs: Any = dataset.tensors[0].split(4096)
        else:
            loader = view.loader()
            if loader is None:
                return None
            inputs = (b[0] if isinstance(b, (tuple, list)) else b for b in loader)
        mode = self.propagation.closed_form()
        dtype, device = self._network_dtype(), self.device
        modes = {m: m.training for m in self.net.modules()}
        self.net.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                outs: list[Gaussian] = []
                for x in inputs:
                    x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
                    outs.append(self.net(x, mode=mode))
                if not outs:
                    return None
                ranges = self.likelihood.noise_range_of(outs)
        finally:
            for module, training in modes.items():
                module.train(training)
        if self.trainer.world_size > 1:
            gathered = cast(Tensor, self.all_gather(ranges.to(self.device))).reshape(-1, 3).cpu()
            ranges = torch.stack([gathered[:, 0].min(), gathered[:, 1].max(), gathered[:, 2].max()])
        return ranges

    # ------------------------------------------------------------------ predictive
    def _network_predictive(
        self, x: Tensor, method: str | None, num_samples: int | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Standardised ``(mean, var, epistemic var)`` of the predictive, each ``[B]``."""
        method = resolve_method(self.mode, method)
        if method == "closed_form":
            out = self.net(x, mode=self.propagation.closed_form())
            dist = self.likelihood.predictive(out)
            return dist.mean, dist.variance, self.likelihood.epistemic_variance(out)
        f = self._weight_draws(x, num_samples)
        # One Gaussian per weight draw (zero output variance), then the mixture's moments.
        per_sample = self.likelihood.conditional(f)
        means = per_sample.mean
        variances = self.likelihood.sampled_variance(f, per_sample)  # finite far from the data
        epistemic = means.var(0, correction=0)
        # the mean of capped draws is at most the cap: back in the network's dtype, finite
        return means.mean(0), variances.mean(0).to(means.dtype) + epistemic, epistemic

    def predictive_standardized(
        self, x: Tensor, method: PredictiveMethod | None = None, num_samples: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive ``(mean, var)`` of the standardised target, each ``[B]`` (differentiable)."""
        mean, var, _ = self._network_predictive(x, method, num_samples)
        return mean, var

    @torch.no_grad()
    def predictive(
        self, x: Tensor, method: PredictiveMethod | None = None, num_samples: int | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Predictive ``(mean, var)`` of ``y`` in its original units, float64 ``[B]`` each, detached.

        Args:
            x: inputs ``[B, D]``.
            method: ``"closed_form"``: the network's output moments through the likelihood's
                closed-form predictive,
                :math:`\mathcal N(\langle m\rangle, \Sigma_{mm} + \mathbb E[e^{\ell}])` (in
                ``full`` covariance mode for a model trained in ``sample``/``local`` mode).
                ``"mc"``: the mixture over ``num_samples`` draws of the weights,
                :math:`\frac1S\sum_s\mathcal N(m_s, e^{\ell_s})`, returned as its exact mean
                and variance :math:`\overline{e^{\ell}} + \frac1S\sum_s(m_s-\bar m)^2`
                (pre-activation draws in ``local`` mode). Default: ``"closed_form"`` for
                ``full``/``diag`` models, ``"mc"`` with the model's ``num_samples`` for
                ``sample``/``local`` ones.
            num_samples: weight draws for ``"mc"`` (default: the model's ``num_samples`` in
                ``sample``/``local`` mode, else 100).
        """
        mean, var = self.predictive_standardized(x, method, num_samples)
        return self._original_units(mean, var, var)[:2]

    @torch.no_grad()
    def predictive_log_prob(
        self,
        x: Tensor,
        y: Tensor,
        method: PredictiveMethod | None = None,
        num_samples: int | None = None,
    ) -> Tensor:
        r"""Log predictive density of targets ``y`` (original units, as in the batches), float64 ``[B]``.

        ``"closed_form"``: the density of the likelihood's closed-form predictive in float64,
        through the outcome transform (:math:`\log\tilde p(\tilde y) - \log s`). For
        ``"heteroscedastic"`` that is the exact density of
        :math:`\int\mathcal N(y; m, e^\ell)\,q(m, \ell)`
        (:class:`~lightning_dvi.likelihoods.HeteroscedasticPredictive`), whose tails are heavier
        than those of the Gaussian with :meth:`predictive`'s moments (the ``val/``/``test/``
        ``nll`` metrics of a closed-form model score the same density);
        ``"homoscedastic"``: :math:`\log\mathcal N(y; \mu, \sigma^2)` with those moments.
        ``"mc"``: the density of the mixture itself over ``num_samples`` weight draws,
        :math:`\log\frac1S\sum_s\mathcal N(y; \mu_s, \sigma_s^2)` (not its moment-matched
        Gaussian; the usual MCVI test log-likelihood). Per point, in the original units of ``y``.
        """
        y = self.targets_in_original_units(y.reshape(x.shape[0]))
        if resolve_method(self.mode, method) == "closed_form":
            return self._closed_form_log_prob(self.net(x, mode=self.propagation.closed_form()), y)
        transform = self.outcome_transform
        f = self._weight_draws(x, num_samples)
        # the library's one MCVI score, in standardised units, then the change of variables
        log_prob = self.likelihood.mixture_log_prob(f, transform.transform(y).to(f.dtype))
        return transform.untransform_log_prob(log_prob)

    @torch.no_grad()
    def variance_decomposition(
        self, x: Tensor, method: PredictiveMethod | None = None, num_samples: int | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Aleatoric and epistemic parts of the predictive variance, original units, ``[B]`` each.

        The law of total variance over the weights: :math:`\operatorname{Var}[y] =
        \mathbb E_w[\sigma^2(x, w)] + \operatorname{Var}_w[m(x, w)]`. Heteroscedastic:
        aleatoric :math:`\mathbb E[e^{\ell}] = e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}`,
        epistemic :math:`\operatorname{Var}[m] = \Sigma_{mm}` (closed form; over weight draws
        with ``method="mc"``). Homoscedastic: aleatoric :math:`e^\lambda`. The two add up to
        the variance of :meth:`predictive`.
        """
        _, var, epistemic = self._original_units(*self._network_predictive(x, method, num_samples))
        return (var - epistemic).clamp_min(0), epistemic

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        """``{"mean", "var", "aleatoric_var", "epistemic_var"}``, each float64 ``[B]``, original units of y."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        # One pass, so that in the MC modes the split and the variance share their draws.
        with torch.no_grad():
            mean, var, epistemic = self._original_units(*self._network_predictive(x, None, None))
        return {
            "mean": mean,
            "var": var,
            "aleatoric_var": (var - epistemic).clamp_min(0),
            "epistemic_var": epistemic,
        }

    def _original_units(
        self, mean: Tensor, var: Tensor, epistemic: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        r""":math:`(\tilde\mu s + m, \tilde\sigma^2 s^2, \tilde\sigma^2_{\rm epi} s^2)`, in float64."""
        transform = self.outcome_transform
        return (*transform.untransform(mean, var), transform.untransform_variance(epistemic))

    def _closed_form_log_prob(self, out: Gaussian, y: Tensor) -> Tensor:
        """:meth:`predictive_log_prob`'s closed form: targets ``y`` in original units, float64 ``[B]``."""
        log_prob, _ = self._closed_form_scores(out, y, density=True, pit=False)
        assert log_prob is not None
        return log_prob

    def _closed_form_scores(
        self, out: Gaussian, y: Tensor, *, density: bool, pit: bool, warn: bool = True
    ) -> tuple[Tensor | None, Tensor | None]:
        """The closed-form predictive's log density at ``y`` (original units) and its CDF there.

        Each float64 ``[B]``, from one predictive, and only where asked (``density``, ``pit``).
        The CDF is ``None`` for a Gaussian predictive (its coverage comes from the moments, as
        before) and for counts (a discrete CDF has no continuous PIT). ``warn=False``: no
        :class:`~lightning_dvi.likelihoods.NoiseBoundWarning`, for a caller that has built the
        predictive of the same rows already (it warned then;
        :func:`~lightning_dvi.likelihoods.gaussian.noise_bound_warned`).
        """
        if not self.likelihood.standardizes_targets:  # own units: never rescaled
            log_prob = self.likelihood.predictive(out).log_prob(y) if density else None
            return log_prob, None
        # in float64, as the moments' way back
        with contextlib.nullcontext() if warn else noise_bound_warned():
            predictive = self.likelihood.predictive(_float64(out))
        transform = self.outcome_transform
        z = transform.transform(y)
        log_prob = transform.untransform_log_prob(predictive.log_prob(z)) if density else None
        gaussian = isinstance(predictive, torch.distributions.Normal)
        return log_prob, (predictive.cdf(z) if pit and not gaussian else None)

    def _update_metrics(self, metrics: MetricCollection, x: Tensor, y: Tensor) -> None:
        if metrics is self.val_metrics and not self._val_predictive:
            return  # val_metrics=["elbo"]: nothing needs the predictive
        closed = resolve_method(self.mode, None) == "closed_form"
        with torch.no_grad():
            if closed:  # one pass: the moments and, for the NLL, the predictive's own density
                out = self.net(x, mode=self.propagation.closed_form())
                dist = self.likelihood.predictive(out)
                parts = (dist.mean, dist.variance, self.likelihood.epistemic_variance(out))
            else:
                parts = self._network_predictive(x, None, None)
            mean, var, epistemic = self._original_units(*parts)
            target = self.targets_in_original_units(y.reshape(mean.shape))
            extra: dict[str, Tensor] = {}
            members = set(metrics.keys(keep_base=True))
            if closed and members & {"nll", "coverage", "calibration"}:
                # the predictive's own density and CDF (a Gaussian's: from the moments); the
                # moments' predictive above has warned about bounded rows already
                log_prob, pit = self._closed_form_scores(
                    out,
                    target,
                    density="nll" in members,
                    pit=bool(members & {"coverage", "calibration"}),
                    warn=False,
                )
                scores = {"log_prob": log_prob, "pit": pit}
                extra = {name: value for name, value in scores.items() if value is not None}
        metrics.update(mean, var, target, **extra)
        split = getattr(self, f"{(metrics.prefix or '').rstrip('/')}_split", None)
        if split is not None:
            split.update((var - epistemic).clamp_min(0), epistemic)

    def _epoch_end(self, stage: str) -> None:
        split: VarianceSplit | None = getattr(self, f"{stage}_split", None)
        if split is not None and split.update_called:
            aleatoric, epistemic = split.compute()
            self.log_dict(
                {f"{stage}/aleatoric_std": aleatoric, f"{stage}/epistemic_std": epistemic},
                sync_dist=True,
            )
            split.reset()
        super()._epoch_end(stage)

    def _curve(self, metrics: MetricCollection) -> dict[str, Tensor]:
        if "calibration" not in metrics.keys(keep_base=True):
            return {}  # not among val_metrics
        expected, observed = cast(RegressionCalibrationError, metrics["calibration"]).curve()
        return {"expected": expected, "observed": observed}


_LEGACY_KEYS = {"target_loc": "outcome_transform.loc", "target_scale": "outcome_transform.scale"}


def _legacy_target_keys(
    module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``state_dict`` post-hook: the transform's buffers under the names checkpoints use."""
    for old, new in _LEGACY_KEYS.items():
        if prefix + new in state:
            state[prefix + old] = state.pop(prefix + new)


def _transform_target_keys(
    module: nn.Module, state: dict[str, Any], prefix: str, *args: Any
) -> None:
    """``load_state_dict`` pre-hook: checkpoint names to the transform's buffers."""
    for old, new in _LEGACY_KEYS.items():
        if prefix + old in state:
            state[prefix + new] = state.pop(prefix + old)


def _float64(out: Gaussian) -> Gaussian:
    """``out`` in float64 (the network's dtype may be float32)."""
    if out.cov is not None:
        return Gaussian(out.mean.double(), cov=out.cov.double(), validate=False)
    return Gaussian(out.mean.double(), var=out.var.double(), validate=False)
