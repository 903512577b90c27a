"""Last-layer DVI on a trained ResNet-18 (digits as ``[1, 8, 8]`` images; issue 29, item 3).

Trains ``resnet18(small_input=True, in_channels=1, width=8)`` deterministically (Adam,
cross-entropy) on the ``DigitsDataModule`` split (images, global standardisation, val 0.1,
test 0.2, seed 0), then makes its last layer Bayesian with ``from_torch(model, last_layers=1)``
(frozen backbone; factorised and full-covariance heads) and trains the head with
``DVIClassifier(net=...)``. Prints test accuracy, NLL and ECE (15 bins) of each, and the CPU
seconds of each fit. The full comparison (temperature scaling, Laplace, last-2-layer, OOD) is
the digits ResNet benchmark's. Usage::

    python recipes/last_layer_digits.py [--epochs 30] [--head-epochs 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer, seed_everything

from lightning_dvi import DVIClassifier
from lightning_dvi.benchmarks.torch_resnet import resnet18
from lightning_dvi.data import DigitsDataModule
from lightning_dvi.metrics import ClassificationMetrics
from lightning_dvi.nn import from_torch


def _scores(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    metrics = ClassificationMetrics(10, n_bins=15)
    metrics.update(probs, y)
    values = {k: float(v) for k, v in metrics.compute().items()}
    return {k: values[k] for k in sorted(values) if k in ("acc", "nll", "ece")}


def _train_torch(model: torch.nn.Module, dm: DigitsDataModule, epochs: int) -> float:
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = time.process_time()
    model.train()
    for _ in range(epochs):
        for x, y in dm.train_dataloader():
            optimiser.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimiser.step()
    return time.process_time() - start


def main() -> None:
    """Train, convert, train the head, print the table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--head-epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    seed_everything(args.seed, verbose=False)
    dm = DigitsDataModule(images=True, standardize="global", seed=args.seed)
    dm.setup("fit")
    dm.setup("test")
    x_test, y_test = dm.test_dataloader().dataset.tensors  # type: ignore[attr-defined]
    model = resnet18(num_classes=10, in_channels=1, small_input=True, width=8)
    seconds = _train_torch(model, dm, args.epochs)
    model.eval()
    with torch.no_grad():
        rows = {"deterministic": {**_scores(model(x_test).softmax(-1), y_test), "cpu_s": seconds}}
    for name, options in (
        ("last_layer_dvi", {}),
        ("last_layer_dvi_full_cov", {"head_covariance": "full"}),
    ):
        seed_everything(args.seed, verbose=False)
        net = from_torch(model, last_layers=1, **options)
        clf = DVIClassifier(net=net, num_classes=10, mode="full", lr=1e-2)
        trainer = Trainer(
            max_epochs=args.head_epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        start = time.process_time()
        trainer.fit(clf, datamodule=dm)
        seconds = time.process_time() - start
        rows[name] = {**_scores(clf.eval().predictive(x_test), y_test), "cpu_s": seconds}
    print(f"{'':26s} {'accuracy':>9s} {'nll':>8s} {'ece':>8s} {'cpu_s':>7s}")
    for name, row in rows.items():
        print(
            f"{name:26s} {row['acc']:9.4f} {row['nll']:8.4f} {row['ece']:8.4f} {row['cpu_s']:7.1f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
