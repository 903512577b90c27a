"""``OODEvaluation``: out-of-distribution and selective-prediction metrics after a test run."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from ..metrics.ood import (
    AURC,
    OODAUPR,
    OODAUROC,
    class_probability_samples,
    mutual_information,
    predictive_entropy,
)

__all__ = ["OODEvaluation"]


class _Classifier(Protocol):
    """What :class:`OODEvaluation` needs of the module (a ``DVIClassifier``)."""

    def predict_proba(self, x: Tensor) -> Tensor: ...


class OODEvaluation(Callback):
    """Score test inputs against the datamodule's OOD inputs at the end of ``trainer.test``.

    Collects the test inputs of this process's batches, takes the matching share of
    ``trainer.datamodule.ood_inputs(kind, seed)`` (e.g.
    :meth:`~lightning_dvi.data.DigitsDataModule.ood_inputs`), and logs, synced across processes:

    * ``test/ood_auroc`` and ``test/ood_aupr``: the predictive entropy as OOD detector;
    * ``test/ood_auroc_mi`` and ``test/ood_aupr_mi``: the mutual information, from
      ``mi_samples`` logit draws of the DVI logit Gaussian (``full``/``diag``) or the
      network's weight samples (``sample``/``local``);
    * ``test/aurc``: the area under the risk-coverage curve of the test predictions.

    Args:
        kind: passed to ``ood_inputs`` (``"permuted"`` or ``"noise"`` for digits).
        seed: passed to ``ood_inputs``.
        mi_samples: logit draws for the mutual information of a Gaussian output.
    """

    def __init__(self, kind: str = "permuted", seed: int = 0, mi_samples: int = 64) -> None:
        if mi_samples < 2:
            raise ValueError(f"mi_samples must be at least 2, got {mi_samples}")
        self.kind = kind
        self.seed = seed
        self.mi_samples = mi_samples
        self._inputs: list[Tensor] = []
        self._targets: list[Tensor] = []

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start collecting this process's test inputs."""
        self._inputs, self._targets = [], []

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Keep the batch's inputs and labels."""
        self._inputs.append(batch[0].detach())
        self._targets.append(batch[1].detach())

    @torch.no_grad()
    def _scores(self, pl_module: LightningModule, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out = pl_module(x)
        probs = cast(_Classifier, pl_module).predict_proba(x)
        samples = class_probability_samples(out, self.mi_samples)
        return probs, predictive_entropy(probs), mutual_information(samples)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Compute and log the metrics (every process runs the sync)."""
        if not self._inputs:
            return
        datamodule = getattr(trainer, "datamodule", None)  # set by Lightning, not declared
        ood_inputs = getattr(datamodule, "ood_inputs", None)
        if ood_inputs is None:
            raise ValueError(
                "OODEvaluation needs a datamodule with an `ood_inputs(kind, seed)` method, "
                f"e.g. lightning_dvi.data.DigitsDataModule; got {type(datamodule).__name__}"
            )
        x_ood = ood_inputs(self.kind, self.seed)[trainer.global_rank :: trainer.world_size]
        x_in, y_in = torch.cat(self._inputs), torch.cat(self._targets)
        device = pl_module.device
        probs, ent_in, mi_in = self._scores(pl_module, x_in.to(device))
        _, ent_ood, mi_ood = self._scores(pl_module, x_ood.to(device))
        label = torch.cat([torch.zeros_like(ent_in), torch.ones_like(ent_ood)]).long()
        values: dict[str, Tensor] = {}
        for suffix, score in (
            ("", torch.cat([ent_in, ent_ood])),
            ("_mi", torch.cat([mi_in, mi_ood])),
        ):
            for name, cls in (("ood_auroc", OODAUROC), ("ood_aupr", OODAUPR)):
                metric = cls().to(device)
                metric.update(score.double(), label)
                values[f"test/{name}{suffix}"] = metric.compute()
        aurc = AURC().to(device)
        aurc.update(probs, y_in.long().to(device))
        values["test/aurc"] = aurc.compute()
        pl_module.log_dict({k: v.float() for k, v in values.items()}, sync_dist=True)
        self._inputs, self._targets = [], []
