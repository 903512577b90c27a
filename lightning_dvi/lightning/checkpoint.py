r"""Checkpoints that survive a killed run, live in the run's own directory, and load as data.

* :class:`RunCheckpoint` writes ``last.ckpt`` during training (every ``every_n_epochs`` epochs,
  every ``every_n_train_steps`` steps or every ``train_time_interval``), into the run's own
  versioned directory, whatever the installed Lightning version does with ``save_last``.
* :func:`find_last_checkpoint` finds the newest run's ``last.ckpt`` (what ``--ckpt_path last``
  resumes).
* :func:`read_checkpoint` and :func:`load_checkpoint_data` read a checkpoint with
  ``torch.load(..., weights_only=True)`` and strip the keys through which Lightning would
  import and call names chosen by the file, so that
  :meth:`~lightning_dvi.lightning._base.DVIModule.load_from_checkpoint` never runs code.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
import yaml
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from ..likelihoods.config import check_likelihood_config
from ..nn.torch_file import load_weights_only
from ..priors.config import check_prior_config
from ._network import check_net_config

__all__ = [
    "RunCheckpoint",
    "checkpoint_candidates",
    "find_last_checkpoint",
    "load_checkpoint_data",
    "read_checkpoint",
    "vet_hyperparameters",
]

# Keys of a LightningCLI checkpoint's hyper-parameters that make Lightning import and call names
# from the file (``_instantiator``) or choose the class to build (``_class_path``).
_CALLING_KEYS = ("_instantiator", "_class_path")


class RunCheckpoint(ModelCheckpoint):
    """Write ``last.ckpt`` during training into this run's own directory, so a killed run resumes.

    Lightning's ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` every
    epoch on some Lightning versions and only when training ends on others (2.6); this callback
    writes it on its own schedule on every version, atomically (Lightning writes to a temporary
    file and renames it), so a run killed at any moment leaves the last complete checkpoint.
    ``trainer.fit(ckpt_path=...)`` (or ``lightning-dvi fit --ckpt_path last``) then continues
    it exactly: weights, optimiser, step counter (hence the KL schedule), callback state (the
    empirical-Bayes schedule) and the data order are all restored.

    **One directory per run.** With a logger, the checkpoint goes to the logger's versioned
    directory, ``<save_dir>/<name>/version_N/checkpoints/last.ckpt``, beside that run's
    ``metrics.csv`` and plots; without one, to ``<default_root_dir>/checkpoints/version_N/``.
    With an explicit ``dirpath``, a file that already exists there when the run starts is never
    overwritten: the run writes ``last-v1.ckpt`` (``-v2``, ...) instead. A resumed run is a new
    run: it writes into its own new directory and leaves the checkpoint it resumed from as it
    was.

    The triggers can be combined; a checkpoint is written when any of them fires, and once more
    when training ends if the last step was not saved yet.

    Args:
        every_n_epochs: write at the end of every ``n``-th training epoch (``0``: never).
        every_n_train_steps: write after every ``n``-th optimisation step (``0``: never).
        train_time_interval: write after the first optimisation step at least this long after
            the previous write (a ``datetime.timedelta``, or seconds; ``None``: never).
        dirpath: the directory; ``None`` (default) picks the run's own directory (above).

    Examples:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[RunCheckpoint(every_n_epochs=5)])  # doctest: +SKIP
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        every_n_train_steps: int = 0,
        train_time_interval: timedelta | float | None = None,
        dirpath: str | None = None,
    ) -> None:
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0)
        for name, value in (
            ("every_n_epochs", every_n_epochs),
            ("every_n_train_steps", every_n_train_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RunCheckpoint: {name} must be an int >= 0, got {value!r}")
        if isinstance(train_time_interval, (int, float)):
            train_time_interval = timedelta(seconds=float(train_time_interval))
        if train_time_interval is not None and train_time_interval.total_seconds() <= 0:
            raise ValueError(
                f"RunCheckpoint: train_time_interval must be positive, got {train_time_interval}"
            )
        self.epoch_interval = every_n_epochs
        self.step_interval = every_n_train_steps
        self.time_interval = train_time_interval
        self._explicit_dirpath = dirpath is not None
        self.resumed_from: str | None = None  # the checkpoint this run resumed from, if any
        self._saved_step: int | None = None
        self._last_write = time.monotonic()
        self.filename_last = "last.ckpt"

    @property
    def state_key(self) -> str:
        """One key whatever the schedule, so a resumed run may change it."""
        return self._generate_state_key()

    # ------------------------------------------------------------------ where
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Pick this run's directory and file name (rank zero decides, every rank agrees)."""
        if self.dirpath is None and not trainer.loggers:
            root = Path(trainer.default_root_dir) / "checkpoints"
            self.dirpath = str(root / f"version_{_next_version(root)}")
            self.dirpath = trainer.strategy.broadcast(self.dirpath)
        super().setup(trainer, pl_module, stage)
        name = "last.ckpt"
        if self._explicit_dirpath:
            version = 0
            while Path(str(self.dirpath), name).exists():
                version += 1
                name = f"last-v{version}.ckpt"
        self.filename_last = trainer.strategy.broadcast(name)
        self._last_write = time.monotonic()

    # ------------------------------------------------------------------ when
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Write after every ``every_n_train_steps`` steps or ``train_time_interval``."""
        if self._skip(trainer):
            return
        due = bool(self.step_interval) and trainer.global_step % self.step_interval == 0
        if self.time_interval is not None:
            elapsed = time.monotonic() - self._last_write
            # every rank must take the same decision (the save is collective)
            late = bool(trainer.strategy.broadcast(elapsed >= self.time_interval.total_seconds()))
            due = due or late
        if due:
            self._write(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write at the end of every ``every_n_epochs``-th epoch."""
        if self._skip(trainer) or not self.epoch_interval:
            return
        if (trainer.current_epoch + 1) % self.epoch_interval == 0:
            self._write(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Nothing: writes follow the training schedule only."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write the final state if the last step was not written yet."""
        if not self._skip(trainer):
            self._write(trainer)

    def _skip(self, trainer: Trainer) -> bool:
        from lightning.pytorch.trainer.states import TrainerFn

        return (
            bool(getattr(trainer, "fast_dev_run", False))  # set by Trainer, not declared
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
            or self._saved_step == trainer.global_step
        )

    def _write(self, trainer: Trainer) -> None:
        path = os.path.join(str(self.dirpath), self.filename_last)
        self.last_model_path = path  # before saving: it is part of the saved state
        trainer.save_checkpoint(path, weights_only=False)  # the whole state, to resume
        self._saved_step = trainer.global_step
        self._last_write = time.monotonic()
        # keep the base class's bookkeeping consistent for code that reads it
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = path

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remember which file the run resumed from; nothing else carries over (a new run)."""
        self.resumed_from = state_dict.get("last_model_path")


def _next_version(root: Path) -> int:
    versions = [
        int(p.name.removeprefix("version_"))
        for p in root.glob("version_*")
        if p.name.removeprefix("version_").isdigit()
    ]
    return max(versions, default=-1) + 1


# ---------------------------------------------------------------------- finding the last run
def checkpoint_candidates(trainer: Trainer) -> list[Path]:
    """Every ``last*.ckpt`` that the trainer's checkpoint callbacks write or wrote in other runs.

    For a callback with an explicit ``dirpath``: that directory. Otherwise every run directory
    of the first logger (``<save_dir>/<name>/*/checkpoints``) or, without a logger,
    ``<default_root_dir>/checkpoints`` and its ``version_N`` subdirectories.
    """
    directories: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        explicit = getattr(callback, "_explicit_dirpath", callback.dirpath is not None)
        if explicit and callback.dirpath is not None:
            directories.append(Path(str(callback.dirpath)))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(str(logger.save_dir or trainer.default_root_dir), str(logger.name or ""))
            directories += [p / "checkpoints" for p in root.glob("*") if p.is_dir()]
        else:
            root = Path(trainer.default_root_dir) / "checkpoints"
            directories += [root, *(p for p in root.glob("version_*") if p.is_dir())]
    found = {
        path.resolve()
        for directory in directories
        for path in directory.glob("last*.ckpt")
        if path.is_file()
    }
    return sorted(found)


def find_last_checkpoint(trainer: Trainer) -> Path | None:
    """The newest ``last*.ckpt`` among :func:`checkpoint_candidates` (latest written), or ``None``."""
    candidates = checkpoint_candidates(trainer)
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, str(p)))


# ---------------------------------------------------------------------- loading as data
def read_checkpoint(path: str | Path | IO[bytes], map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint file's contents, read with ``torch.load(..., weights_only=True)``.

    Raises:
        ValueError: naming the file, when it holds pickled objects other than tensors and plain
            containers (loading those could run code) or is not a checkpoint.
    """
    what, advice = f"checkpoint {path}", "Build the module in code and load a state_dict you trust."
    if isinstance(path, (str, Path)) and "://" in str(path):  # a URL, as Lightning accepts
        with get_filesystem(str(path)).open(str(path), "rb") as handle:
            data = load_weights_only(handle, what, advice, map_location)
    else:
        data = load_weights_only(path, what, advice, map_location)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a Lightning checkpoint (got {type(data).__name__})")
    return data


def vet_hyperparameters(
    hparams: Mapping[str, Any],
    base: type[LightningModule],
    where: str,
    trusted_net_paths: tuple[str, ...] = (),
) -> type[LightningModule] | None:
    """Check a checkpoint's hyper-parameters before anything is built from them.

    ``_class_path`` (LightningCLI's record of the model class) must name ``base`` or an
    **already imported** subclass of it (looked up, never imported); the ``net`` configuration
    must pass the network allow-list (:func:`~lightning_dvi.lightning._network.instantiate_net`),
    unless its class path is one of ``trusted_net_paths`` (named by the user's own config); a
    ``likelihood`` configuration must name an allowed likelihood class
    (:func:`~lightning_dvi.likelihoods.register_likelihood`).

    Returns:
        The model class ``_class_path`` names, or ``None`` when there is none.

    Raises:
        ValueError: naming the refused class path.
    """
    model_class = None
    class_path = hparams.get("_class_path")
    if class_path is not None:
        model_class = _imported_subclass(str(class_path), base)
        if model_class is None:
            raise ValueError(
                f"refusing {where}: it names the model class {class_path!r}, which is not an "
                f"imported subclass of {base.__name__}; a checkpoint is data, so the class to "
                f"build is never imported from it. Load it with that class, e.g. "
                f"{class_path.rpartition('.')[2]}.load_from_checkpoint(path)"
            )
    net = hparams.get("net")
    if not (isinstance(net, Mapping) and str(net.get("class_path")) in trusted_net_paths):
        check_net_config(net, f"the net hyper-parameter of {where}")
    check_likelihood_config(hparams.get("likelihood"), f"the likelihood hyper-parameter of {where}")
    check_prior_config(hparams.get("prior"), f"the prior hyper-parameter of {where}")
    return model_class


def _imported_subclass(class_path: str, base: type) -> type[LightningModule] | None:
    """``base`` or the subclass of it named ``class_path``, among classes already defined."""
    pending: list[type] = [base]
    while pending:
        cls = pending.pop()
        names = {f"{cls.__module__}.{cls.__qualname__}"}
        if cls.__module__.startswith("lightning_dvi."):
            names.add(f"lightning_dvi.{cls.__qualname__}")
        if class_path in names:
            return cls
        pending += cls.__subclasses__()
    return None


def _saved_device_if_available(storage: Any, location: str) -> Any:
    """Keep a tensor on the device it was saved from, or move it to the CPU if that is absent.

    What Lightning's loader does by default, so a CUDA checkpoint loads onto the GPU when there
    is one; ``None`` tells ``torch.load`` to keep the saved location.
    """
    absent = (location.startswith("cuda") and not torch.cuda.is_available()) or (
        location.startswith("mps") and not torch.backends.mps.is_available()
    )
    return storage.cpu() if absent else None


def load_checkpoint_data(
    cls: type[LightningModule],
    checkpoint_path: str | Path | IO[bytes],
    map_location: Any = None,
    hparams_file: str | Path | None = None,
    overridden: tuple[str, ...] = (),
) -> tuple[type[LightningModule], io.BytesIO]:
    """A checkpoint read as data and vetted, re-serialised for Lightning's loader.

    Reads the file with ``weights_only=True`` (and ``hparams_file`` with ``yaml.safe_load``),
    checks the hyper-parameters with :func:`vet_hyperparameters` (but not those in
    ``overridden``, which the caller replaces, e.g. ``net`` given in code), and drops
    ``_instantiator`` and ``_class_path``, so Lightning builds the module by calling the
    class's constructor with the saved arguments instead of an instantiator named by the file.

    Returns:
        The class to build (``cls`` or the imported subclass the checkpoint names) and the
        sanitised checkpoint as an in-memory file.
    """
    checkpoint = read_checkpoint(checkpoint_path, map_location or _saved_device_if_available)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if hparams_file is not None:
        if Path(hparams_file).suffix.lower() not in (".yaml", ".yml"):
            raise ValueError(f"hparams_file must be a .yaml file, got {hparams_file}")
        hparams = dict(yaml.safe_load(Path(hparams_file).read_text()) or {})
    for key in overridden:
        hparams.pop(key, None)
    target = vet_hyperparameters(hparams, cls, f"checkpoint {checkpoint_path}") or cls
    for key in _CALLING_KEYS:
        hparams.pop(key, None)
    checkpoint["hyper_parameters"] = hparams
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return target, buffer
