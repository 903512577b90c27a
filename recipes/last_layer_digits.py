"""Last-layer DVI on a trained ResNet-18 (digits as ``[1, 8, 8]`` images; issue 29, item 3).

Trains ``resnet18(small_input=True, in_channels=1, width=8)`` deterministically (Adam, lr 3e-3,
cross-entropy, batch 128) on the ``DigitsDataModule`` split (images, global standardisation,
val 0.1, test 0.2, seed 0); after each of ``--epochs`` (e.g. ``10,30``) it makes the last layer
Bayesian with ``from_torch(model, last_layers=1, scale_fraction=...)`` (frozen backbone) and
trains the head with ``DVIClassifier(net=..., mode="full", lr=1e-2)`` under the settings below,
``--head-epochs`` epochs each. Prints validation and test accuracy, NLL and ECE (15 bins) of the
deterministic net and of each head, and the CPU seconds of each head fit.

``--cached-features`` trains the head on the backbone's features computed once
(``DVIClassifier(net=net.head)`` on ``net.features(x)``): the same inputs the head sees inside
``LastLayerNetwork`` (a frozen backbone in eval mode is a fixed function), without running the
backbone every step. The full comparison (temperature scaling, Laplace, last-2-layer, OOD) is
the digits ResNet benchmark's. Usage::

    python recipes/last_layer_digits.py [--epochs 10,30] [--head-epochs 60] [--cached-features]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier
from lightning_dvi.data import DigitsDataModule
from lightning_dvi.metrics import ClassificationMetrics
from lightning_dvi.nn import from_torch
from lightning_dvi_benchmarks.torch_resnet import resnet18

#: name -> (from_torch keyword arguments, DVIClassifier keyword arguments)
SETTINGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "defaults_sf0.1": ({"scale_fraction": 0.1}, {}),
    "defaults_sf1": ({"scale_fraction": 1.0}, {}),
    "gauss1_kl1_sf0.1": ({"scale_fraction": 0.1}, {"kl_weight": 1.0, "prior_variance": 1.0}),
    "gauss1_kl1_sf1": ({"scale_fraction": 1.0}, {"kl_weight": 1.0, "prior_variance": 1.0}),
    "eb_kl1_sf1": ({"scale_fraction": 1.0}, {"kl_weight": 1.0, "prior": "empirical_bayes"}),
    "eb_kl1_sf1_fullcov": (
        {"scale_fraction": 1.0, "head_covariance": "full"},
        {"kl_weight": 1.0, "prior": "empirical_bayes"},
    ),
}


def _scores(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    metrics = ClassificationMetrics(10, n_bins=15)
    metrics.update(probs, y)
    values = {k: float(v) for k, v in metrics.compute().items()}
    return {k: round(values[k], 4) for k in ("acc", "nll", "ece")}


def _train_torch(model: torch.nn.Module, dm: DigitsDataModule, epochs: int) -> None:
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        for x, y in dm.train_dataloader():
            optimiser.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimiser.step()
    model.eval()


def _fit_head(
    model: torch.nn.Module,
    dm: DigitsDataModule,
    setting: tuple[dict[str, Any], dict[str, Any]],
    epochs: int,
    cached: bool,
) -> tuple[DVIClassifier, Any, float]:
    convert, options = setting
    net = from_torch(model, last_layers=1, **convert)
    trainer = Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    start = time.process_time()
    if cached:
        x, y = dm.train_dataloader().dataset.tensors
        with torch.no_grad():
            features = net.features(x)
        loader = DataLoader(TensorDataset(features, y), batch_size=128, shuffle=True)
        clf = DVIClassifier(
            net=net.head, num_classes=10, mode="full", lr=1e-2, num_data=len(y), **options
        )
        trainer.fit(clf, loader)
        inputs = net.features
    else:
        clf = DVIClassifier(net=net, num_classes=10, mode="full", lr=1e-2, **options)
        trainer.fit(clf, datamodule=dm)
        inputs = None
    return clf.eval(), inputs, time.process_time() - start


def main() -> None:
    """Train, convert, train the heads, print one JSON line per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", default="10,30", help="deterministic epochs to evaluate at")
    parser.add_argument("--head-epochs", type=int, default=60)
    parser.add_argument("--cached-features", action="store_true")
    parser.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*in eval mode at the start of training.*")
    seed_everything(args.seed, verbose=False)
    dm = DigitsDataModule(images=True, standardize="global", seed=args.seed)
    dm.setup("fit")
    dm.setup("test")
    splits = {
        "val": dm.val_dataloader().dataset.tensors,
        "test": dm.test_dataloader().dataset.tensors,
    }
    model = resnet18(num_classes=10, in_channels=1, small_input=True, width=8)
    done = 0
    for target in (int(e) for e in args.epochs.split(",")):
        _train_torch(model, dm, target - done)
        done = target
        with torch.no_grad():
            row = {s: _scores(model(x).softmax(-1), y) for s, (x, y) in splits.items()}
        print(json.dumps({"epochs": target, "model": "deterministic", **row}), flush=True)
        for name in args.only:
            seed_everything(args.seed, verbose=False)
            clf, inputs, seconds = _fit_head(
                model, dm, SETTINGS[name], args.head_epochs, args.cached_features
            )
            with torch.no_grad():
                row = {
                    s: _scores(clf.predictive(x if inputs is None else inputs(x)), y)
                    for s, (x, y) in splits.items()
                }
            record = {"epochs": target, "model": name, **row, "head_cpu_s": round(seconds, 1)}
            print(json.dumps(record), flush=True)
        model.train()


if __name__ == "__main__":
    main()
