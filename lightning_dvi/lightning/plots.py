"""Plot callbacks writing PNGs into the run's log directory (``trainer.log_dir``).

Figures are drawn with matplotlib's object API on an Agg canvas, so no GUI backend is needed and
the global pyplot backend is left alone. Only rank zero draws; the data behind the calibration
plots were synced across processes by the module beforehand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from ..data import KnownTruth

__all__ = ["CalibrationPlot", "PredictiveBandPlot", "ReliabilityDiagram"]


class _Regressor(Protocol):
    """What :class:`PredictiveBandPlot` needs of the module (a ``DVIRegressor``)."""

    def predictive(self, x: Tensor) -> tuple[Tensor, Tensor]: ...


def _log_dir(trainer: Trainer) -> Path:
    # ``trainer.log_dir`` broadcasts from rank zero: every process must ask, not only rank zero.
    return Path(trainer.log_dir or trainer.default_root_dir)


def _save(fig: Figure, directory: Path, filename: str, dpi: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


class PredictiveBandPlot(Callback):
    r"""Predictive mean :math:`\pm 2` std over the training inputs, for 1-D regression.

    At the end of ``fit`` draws the training data, the predictive mean and the band
    :math:`\mu(x) \pm 2\sigma(x)` (epistemic plus aleatoric) on a grid spanning the training
    inputs, in the original units of ``x`` and ``y``; inside it, darker, the epistemic band
    :math:`\mu(x) \pm 2\sqrt{\operatorname{Var}[m]}` when the module has
    ``variance_decomposition`` (:meth:`DVIRegressor.variance_decomposition
    <lightning_dvi.DVIRegressor.variance_decomposition>`). For the toy data the true mean and
    :math:`\pm 2` true noise std are overlaid (dashed). Skipped, with a warning, when the inputs
    are not 1-D or there is no datamodule with a ``train_dataset``.

    Args:
        filename: PNG name inside ``trainer.log_dir``.
        num_grid: grid points.
        dpi: resolution.
    """

    def __init__(
        self, filename: str = "predictive_band.png", num_grid: int = 300, dpi: int = 120
    ) -> None:
        super().__init__()
        if num_grid < 2:
            raise ValueError(f"num_grid must be at least 2, got {num_grid}")
        self.filename = filename
        self.num_grid = num_grid
        self.dpi = dpi
        self.path: Path | None = None

    @torch.no_grad()
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Draw the band (rank zero only)."""
        directory = _log_dir(trainer)
        if not trainer.is_global_zero:
            return
        datamodule = getattr(trainer, "datamodule", None)
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is None or not hasattr(pl_module, "predictive"):
            rank_zero_warn(
                "PredictiveBandPlot needs a regression module and a datamodule with train_dataset"
            )
            return
        x, y = dataset.tensors[0], dataset.tensors[1]
        if x.dim() != 2 or x.shape[1] != 1:
            rank_zero_warn(f"PredictiveBandPlot needs 1-D inputs, got {tuple(x.shape[1:])}")
            return
        x_loc = float(getattr(datamodule, "x_loc", torch.zeros(1)).reshape(-1)[0])
        x_scale = float(getattr(datamodule, "x_scale", torch.ones(1)).reshape(-1)[0])
        lo, hi = float(x.min()), float(x.max())
        grid = torch.linspace(lo, hi, self.num_grid).unsqueeze(-1)
        was_training = pl_module.training
        pl_module.eval()
        try:
            inputs = grid.to(
                pl_module.device, cast(torch.dtype, pl_module.dtype)
            )  # never a str here
            mean, var = cast(_Regressor, pl_module).predictive(inputs)  # checked above
            split = getattr(pl_module, "variance_decomposition", None)
            epistemic = split(inputs)[1].cpu().double() if callable(split) else None
        finally:
            pl_module.train(was_training)
        mean, std = mean.cpu().double(), var.cpu().double().sqrt()
        to_original = getattr(pl_module, "targets_in_original_units", None)
        y = to_original(y) if callable(to_original) else y
        grid_x = grid[:, 0].double() * x_scale + x_loc

        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        ax.scatter(
            x[:, 0] * x_scale + x_loc,
            y,
            s=6,
            c="0.4",
            alpha=0.6,
            label="training data",
        )
        ax.fill_between(
            grid_x,
            mean - 2 * std,
            mean + 2 * std,
            color="C0",
            alpha=0.25,
            label=r"mean $\pm$ 2 std",
        )
        if epistemic is not None:
            band = 2 * epistemic.sqrt()
            ax.fill_between(
                grid_x,
                mean - band,
                mean + band,
                color="C1",
                alpha=0.35,
                label=r"epistemic: mean $\pm$ 2 $\sqrt{\mathrm{Var}[m]}$",
            )
        ax.plot(grid_x, mean, c="C0", lw=2, label="predictive mean")
        if isinstance(datamodule, KnownTruth):
            true_mean, noise = datamodule.true_mean_and_noise_std(grid_x)
            ax.plot(grid_x, true_mean, "k--", lw=1, label="true mean")
            ax.plot(grid_x, true_mean + 2 * noise, "k:", lw=1, label=r"true $\pm$ 2 noise std")
            ax.plot(grid_x, true_mean - 2 * noise, "k:", lw=1)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.set_title(f"{type(pl_module).__name__} ({getattr(pl_module, 'mode', '?')}) predictive")
        ax.legend(loc="upper left", fontsize=8)
        self.path = _save(fig, directory, self.filename, self.dpi)


