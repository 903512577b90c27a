"""The ``lightning-dvi`` console script: LightningCLI over the DVI modules and data modules.

Usage::

    lightning-dvi fit --config recipes/toy_heteroscedastic.yaml
    lightning-dvi test --config recipes/toy_heteroscedastic.yaml --ckpt_path last
    lightning-dvi fit --model DVIClassifier --data DigitsDataModule --trainer.max_epochs 5
    lightning-dvi fit --model.help DVIRegressor        # every model argument, typed

The model is any :class:`~lightning_dvi.lightning._base.DVIModule` subclass and the data any
``LightningDataModule``, both chosen by ``class_path`` (short names work for the built-in ones).
When the model is instantiated these values are linked from the data module, if it has them and
the model accepts them (otherwise the link is skipped):

* ``data.in_features`` -> ``model.init_args.in_features``
* ``data.num_train`` -> ``model.init_args.num_data`` (the ``N`` of ``KL / N``)
* ``data.target_loc`` / ``data.target_scale`` -> the regressor's target standardisation (members
  of :class:`~lightning_dvi.transforms.TargetStatistics`, which the regressor checks in ``setup()``)
* ``data.num_classes`` -> ``model.init_args.num_classes`` (the classifier)

The model may also leave these unset and read them from the data in ``setup()``.

Runs, checkpoints and progress: each run writes into its own logger directory
(``version_K``); without a ``ModelCheckpoint`` in the config a
:class:`~lightning_dvi.callbacks.RunCheckpoint` writes ``last.ckpt`` there every epoch.
``--ckpt_path last`` is the newest run's ``last.ckpt`` (printed); every ``--ckpt_path`` is read
with ``weights_only=True`` and its hyper-parameters vetted before anything is built from them
(:mod:`lightning_dvi.lightning.checkpoint`). Progress: a TQDM bar on a terminal, plain lines
when piped or under ``CI`` (:mod:`lightning_dvi.lightning.progress`).

Invalid configurations stop with jsonargparse's message naming the key and exit code 2: type
errors while parsing, and the modules' own ``ValueError`` checks while instantiating. ``test``,
``validate`` and ``predict`` with ``--ckpt_path last`` and no last checkpoint, a refused
checkpoint, ``validate`` or ``test`` on a data module without that split, and ``fit`` resumed
from a checkpoint that has reached ``--trainer.max_epochs`` (which counts the checkpoint's
epochs too) or ``max_steps``, stop with a message and exit code 1 instead of running an
untrained model, code from a file, or nothing.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse.typing import PositiveInt
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger

# Imported so their classes are known to jsonargparse by short name (``--data DigitsDataModule``).
from . import data as _data  # noqa: F401
from .callbacks import CalibrationPlot, EmpiricalBayes, PredictiveBandPlot, ReliabilityDiagram  # noqa: F401
from .lightning import DVIClassifier, DVIRegressor
from .lightning._base import DVIModule
from .lightning.checkpoint import (
    RunCheckpoint,
    find_last_checkpoint,
    read_checkpoint,
    vet_hyperparameters,
)
from .lightning.predictions import PredictionWriter, write_predictions
from .lightning.progress import describe_data, progress_callback
from .lightning.warm_start import WarmStartMode, switch_warm_start

__all__ = ["DVILightningCLI", "cli", "main", "write_predictions_csv"]

_LINKS = (
    ("in_features", "in_features"),
    ("num_train", "num_data"),
    # TargetStatistics' members (the regressor checks the whole protocol in setup())
    ("target_loc", "target_loc"),
    ("target_scale", "target_scale"),
    ("num_classes", "num_classes"),
)


class DVILightningCLI(LightningCLI):
    """LightningCLI with the data-to-model links, clean config errors and a closing summary."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``--test_after_fit``, ``--num_threads`` and the links from data to model."""
        parser.add_argument(
            "--num_threads",
            type=PositiveInt | None,
            default=None,
            help=(
                "torch intra-op threads (torch.set_num_threads). Small BNNs run fastest with 1: "
                "extra threads spin on shared CPUs. DDP on CPU already divides the cores."
            ),
        )
        parser.add_argument(
            "--warm_start",
            type=WarmStartMode | None,
            default=None,
            help=(
                "PointEstimateWarmStart's mode for this run: none (off), auto (off when training "
                "on mini-batches), point (always; added if the config has no warm start)."
            ),
        )
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=False,
            help="After `fit`, run `test` on the final weights and print the test metrics.",
        )
        for source, target in _LINKS:
            # On instantiation: the data module computes these from its files or generator;
            # jsonargparse skips a link whose source attribute or target argument is absent.
            parser.link_arguments(
                f"data.{source}", f"model.init_args.{target}", apply_on="instantiate"
            )

    def before_instantiate_classes(self) -> None:
        """Start the wall clock reported in the summary; apply ``--num_threads``."""
        self._start = time.perf_counter()
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.get("num_threads"):
            torch.set_num_threads(config["num_threads"])

    def instantiate_classes(self) -> None:
        """Instantiate, turning the classes' argument checks into a parser error (exit 2).

        An injected network (``model.init_args.net``) is recorded in the model's
        hyper-parameters as its class path and arguments, so ``load_from_checkpoint`` rebuilds it.
        """
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:
            self.parser.error(f"invalid configuration ({type(err).__name__}): {err}")
        net_config = self._model_config().get("net")
        model = getattr(self, "model", None)
        if isinstance(net_config, dict) and "class_path" in net_config and model is not None:
            architecture = getattr(model.net, "architecture", None)
            if callable(architecture):  # a TorchNetwork: its layer list, not the file's path
                net_config = {"class_path": net_config["class_path"], "init_args": architecture()}
            model.hparams["net"] = net_config

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with a resumable checkpoint and progress reporting unless configured.

        Without a ``ModelCheckpoint`` in ``trainer.callbacks`` (and ``enable_checkpointing``
        not false) a :class:`~lightning_dvi.callbacks.RunCheckpoint` writes ``last.ckpt``
        every epoch into the run's own directory. Without a progress-bar callback (and
        ``enable_progress_bar`` not false): Lightning's TQDM bar with the loss and key metric
        when standard error is a terminal, plain periodic lines otherwise or under ``CI``.
        """
        config = self._get(self.config_init, "trainer", default={})
        given = config.get("callbacks")
        callbacks = list(given) if isinstance(given, (list, tuple)) else [given] if given else []
        added: list[Callback] = switch_warm_start(callbacks, self._get(self.config, "warm_start"))
        if config.get("enable_checkpointing") is not False and not any(
            isinstance(c, ModelCheckpoint) for c in callbacks
        ):
            added.append(RunCheckpoint())
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            added.append(progress_callback())
        if added:
            kwargs["callbacks"] = callbacks + added
        return super().instantiate_trainer(**kwargs)

    def _parse_ckpt_path(self) -> None:
        """Vet a ``--ckpt_path`` file before LightningCLI merges its hyper-parameters.

        LightningCLI (2.4+) reads the checkpoint's hyper-parameters into the model's
        configuration, where jsonargparse would import the class paths they name; here they are
        read with ``weights_only=True`` and checked first: the model class must be one already
        imported, and the network one this library allows or the one the user's own config names.
        """
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path and path != "last" and Path(path).is_file():
            model = self.config[subcommand].get("model")
            own_net = _get_path(model, "init_args", "net", "class_path")
            self._vetted_checkpoint(str(subcommand), path, own_net)
        parse = getattr(super(), "_parse_ckpt_path", None)  # LightningCLI >= 2.4
        if parse is not None:
            parse()

    @staticmethod
    def _vetted_checkpoint(subcommand: str, path: str, own_net: str | None) -> dict[str, Any]:
        """The checkpoint at ``path``, read as data, its hyper-parameters vetted; else exit 1.

        The model class it names must be one already imported, and its network one this
        library allows or the one the user's own configuration names (``own_net``).
        """
        try:
            checkpoint = read_checkpoint(path)
            vet_hyperparameters(
                checkpoint.get("hyper_parameters") or {},
                DVIModule,
                f"checkpoint {path}",
                (own_net,) if own_net else (),
            )
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"lightning-dvi {subcommand}: {err}") from err
        return checkpoint

    def _model_config(self) -> dict[str, Any]:
        config = getattr(self, "config_dump", None)
        if config is None:
            config = yaml.safe_load(self.parser.dump(self.config, skip_none=False, format="yaml"))
            if self.subcommand:
                config = config[self.subcommand]
        model = config.get("model") or {}
        return model.get("init_args", model) if isinstance(model, dict) else {}

    def _require_last_checkpoint(self, kwargs: dict[str, Any]) -> None:
        """Resolve and vet ``ckpt_path`` in ``kwargs`` before the trainer loads it.

        ``last`` becomes the newest run's ``last.ckpt``
        (:func:`~lightning_dvi.lightning.checkpoint.find_last_checkpoint`; an error when there is
        none, where Lightning only warns), printed so the user sees which run is resumed. The
        file is read with ``weights_only=True`` first (a file that is not plain data is refused),
        and the trainer is asked to load it the same way.
        """
        path = kwargs.get("ckpt_path")
        if path is None:
            return
        which = ""
        if path == "last":
            which = "the newest run's checkpoint, "
            found = find_last_checkpoint(self.trainer)
            if found is None:
                raise SystemExit(
                    f"lightning-dvi {self.subcommand}: --ckpt_path last, but there is no last "
                    "checkpoint (no last.ckpt in any run directory of this config's logger or "
                    "ModelCheckpoint); run `fit` first or pass --ckpt_path PATH"
                )
            path = kwargs["ckpt_path"] = str(found)
        own_net = self._model_config().get("net")
        checkpoint = self._vetted_checkpoint(
            str(self.subcommand),
            path,
            own_net.get("class_path") if isinstance(own_net, dict) else None,
        )
        self._resumed = (path, checkpoint.get("epoch"), checkpoint.get("global_step"))
        if self.subcommand == "fit":
            self._require_training_left(path, checkpoint)
        if self.trainer.is_global_zero:
            verb = "resuming" if self.subcommand == "fit" else "loading"
            print(
                f"lightning-dvi {self.subcommand}: {verb} {which}{path} (epoch "
                f"{self._resumed[1]}, global step {self._resumed[2]})",
                flush=True,
            )
        method = getattr(self.trainer, str(self.subcommand))
        if "weights_only" in inspect.signature(method).parameters:  # Lightning >= 2.5
            kwargs["weights_only"] = True

    def _require_training_left(self, path: str, checkpoint: Mapping[str, Any]) -> None:
        """Refuse to resume ``fit`` from a checkpoint that has reached the run's limits; exit 1.

        ``--trainer.max_epochs`` counts every epoch of the run, the checkpoint's included: with
        ``E`` epochs trained (the checkpoint's ``epoch`` is ``E - 1``, counted from 0), a
        ``max_epochs <= E`` leaves nothing to train: Lightning would stop at once, or raise a
        ``MisconfigurationException`` traceback when the checkpoint's epoch exceeds
        ``max_epochs``. Likewise ``--trainer.max_steps`` against the checkpoint's global step.
        ``E`` is the fit loop's count of processed epochs, the count Lightning stops on.
        """
        fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
        progress = (fit_loop.get("epoch_progress") or {}).get("current") or {}
        trained, step = progress.get("processed"), checkpoint.get("global_step")
        max_epochs, max_steps = self.trainer.max_epochs, self.trainer.max_steps
        if (
            isinstance(trained, int)
            and max_epochs is not None
            and max_epochs != -1
            and trained >= max_epochs
        ):
            limit = f"--trainer.max_epochs {max_epochs}"
            done = f"{trained} epochs (its epoch {checkpoint.get('epoch')}, counted from 0)"
            how = (
                f"--trainer.max_epochs {trained + max_epochs} trains {max_epochs} more epochs "
                f"(max_epochs counts every epoch of the run, the checkpoint's {trained} included)"
            )
        elif isinstance(step, int) and max_steps != -1 and step >= max_steps:
            limit = f"--trainer.max_steps {max_steps}"
            done = f"{step} optimisation steps (global step {step})"
            how = f"--trainer.max_steps {step + max_steps} trains {max_steps} more steps"
        else:
            return
        raise SystemExit(
            f"lightning-dvi fit: {limit}, but the checkpoint {path} has already trained {done}, "
            f"so there is nothing left to train. To train on, raise the limit: {how}. To "
            "evaluate the checkpoint, run `lightning-dvi test` or `predict` with this "
            "--ckpt_path; to train a new model, leave out --ckpt_path"
        )

    def _require_batches(self, stage: str, counts: list[int | float] | int) -> None:
        total = sum(counts) if isinstance(counts, list) else counts
        if not total:
            raise SystemExit(
                f"lightning-dvi {self.subcommand}: the data module has no {stage} data, so "
                f"nothing was evaluated (e.g. a split fraction of 0, such as "
                f"data.val_fraction=0 for validation); give it a {stage} split"
            )

    def fit(self, **kwargs: Any) -> None:
        """Run ``trainer.fit``; ``--ckpt_path last`` resumes the newest run (and says which)."""
        self._require_last_checkpoint(kwargs)
        self.trainer.fit(**kwargs)

    def validate(self, **kwargs: Any) -> None:
        """Run ``trainer.validate``; fail when there is no checkpoint to load or no validation data."""
        self._require_last_checkpoint(kwargs)
        self.trainer.validate(**kwargs)
        self._require_batches("validation", self.trainer.num_val_batches)

    def test(self, **kwargs: Any) -> None:
        """Run ``trainer.test``; fail when there is no checkpoint to load or no test data."""
        self._require_last_checkpoint(kwargs)
        self.trainer.test(**kwargs)
        self._require_batches("test", self.trainer.num_test_batches)

    def predict(self, **kwargs: Any) -> None:
        """Run ``trainer.predict`` and save the predictions to ``<log_dir>/predictions.pt``, ``.csv`` and ``.parquet``.

        Regression: ``{"mean", "var", "aleatoric_var", "epistemic_var"}``, each float64 ``[N]``,
        in the original units of y; classification: probabilities ``[N, K]``
        (``torch.load(path, weights_only=True)`` reads either). Beside it, ``predictions.csv``
        and ``predictions.parquet`` hold one row per example: first the data module's id
        columns (``CSVDataModule(id_columns=[...])``), then for regression ``mean, std,
        lower_95, upper_95`` (the central 95 % interval of the Gaussian predictive),
        ``aleatoric_std, epistemic_std``; for classification ``prob_<label>`` per class (named
        by the data's class labels), ``predicted_class`` (the label as written) and ``entropy``
        (nats). Under DDP the processes' shares are merged into one set of files, in dataset
        order (:class:`~lightning_dvi.lightning.predictions.PredictionWriter`).
        """
        self._require_last_checkpoint(kwargs)
        writer = PredictionWriter()
        callbacks: list[Any] = self.trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, not declared on Trainer
        callbacks.append(writer)
        try:
            self.trainer.predict(**kwargs)
        finally:
            callbacks.remove(writer)
        # Every process reads log_dir (a collective under DDP); rank 0 wrote the files, or a
        # spawned process did (ddp_spawn), which leaves this process's writer empty.
        log_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        written = [
            writer.paths.get(kind, log_dir / f"predictions.{kind}") for kind in writer.formats
        ]
        self._predictions_paths = [path for path in written if path.is_file()]

    # ------------------------------------------------------------------ after subcommands
    def after_fit(self) -> None:
        """Optionally test the final weights, then print where the results are."""
        config = self.config.get(self.subcommand, self.config)
        if config.get("test_after_fit") and not self.trainer.interrupted:
            self.trainer.test(self.model, datamodule=self.datamodule)
        self._summary()

    def after_validate(self) -> None:
        """Print the validation metrics and where the logs are."""
        self._summary()

    def after_test(self) -> None:
        """Print the test metrics and where the logs are."""
        self._summary()

    def after_predict(self) -> None:
        """Print where the predictions are."""
        self._summary()

    def _summary(self) -> None:
        trainer = self.trainer
        # log_dir broadcasts from rank zero, so every process reads it before ranks diverge.
        log_dir = Path(trainer.log_dir) if trainer.log_dir else None
        if not trainer.is_global_zero:
            return
        elapsed = time.perf_counter() - getattr(self, "_start", time.perf_counter())
        lines = [f"\nlightning-dvi {self.subcommand} finished in {elapsed:.1f} s"]
        data = describe_data(self.datamodule)
        lines += [f"data:        {data}"] if data else []
        metrics = {
            k: float(v)
            for k, v in sorted(trainer.callback_metrics.items())
            if k.startswith(("val/", "test/")) and v.numel() == 1
        }
        if metrics:
            lines.append(self._metrics_heading())
            lines += [f"  {k:<28s} {v:.4f}" for k, v in metrics.items()]
        lines += self._references(metrics)
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                lines.append(f"metrics csv: {Path(logger.log_dir) / 'metrics.csv'}")
        if log_dir is not None:
            for png in sorted(log_dir.glob("*.png")):
                lines.append(f"plot:        {png}")
        for path in getattr(self, "_predictions_paths", []):  # every file predict wrote
            lines.append(f"predictions: {path}")
        resumed = getattr(self, "_resumed", None)
        if resumed is not None and self.subcommand == "fit":
            lines.append(f"resumed:     {resumed[0]} (epoch {resumed[1]}, step {resumed[2]})")
        callbacks = getattr(trainer, "callbacks", [])  # set by Lightning, not declared on Trainer
        for callback in callbacks if self.subcommand == "fit" else []:
            if isinstance(callback, ModelCheckpoint) and callback.last_model_path:
                lines.append(f"checkpoint:  {callback.last_model_path}")
        print("\n".join(lines), flush=True)

    def _metrics_heading(self) -> str:
        """The summary's metrics heading: what the task's numbers are measured in."""
        model = getattr(self, "model", None)
        if isinstance(model, DVIRegressor):
            return "metrics (regression: original units of y):"
        if isinstance(model, DVIClassifier):
            return (
                f"metrics (classification, {model.num_classes} classes: nll in nats per "
                "example, acc and ece as fractions):"
            )
        return "metrics:"

    def _references(self, metrics: Mapping[str, float]) -> list[str]:
        # A data module may know reference values for its test metrics (the toy data: the true
        # noise model's NLL); it says so through a reference_metrics() hook, no type check here.
        hook = getattr(self.datamodule, "reference_metrics", None)
        if not callable(hook) or not any(k.startswith("test/") for k in metrics):
            return []
        return [f"  {name:<28s} {float(value):.4f}" for name, value in hook().items()]


def write_predictions_csv(
    predictions: dict[str, torch.Tensor] | torch.Tensor,
    path: Path,
    ids: Mapping[str, Sequence[Any]] | None = None,
    labels: Sequence[Any] | None = None,
) -> Path:
    """Write ``predict`` output as CSV, one row per example (see :meth:`DVILightningCLI.predict`).

    Args:
        predictions: the regressor's dict of ``[N]`` tensors, or the classifier's ``[N, K]``
            probabilities.
        path: the CSV file to write.
        ids: id columns to write first, each with ``N`` values.
        labels: the ``K`` class labels (default ``0..K-1``): they name the probability columns
            and fill ``predicted_class``.
    """
    return write_predictions(predictions, path, ids, labels)


def _get_path(value: Any, *keys: str) -> str | None:
    """``value[k1][k2]...`` through dicts and jsonargparse namespaces, or ``None``."""
    for key in keys:
        if value is None:
            return None
        value = value.get(key) if hasattr(value, "get") else getattr(value, key, None)
    return None if value is None else str(value)


def cli(args: ArgsType = None, **kwargs: Any) -> DVILightningCLI:
    """Build (and by default run) the CLI; returns it, with ``trainer``, ``model``, ``datamodule``.

    Args:
        args: command-line arguments (default ``sys.argv[1:]``), a list or a config dict.
        **kwargs: passed to :class:`DVILightningCLI` (e.g. ``run=False``).
    """
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return DVILightningCLI(
        model_class=DVIModule,
        datamodule_class=LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        **kwargs,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-dvi`` console script (see :func:`cli`).

    A DDP run's process group is destroyed before the interpreter exits. Lightning registers
    that clean-up for NCCL only; a gloo group (DDP on CPU) left to the interpreter's shutdown
    can abort the process ("terminate called without an active exception", exit code 134)
    after a successful run, when its worker threads are destroyed while still joinable.
    """
    try:
        cli(args)
    finally:
        _destroy_process_group()


def _destroy_process_group() -> None:
    """Destroy the default process group, if a DDP run created one (every rank calls this)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    main()
