r"""Shared machinery of the DVI LightningModules: network, prior, ELBO steps, logging, optimiser.

Every step calls :func:`lightning_dvi.objective.elbo`, the one implementation of the per-datum
objective

.. math::
    \mathcal L = \frac1B\sum_b\mathbb E_q\log p(y_b\mid x_b, w) - \lambda\beta_t\,\frac{\mathrm{KL}(q\,\|\,p)}{N},

with :math:`N` the training-set size, :math:`\beta_t` the KL schedule at optimisation step
:math:`t` and :math:`\lambda` the constant ``kl_weight`` (1, the ELBO, unless a tempered
posterior is asked for; validation and test always report the untempered ELBO). Under DDP each process averages over its share of the global batch and the gradient
all-reduce averages across processes, so the update is that of the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Literal, cast

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MetricCollection
from typing_extensions import Self

from ..compile import CompiledELBO, CompiledStep, StepTraceError, records_whole_step
from ..gaussian import Gaussian
from ..likelihoods import Likelihood
from ..moments.allocator import reuse_large_allocations
from ..nn import BayesModule, HasPosterior, bayes_layers
from ..nn.builders import Activation
from ..nn.export import PredictiveParts
from ..objective import ELBOTerms, elbo
from ..priors import Prior, prior_config
from ..propagation import Mode, Propagation, propagation
from ._config import (
    KLScheduleConfig,
    LRSchedule,
    OptimiserConfig,
    OptimizerName,
    make_prior,
    posterior_scale_parameters,
)
from ._convergence import ObjectiveConvergence
from ._data import DataView
from ._modes import enter_train_mode
from ._network import MLP_ARGUMENTS, MLPConfig, UnbuiltNetwork, primitive, setup_network
from ._validation import one_of, optional_positive_int, positive_float, positive_int, sampling
from .checkpoint import load_checkpoint_data
from .compile_auto import CompileAuto, compile_setting
from .lbfgs import LBFGSSupervisor, global_loss_value

__all__ = ["DVIModule", "logs_this_step"]

PriorName = Literal["empirical_bayes", "gaussian"]
EBMode = Literal["in_graph", "buffer"]

PredictiveMethod = Literal["closed_form", "mc"]

_DEFAULT_MC_SAMPLES = 100


def resolve_method(mode: Mode, method: str | None) -> str:
    """The predictive method: ``method``, or the default of a model trained in ``mode``."""
    if method is None:
        return "mc" if propagation(mode).samples else "closed_form"
    return one_of("method", method, ("closed_form", "mc"))


def _unrecorded(prior: object) -> list[str]:
    """The constructor arguments ``save_hyperparameters`` skips.

    The network, the output width, and a prior that is not a shorthand (an object is recorded as
    its configuration afterwards, by ``_finish_hparams``).
    """
    return ["net", "out_features", *(() if isinstance(prior, str) else ("prior",))]


def logs_this_step(trainer: Trainer) -> bool:
    """Whether the trainer writes step-level logged values after the current training batch.

    Lightning keeps only every ``log_every_n_steps``-th step's values; each ``self.log`` call
    still costs about half a millisecond on CPU, a quarter of a small network's step, so
    step-level values are only logged when they will be written. The answer depends only on
    the step count, so every DDP process agrees (which ``sync_dist`` needs).
    """
    every = int(trainer.log_every_n_steps)  # type: ignore[attr-defined]  # Trainer(log_every_n_steps=) sets it, undeclared
    if every == 0:
        return False
    if not trainer.training or trainer.accumulate_grad_batches != 1:
        return True  # values Lightning does not write cost time, not correctness
    # Lightning's own test, by public counters: the current batch's 1-based number in the run
    step = trainer.fit_loop.epoch_loop.batch_progress.total.ready
    return step % every == 0 or trainer.should_stop


class DVIModule(LightningModule):
    r"""Base class of :class:`~lightning_dvi.DVIRegressor` and :class:`~lightning_dvi.DVIClassifier`.

    It takes the arguments the two share (the subclasses forward them with ``**kwargs``, and
    LightningCLI lists them under each subclass). Subclasses pass ``in_features``, ``hidden`` and
    ``out_features`` (the likelihood's width, ``None`` until the data tell), build the likelihood
    and the metric collections, and implement :meth:`_update_metrics`, :meth:`_curve`,
    ``predictive`` and ``predict_step``. The hyper-parameters (every constructor argument but
    ``net``) are saved here.

    Args:
        in_features: input size; ``None`` reads it from the data in ``setup()`` (the CLI links
            ``data.in_features``).
        hidden: hidden-layer widths of the MLP.
        out_features: network outputs (set by the subclass).
        activation: the name of a registered activation (``"relu"``, ``"gelu"``, ``"tanh"``, ...).
        residual: skip connections between equal-width hidden layers.
        mode: ``"full"`` (DVI), ``"diag"`` (dDVI), ``"sample"`` (MCVI) or ``"local"`` (local
            reparameterisation).
        num_samples: network samples per step in ``sample``/``local`` mode (default 1; also used
            for the validation/test predictive); must be unset otherwise.
        prior: a :class:`~lightning_dvi.priors.Prior` object (a built-in one, or a class of your
            own, registered with :func:`~lightning_dvi.priors.register_prior` to reload from a
            checkpoint), recorded in the hyper-parameters as its configuration; or a shorthand
            (:data:`~lightning_dvi.priors.SHORTHANDS`): ``"empirical_bayes"`` (inverse-gamma
            hyper-prior, per-group optimum) or ``"gaussian"`` (fixed variance).
        prior_alpha: inverse-gamma shape :math:`\alpha` (the ``"empirical_bayes"`` shorthand).
        prior_beta: inverse-gamma scale :math:`\beta` (the ``"empirical_bayes"`` shorthand).
        prior_variance: the fixed prior variance (``"gaussian"``), or the initial value of the
            empirical-Bayes buffers until the first refresh (``eb_mode="buffer"``); with a prior
            object, leave it unset (the layers start at the prior's
            :meth:`~lightning_dvi.priors.Prior.initial_variance`).
        eb_mode: ``"in_graph"`` (optimum inside the loss, the authors' choice) or ``"buffer"``
            (set by the :class:`~lightning_dvi.callbacks.EmpiricalBayesRefresh` callback); the
            ``"empirical_bayes"`` shorthand only.
        num_data: training-set size :math:`N`; ``None`` takes ``trainer.datamodule.num_train``
            or the length of the training dataset.
        kl_warmup_steps: optimisation steps with the KL switched off (an error if the run ends
            first).
        kl_anneal_steps: steps of the linear KL ramp that follows.
        kl_warmup_fraction: the warm-up as a fraction of the run's optimisation steps
            (``trainer.estimated_stepping_batches``); exclusive with the ``*_steps`` arguments.
        kl_anneal_fraction: the ramp as a fraction of the run's optimisation steps.
        lr: Adam learning rate.
        lr_schedule: ``"constant"`` (default) or ``"cosine"``: cosine decay from ``lr`` to
            ``min_lr`` over the trainer's optimisation steps, per step.
        min_lr: the learning rate the cosine schedule ends at (``0 <= min_lr <= lr``).
        weight_decay: Adam weight decay.
        init_scale: initial posterior std of the weights (default: the layer's,
            :math:`0.1/\sqrt{\text{fan\_in}}`).
        net: a user-built :mod:`lightning_dvi.nn` network to use instead of the MLP (then
            ``hidden``, ``activation``, ``residual`` and ``init_scale`` are not used and not
            recorded). A CLI run (``model.init_args.net``) saves the network's class path and
            arguments, so ``load_from_checkpoint(path)`` rebuilds it; in Python pass ``net=``
            again to ``load_from_checkpoint`` (a checkpoint loaded without it raises, saying so).
        compile: run the ELBO's hot path (network, likelihood, KL) through ``torch.compile``:
            ``True``, or a ``torch.compile`` mode such as ``"reduce-overhead"`` (CUDA graphs);
            value checks stay on, outside the compiled region (:mod:`lightning_dvi.compile`).
            ``"auto"`` times the first eager steps and compiles only when the planned steps
            pay for the compile (:mod:`lightning_dvi.lightning.compile_auto`; the decision is
            logged).
        optimizer: ``"adam"`` (default) or ``"lbfgs"``: L-BFGS with a strong-Wolfe line search,
            for the deterministic objective of ``full``/``diag`` mode on full (or large, fixed)
            batches; one optimisation step runs up to ``lbfgs_iterations`` iterations. It takes
            no ``lr``, ``lr_schedule``, ``weight_decay`` or gradient clipping (see
            :class:`~lightning_dvi.lightning._config.OptimiserConfig`). The module then adds
            :class:`~lightning_dvi.lightning.lbfgs.LBFGSSupervisor` to the trainer's callbacks
            (restarts, the non-finite undo, the stall check).
        lbfgs_iterations: L-BFGS iterations per optimisation step.
        lbfgs_history: curvature pairs L-BFGS keeps.
        convergence_tol: stop training once the epoch's mean training loss changes by at most
            this much, relative, between consecutive epochs, :math:`|L_e - L_{e-1}| \le
            \text{tol}\cdot\max(1, |L_e|)`, counted only once the KL schedule has reached its
            final weight (``None``, the default: train for the trainer's budget). Meant for
            deterministic full-batch runs (``optimizer="lbfgs"``); the decision is the same on
            every DDP process. ``model.converged`` says whether it fired.
        kl_weight: constant factor :math:`\lambda` on the KL in the training loss (default 1:
            the ELBO). :math:`\lambda < 1` trains a tempered posterior, which is no longer the
            ELBO's optimum but can be better calibrated on small data sets (measured in
            docs/calibration.md); validation and test still report the untempered ELBO.
        scale_lr: Adam's learning rate for the posterior scales' parameters (``None``, the
            default: ``lr``); the means and any likelihood parameters keep ``lr``. A raw scale
            is the logarithm of a small standard deviation, so this rate is the relative pace
            at which the standard deviations move (see
            :class:`~lightning_dvi.lightning._config.OptimiserConfig`).

    Attributes:
        likelihood: the observation model.
        prior: the weight prior (its variances live in the layers' persistent buffers).
        calibration_curves: per stage (``"val"``/``"test"``), the data of the last epoch's
            calibration plot, synced across processes (read by the plot callbacks).
        converged: whether the run stopped because the objective converged
            (``convergence_tol``); ``False`` until then.
    """

    likelihood: Likelihood
    net: nn.Module
    val_metrics: MetricCollection
    test_metrics: MetricCollection
    logs_val_elbo: bool = True  # a subclass may log fewer validation values (val_metrics)
    converged: bool = False  # set per instance by the convergence check

    def __init__(
        self,
        *,
        in_features: int | None,
        hidden: list[int],
        out_features: int | None,
        activation: Activation = "relu",
        residual: bool = False,
        mode: Mode = "full",
        num_samples: int | None = None,
        prior: PriorName | Prior = "empirical_bayes",
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
        lr_schedule: LRSchedule = "constant",
        min_lr: float = 0.0,
        weight_decay: float = 0.0,
        init_scale: float | None = None,
        net: BayesModule | None = None,
        kl_weight: float = 1.0,
        compile: bool | str = False,
        optimizer: OptimizerName = "adam",
        lbfgs_iterations: int = 20,
        lbfgs_history: int = 20,
        convergence_tol: float | None = None,
        scale_lr: float | None = None,
    ) -> None:
        super().__init__()
        self._compile, self._compile_auto = compile_setting(compile)  # validated; used in _elbo
        self.mode, self.num_samples = sampling(mode, num_samples)
        self.num_data = optional_positive_int("num_data (the training-set size N)", num_data)
        self.optimiser_config = OptimiserConfig(
            lr,
            lr_schedule,
            min_lr,
            weight_decay,
            optimizer,
            lbfgs_iterations,
            lbfgs_history,
            scale_lr,
        ).for_mode(self.mode)
        self.convergence = ObjectiveConvergence(convergence_tol)
        self.kl_config = KLScheduleConfig(
            kl_warmup_steps, kl_anneal_steps, kl_warmup_fraction, kl_anneal_fraction
        )
        self.kl_schedule = self.kl_config.schedule()  # fractions become steps in on_train_start
        self.kl_weight = positive_float("kl_weight", kl_weight)
        self.prior, prior_variance = make_prior(  # the layers start at the prior's variance
            prior, prior_alpha, prior_beta, prior_variance, eb_mode
        )
        self.net_injected = net is not None
        self._net_config = primitive(net) if isinstance(net, Mapping) else None  # a CLI run's net
        self._mlp: MLPConfig | None = None  # the built-in MLP, unless a network is injected
        if net is None:
            self._mlp = MLPConfig(hidden, activation, residual, init_scale, prior_variance)
        self.out_features = out_features
        self.net, self.in_features = setup_network(
            type(self).__name__, net, self._mlp, in_features, out_features
        )
        self.calibration_curves: dict[str, dict[str, Tensor]] = {}
        self.save_hyperparameters(ignore=_unrecorded(prior))  # this and the subclass's frame
        self._finish_hparams()

    # ------------------------------------------------------------------ construction
    def _finish_hparams(self) -> None:
        """After ``save_hyperparameters``: the resolved ``num_samples``, a prior object's configuration.

        An injected network records no MLP arguments.
        """
        self.hparams["num_samples"] = self.num_samples
        if "prior" not in self.hparams:  # an object or a configuration: its plain record
            self.hparams["prior"] = prior_config(self.prior)
        if not self.net_injected:
            return
        for key in MLP_ARGUMENTS:
            self.hparams.pop(key, None)
        if self._net_config is not None:
            self.hparams["net"] = self._net_config

    @property
    def network_built(self) -> bool:
        """Whether the network exists (it is built in ``setup()`` when ``in_features`` was not given)."""
        return not isinstance(self.net, UnbuiltNetwork)

    def build_network(self, in_features: int) -> None:
        """Build the MLP for ``in_features`` inputs (once) and record the width in the hyper-parameters."""
        if self.network_built:
            return
        positive_int("in_features", in_features)
        if self.out_features is None:
            raise ValueError(f"{type(self).__name__}: the number of outputs is not known yet")
        assert self._mlp is not None  # only the MLP waits for the data
        self.in_features = int(in_features)
        self.net = self._mlp.build(self.in_features, self.out_features)
        self.hparams["in_features"] = self.in_features
        self._after_build()

    def _after_build(self) -> None:
        """Initialise what depends on the built network (subclasses override)."""

    def _weight_draws(self, x: Tensor, num_samples: int | None) -> Tensor:
        """Network outputs ``[S, B, D]`` under ``S`` posterior draws of the weights."""
        if num_samples is None:
            num_samples = self.num_samples or _DEFAULT_MC_SAMPLES  # set in sample/local only
        # the training propagation's kind of draws (local or whole-weight), checked there
        return cast(Tensor, self.net(x, mode=self.propagation.draws(num_samples)))

    def _last_layer(self) -> HasPosterior:
        """The network's last layer with a posterior (its head), found by protocol."""
        return list(bayes_layers(self.net))[-1]

    def _output_width(self) -> int:
        """The number of network outputs: the head's ``out_features``."""
        width = getattr(self._last_layer(), "out_features", None)
        if not isinstance(width, int):
            raise ValueError(
                f"{type(self).__name__}: the last weight layer of the network "
                f"({type(self._last_layer()).__name__}) has no out_features; pass num_classes="
            )
        return width

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Gaussian | Tensor:
        """The network output: a :class:`~lightning_dvi.Gaussian` (``full``/``diag``) or samples ``[S, B, D]``."""
        return cast("Gaussian | Tensor", self.net(x, mode=self.propagation))

    @property
    def propagation(self) -> Propagation:
        """The training propagation: the hyper-parameters ``mode`` and ``num_samples`` as one value.

        Built by :func:`~lightning_dvi.propagation.propagation` (the constructor checked the
        pair there once); the predictive's closed form is ``propagation.closed_form()``.
        """
        return propagation(self.mode, self.num_samples)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        """Resolve what was not given from the data, then build the network if needed.

        ``in_features`` comes from ``trainer.datamodule.in_features`` or the width of the first
        batch; ``num_data`` (the ``N`` of ``KL / N``, when fitting) from
        ``trainer.datamodule.num_train`` or the training dataset's length. Subclasses add their
        own (the classifier's classes, the regressor's target statistics). The resolved values
        are recorded in the hyper-parameters, so checkpoints rebuild the same module.
        """
        self._resolve_from_data(DataView(self.trainer, stage))

    def _resolve_from_data(self, view: DataView) -> None:
        name = type(self).__name__
        if not self.network_built:
            in_features = self.in_features or view.attribute("in_features")
            if in_features is None:
                batch = view.first_batch()
                if batch is None:
                    raise ValueError(
                        f"{name}: in_features was not given and cannot be read from the data "
                        f"(no datamodule with `in_features` and no {view.stage} dataloader); "
                        "pass in_features="
                    )
                x = batch[0]
                if x.dim() < 2:
                    raise ValueError(
                        f"{name}: cannot read in_features from input batches of shape "
                        f"{tuple(x.shape)}; batches must be (x [B, D], y [B]), or pass in_features="
                    )
                in_features = x.shape[-1]
            self.build_network(int(in_features))
        if self.num_data is None and (view.stage == "fit" or view.datamodule is not None):
            num_train = view.attribute("num_train")
            if num_train is None and view.stage == "fit":
                num_train = view.num_examples()
            if num_train is None and view.stage == "fit":
                raise ValueError(
                    f"{name}: num_data (the training-set size N in KL / N) is not set, the "
                    "trainer has no datamodule with `num_train` and the training dataset has no "
                    "length; pass num_data=N"
                )
            if num_train is not None:
                self.num_data = int(num_train)
                # Recorded so a checkpoint rebuilds the module with the same N.
                self.hparams["num_data"] = self.num_data

    def _total_steps(self, what: str) -> int:
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total) or total < 1:
            raise ValueError(
                f"{what} needs a finite number of optimisation steps; set the trainer's "
                f"max_steps or max_epochs (estimated steps: {total})"
            )
        return int(total)

    def on_train_start(self) -> None:
        """Turn the KL warm-up/ramp fractions into steps; refuse a warm-up that outlasts the run.

        Run when training starts (after a checkpoint is restored): the number of optimisation
        steps is ``trainer.estimated_stepping_batches``.
        """
        if self.optimiser_config.lr_schedule == "cosine":
            self._total_steps("lr_schedule='cosine'")
        self.convergence.reset()
        total: float = self.trainer.estimated_stepping_batches
        finite = math.isfinite(total) and total >= 1
        if self.kl_config.by_fraction:
            total = self._total_steps("kl_warmup_fraction/kl_anneal_fraction")
            self.kl_schedule = self.kl_config.schedule(total)
            return
        if not finite or getattr(self.trainer, "fast_dev_run", False):  # a smoke test
            return
        warmup, anneal = self.kl_schedule.warmup_steps, self.kl_schedule.anneal_steps
        if warmup and warmup >= total:
            raise ValueError(
                f"kl_warmup_steps={warmup} does not end before the run does ({int(total)} "
                "optimisation steps): the KL would never be switched on. Shorten the warm-up or "
                "give it as a fraction of the run (kl_warmup_fraction, kl_anneal_fraction)"
            )
        if warmup + anneal > total:
            rank_zero_warn(
                f"{type(self).__name__}: the KL ramp (kl_warmup_steps={warmup} + "
                f"kl_anneal_steps={anneal}) ends after the run's {int(total)} optimisation steps, "
                "so the KL never reaches full weight; consider kl_warmup_fraction/"
                "kl_anneal_fraction"
            )

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path | IO[bytes],
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load a module from a checkpoint, as data: nothing named by the file is imported or called.

        Lightning's loader with two guards: the file is read with
        ``torch.load(..., weights_only=True)`` (tensors and plain values only), and the
        hyper-parameters are vetted first (:mod:`lightning_dvi.lightning.checkpoint`): a saved
        network configuration is rebuilt only from this library's network classes and those
        registered with :func:`~lightning_dvi.lightning.register_network`, and LightningCLI's
        instantiator record is dropped (the class is built by calling its constructor with the
        saved arguments). Keyword arguments override saved hyper-parameters, e.g. ``net=`` to
        load the weights into a network built in code.

        Raises:
            ValueError: for a file that holds other pickled objects, a refused network or
                model class (naming it and how to load trusted weights), or
                ``weights_only=False``.
        """
        if weights_only is False:
            raise ValueError(
                "weights_only=False is not supported: lightning_dvi reads checkpoints as data "
                "(torch.load(..., weights_only=True)); build the module in code and call "
                "load_state_dict on a file you trust"
            )
        target, data = load_checkpoint_data(
            cls, checkpoint_path, map_location, hparams_file, tuple(kwargs)
        )
        loader = super(DVIModule, cast(type[DVIModule], target)).load_from_checkpoint
        return cast(Self, loader(data, map_location=map_location, strict=strict, **kwargs))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record whether the network was injected (``net=``) and its class."""
        net = type(self.net)
        checkpoint["lightning_dvi"] = {
            "injected_net": f"{net.__module__}.{net.__qualname__}" if self.net_injected else None
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Build a deferred network from the saved weights; refuse to drop an injected one."""
        injected = checkpoint.get("lightning_dvi", {}).get("injected_net")
        if injected and not self.net_injected:
            raise ValueError(
                f"this checkpoint was trained with an injected network ({injected}), which the "
                f"hyper-parameters cannot rebuild; pass net= with the same architecture, e.g. "
                f"{type(self).__name__}.load_from_checkpoint(path, net=...)"
            )
        if not self.network_built:
            in_features = checkpoint.get("hyper_parameters", {}).get("in_features")
            if in_features is None:
                first = next(
                    (v for k, v in checkpoint["state_dict"].items() if k.endswith("weight_loc")),
                    None,
                )
                in_features = None if first is None else int(first.shape[-1])
            if in_features is not None:
                self.build_network(int(in_features))

    def _elbo(self, batch: tuple[Tensor, Tensor], kl_weight: float, stage: str) -> ELBOTerms:
        x, y = batch
        if self.num_data is None:
            raise ValueError(
                f"{type(self).__name__}: num_data is not set; pass num_data=N or train with a "
                "datamodule that has `num_train`"
            )
        y = self._network_targets(y)
        # L-BFGS's line search may try a point where the loss overflows; an infinite trial
        # fails its sufficient-decrease test and it backs off, so only the parameters it
        # accepts are checked (LBFGSSupervisor).
        check_finite = stage != "train" or self.optimiser_config.optimizer != "lbfgs"
        try:
            if self._compile is not None:  # value checks run eagerly around the compiled part
                try:
                    return self._compiled_elbo()(
                        x, y, self.num_data, kl_weight, check_finite=check_finite
                    )
                except StepTraceError as err:
                    rank_zero_warn(f"{err}; falling back to compile_elbo for this module")
                    self.__dict__["_compiled_elbo_fn"] = self._compiled_elbo(whole_step=False)
                    return self._compiled_elbo()(
                        x, y, self.num_data, kl_weight, check_finite=check_finite
                    )
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
                check_finite=check_finite,
            )
        except FloatingPointError as err:
            raise FloatingPointError(
                f"{stage} loss is not finite at global step {self.global_step} (epoch "
                f"{self.current_epoch}); training stopped: {err}"
            ) from err

    def _compiled_elbo(self, whole_step: bool = True) -> CompiledStep | CompiledELBO:
        """The compiled objective, built on first use (outside nn.Module's attribute registry).

        A deterministic mode compiles the whole step, value and gradient, as one graph
        (:class:`~lightning_dvi.compile.CompiledStep`); a sampled mode, a CUDA-graph mode or a
        step that cannot be traced (``whole_step=False``) compiles the objective's forward
        through ``torch.compile`` (:class:`~lightning_dvi.compile.CompiledELBO`).
        """
        compiled = self.__dict__.get("_compiled_elbo_fn")
        if compiled is None or not whole_step:
            options = dict(self._compile or {})  # set: compile was asked for
            compile_mode = options.pop("mode", None)  # torch.compile's mode, not the propagation
            how = propagation(self.mode, self.num_samples)
            parts = (self.net, self.likelihood, self.prior, how)
            if whole_step and records_whole_step(how, compile_mode):
                compiled = CompiledStep(*parts, compile_mode=compile_mode, **options)
            else:
                compiled = CompiledELBO(*parts, compile_mode=compile_mode, **options)
            self.__dict__["_compiled_elbo_fn"] = compiled
        return compiled

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
        """One ELBO step; the KL weight is ``kl_weight`` times the schedule at ``global_step``.

        Under ``optimizer="lbfgs"`` this is the closure an optimizer step evaluates about ten
        times: the terms are logged once, by :meth:`optimizer_step`, with the values of its
        last evaluation (those Lightning kept when every evaluation logged; each ``self.log``
        costs about half a millisecond on CPU).
        """
        kl_weight = self.kl_weight * self.kl_schedule(self.global_step)
        terms = self._elbo(batch, kl_weight, "train")
        if logs_this_step(self.trainer):
            if self.optimiser_config.optimizer == "lbfgs":
                detached = replace(
                    terms,
                    loss=terms.loss.detach(),
                    expected_log_likelihood=terms.expected_log_likelihood.detach(),
                    kl=terms.kl.detach(),
                )
                self.__dict__["_pending_train_log"] = (detached, batch[0].shape[0], kl_weight)
            else:
                self._log_train(terms, batch[0].shape[0], kl_weight)
        if self.optimiser_config.optimizer == "lbfgs" and self.trainer.world_size > 1:
            return global_loss_value(terms.loss, self.trainer.strategy)  # one line search
        return terms.loss

    def _log_train(self, terms: ELBOTerms, batch_size: int, kl_weight: float) -> None:
        self._log_terms(terms, "train", batch_size)
        self.log("train/kl_weight", kl_weight, on_step=True, on_epoch=False, batch_size=1)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the training terms an L-BFGS step's closure left to log."""
        super().optimizer_step(*args, **kwargs)
        pending = self.__dict__.pop("_pending_train_log", None)
        if pending is not None:
            self._log_train(*pending)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Add the batch's loss (the last evaluation's, under L-BFGS) to the epoch's objective."""
        if self.convergence.enabled and isinstance(outputs, Mapping) and "loss" in outputs:
            self.convergence.add(outputs["loss"])

    def configure_callbacks(self) -> list[Callback]:
        """The callbacks the module's settings add.

        :class:`~lightning_dvi.lightning.lbfgs.LBFGSSupervisor` under ``optimizer="lbfgs"``,
        :class:`~lightning_dvi.lightning.compile_auto.CompileAuto` under ``compile="auto"``.
        """
        callbacks: list[Callback] = []
        if self.optimiser_config.optimizer == "lbfgs":
            callbacks.append(LBFGSSupervisor())
        if self._compile_auto is not None:
            callbacks.append(CompileAuto(self._compile_auto))
        return callbacks

    def on_fit_start(self) -> None:
        """Put the network in train mode.

        Lightning 2.x keeps the modes modules have when ``fit`` starts; a network converted
        from an ``eval()`` torch model would train its batch normalization on the running
        statistics. A fit trains (a frozen last-layer backbone stays in eval mode), and a
        warning names the batch norms it switched (``freeze_statistics=True`` keeps the
        running statistics on purpose).

        On a CPU, large freed buffers are kept for reuse
        (:func:`~lightning_dvi.moments.allocator.reuse_large_allocations`, env
        ``LIGHTNING_DVI_MALLOC=system`` to leave the allocator alone).
        """
        super().on_fit_start()
        if self.device.type == "cpu":
            reuse_large_allocations()
        switched = enter_train_mode(self)
        if switched:
            rank_zero_warn(
                f"{type(self).__name__}: fit put batch normalization in train mode (batch "
                f"statistics): {', '.join(switched)} (e.g. converted from an eval() torch "
                "model); to train on the running statistics, set freeze_statistics=True on "
                "those layers (or use from_torch(..., last_layers=k), whose backbone stays frozen)"
            )

    def on_train_epoch_end(self) -> None:
        """Stop the trainer once the objective has converged (``convergence_tol``)."""
        if not self.convergence.enabled:
            return
        final_weight = self.kl_schedule(self.global_step) == 1.0
        stop = self.convergence.epoch_end(final_weight)
        stop = bool(self.trainer.strategy.reduce_boolean_decision(stop, all=True))
        if stop:
            self.trainer.should_stop = True
        self.converged = self.convergence.converged = stop

    def _eval_step(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        # The ELBO is computed only to be logged: a validation that logs none of it
        # (DVIRegressor(val_metrics=[...]) without "elbo", e.g. early stopping on val/nll after
        # every L-BFGS step) skips a network pass, the KL and a host read per validation.
        if stage != "val" or self.logs_val_elbo:
            self._log_terms(self._elbo(batch, 1.0, stage), stage, batch[0].shape[0])
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
        r"""Adam over the variational parameters (and any likelihood parameters) that train.

        Parameters with ``requires_grad=False`` (a frozen backbone) are left out. With
        ``scale_lr`` set (and not ``lr``) the posterior scales' parameters
        (:func:`~lightning_dvi.lightning._config.posterior_scale_parameters`) are a second
        parameter group at ``scale_lr``.

        With ``lr_schedule="cosine"`` the learning rate follows, per optimisation step
        :math:`t` of :math:`T` (``trainer.estimated_stepping_batches``),

        .. math::
            \eta_t = \eta_{\min} + (\eta - \eta_{\min})\,\tfrac12\bigl(1 + \cos(\pi\min(t, T)/T)\bigr),

        and stays at :math:`\eta_{\min}` (``min_lr``) after :math:`T`; :math:`T` must be finite
        (set ``max_steps`` or ``max_epochs``).
        """
        # frozen parameters (a LastLayerNetwork's backbone) are not the optimiser's
        trainable = [p for p in self.parameters() if p.requires_grad]
        return self.optimiser_config.configure(
            trainable,
            lambda: self._total_steps("lr_schedule='cosine'"),
            posterior_scale_parameters(self.net),
        )

    @property
    def lr(self) -> float:
        """Adam's learning rate (settable, as Lightning's learning-rate finder does)."""
        return self.optimiser_config.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimiser_config = replace(self.optimiser_config, lr=value)  # checked again

    # ------------------------------------------------------------------ subclass interface
    def predictive_parts(self) -> PredictiveParts:
        """The network and likelihood, for :func:`~lightning_dvi.nn.export_predictive`."""
        return PredictiveParts(self.net, self.likelihood)

    def _network_targets(self, y: Tensor) -> Tensor:
        """The targets as the likelihood sees them (the regressor standardises)."""
        return y

    def _update_metrics(self, metrics: MetricCollection, x: Tensor, y: Tensor) -> None:
        raise NotImplementedError

    def _curve(self, metrics: MetricCollection) -> dict[str, Tensor]:
        raise NotImplementedError