class _CurvePlot(Callback):
    """Draws ``pl_module.calibration_curves[stage]`` after validation (end of fit) and test."""

    kind = ""

    def __init__(self, dpi: int = 120) -> None:
        super().__init__()
        self.dpi = dpi
        self.paths: dict[str, Path] = {}

    def _draw(self, fig: Figure, curve: dict[str, torch.Tensor], stage: str) -> None:
        raise NotImplementedError

    def _plot(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        directory = _log_dir(trainer)
        curves = getattr(pl_module, "calibration_curves", {})
        if not trainer.is_global_zero or stage not in curves:
            return
        fig = Figure(figsize=(4.5, 4.5))
        self._draw(fig, curves[stage], stage)
        self.paths[stage] = _save(fig, directory, f"{self.kind}_{stage}.png", self.dpi)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Plot the last validation epoch (rank zero only)."""
        self._plot(trainer, pl_module, "val")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Plot the test set (rank zero only)."""
        self._plot(trainer, pl_module, "test")


class CalibrationPlot(_CurvePlot):
    """Regression calibration curve: observed vs expected coverage of central intervals.

    Writes ``calibration_val.png`` at the end of ``fit`` and ``calibration_test.png`` after
    ``test``, from the synced :class:`~lightning_dvi.metrics.RegressionCalibrationError` grid.
    A calibrated predictive lies on the diagonal; below it is over-confident.
    """

    kind = "calibration"

    def _draw(self, fig: Figure, curve: dict[str, torch.Tensor], stage: str) -> None:
        expected, observed = curve["expected"].numpy(), curve["observed"].numpy()
        ax = fig.add_subplot()
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="ideal")
        ax.plot(expected, observed, c="C0", lw=2, label="model")
        ax.fill_between(expected, expected, observed, color="C0", alpha=0.2)
        mace = abs(observed - expected).mean()
        ax.set(xlabel="expected coverage", ylabel="observed coverage", xlim=(0, 1), ylim=(0, 1))
        ax.set_title(f"{stage} calibration (MACE {mace:.3f})")
        ax.legend(loc="upper left")


class ReliabilityDiagram(_CurvePlot):
    """Classification reliability diagram: accuracy vs confidence per confidence bin.

    Writes ``reliability_val.png`` at the end of ``fit`` and ``reliability_test.png`` after
    ``test``, from the synced confidences of the ECE metric. Bars below the diagonal are
    over-confident bins; the bottom panel shows how many points fall in each bin.
    """

    kind = "reliability"

    def _draw(self, fig: Figure, curve: dict[str, torch.Tensor], stage: str) -> None:
        edges = curve["bin_edges"].numpy()
        count, accuracy, confidence = (
            curve[k].numpy() for k in ("count", "accuracy", "confidence")
        )
        width = edges[1:] - edges[:-1]
        ax, ax_count = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="ideal")
        ax.bar(
            edges[:-1],
            accuracy,
            width=width,
            align="edge",
            color="C0",
            edgecolor="k",
            alpha=0.7,
            label="accuracy",
        )
        filled = count > 0
        ax.scatter(
            edges[:-1][filled] + width[filled] / 2,
            confidence[filled],
            c="C3",
            s=12,
            zorder=3,
            label="mean confidence",
        )
        ece = float((count * abs(accuracy - confidence)).sum() / max(count.sum(), 1))
        ax.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
        ax.set_title(f"{stage} reliability (ECE {ece:.3f})")
        ax.legend(loc="upper left", fontsize=8)
        ax_count.bar(edges[:-1], count, width=width, align="edge", color="0.5")
        ax_count.set(xlabel="confidence", ylabel="count")
