"""Calibration study of ``DVIClassifier`` on scikit-learn digits (issue 13, item 1).

Trains a 64-64-10 DVI MLP (``mode="full"``) on the ``DigitsDataModule`` split (val_fraction 0.1,
test_fraction 0.2, seed 0) under named settings and prints validation and test accuracy, NLL
and ECE (15 bins), the median logit variance on the test rows, and, separately, the test
numbers after post-hoc temperature scaling fitted on the validation rows
(:func:`lightning_dvi.lightning.temperature.fit_temperature`). Settings are picked on the
validation columns only. Usage::

    python recipes/digits_calibration.py                       # every setting below
    python recipes/digits_calibration.py --only clark_kl0.03   # some of them
    python recipes/digits_calibration.py --list
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_dvi import DVIClassifier
from lightning_dvi.data import DigitsDataModule
from lightning_dvi.lightning.temperature import fit_temperature, temper_probs
from lightning_dvi.metrics import ClassificationMetrics

# the study's model (issue 13): full mode, the empirical-Bayes prior and the untempered ELBO,
# pinned because DVIClassifier's defaults have changed since
_BASE: dict[str, Any] = {
    "hidden": [64], "lr": 3e-3, "mode": "full", "prior": "empirical_bayes", "kl_weight": 1.0,
}  # fmt: skip
#: name -> (DVIClassifier keyword arguments on top of the base, epochs)
SETTINGS: dict[str, tuple[dict[str, Any], int]] = {
    "delta_kl1_50ep": ({"likelihood_method": "delta"}, 50),
    "delta_kl1_150ep": ({"likelihood_method": "delta"}, 150),
    "delta_kl0.1_150ep": ({"likelihood_method": "delta", "kl_weight": 0.1}, 150),
    "delta_kl0.03_150ep": ({"likelihood_method": "delta", "kl_weight": 0.03}, 150),
    "delta_gauss1_50ep": (
        {"likelihood_method": "delta", "prior": "gaussian", "prior_variance": 1.0},
        50,
    ),
    "delta_gauss1_150ep": (
        {"likelihood_method": "delta", "prior": "gaussian", "prior_variance": 1.0},
        150,
    ),
    "mc_kl0.1_150ep": ({"likelihood_method": "mc", "kl_weight": 0.1}, 150),
    "clark_kl1_50ep": ({"likelihood_method": "clark"}, 50),
    "clark_kl1_150ep": ({"likelihood_method": "clark"}, 150),
    "clark_kl1_cosine_150ep": (
        {"likelihood_method": "clark", "lr_schedule": "cosine", "min_lr": 3e-5},
        150,
    ),
    "clark_kl1_warmup_150ep": ({"likelihood_method": "clark", "kl_warmup_steps": 1050}, 150),
    "clark_kl1_init0.1_150ep": ({"likelihood_method": "clark", "init_scale": 0.1}, 150),
    "clark_kl1_beta1000_150ep": ({"likelihood_method": "clark", "prior_beta": 1000.0}, 150),
    "clark_kl1_beta1000_init0.1_150ep": (
        {"likelihood_method": "clark", "prior_beta": 1000.0, "init_scale": 0.1},
        150,
    ),
    "clark_kl0.1_beta1000_150ep": (
        {"likelihood_method": "clark", "prior_beta": 1000.0, "kl_weight": 0.1},
        150,
    ),
    "clark_kl0.03_beta1000_150ep": (
        {"likelihood_method": "clark", "prior_beta": 1000.0, "kl_weight": 0.03},
        150,
    ),
    "clark_gauss1_150ep": (
        {"likelihood_method": "clark", "prior": "gaussian", "prior_variance": 1.0},
        150,
    ),
    "clark_kl0.3_150ep": ({"likelihood_method": "clark", "kl_weight": 0.3}, 150),
    "clark_kl0.1_150ep": ({"likelihood_method": "clark", "kl_weight": 0.1}, 150),
    "clark_kl0.03_150ep": ({"likelihood_method": "clark", "kl_weight": 0.03}, 150),
    "clark_kl0.01_150ep": ({"likelihood_method": "clark", "kl_weight": 0.01}, 150),
}


def _metrics(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    m = ClassificationMetrics(10, prefix="", n_bins=15)
    m.update(probs, y)
    return {k: round(float(v), 4) for k, v in m.compute().items()}


def _predict(model: DVIClassifier, loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    probs, target = [], []
    with torch.no_grad():
        for x, y in loader:
            probs.append(model.predictive(x))
            target.append(y)
    return torch.cat(probs), torch.cat(target)


def run(name: str, seed: int = 0) -> dict[str, Any]:
    """Train one setting and return its validation/test numbers."""
    kwargs, epochs = SETTINGS[name]
    seed_everything(seed, workers=True, verbose=False)
    dm = DigitsDataModule(batch_size=128, val_fraction=0.1, test_fraction=0.2, seed=0)
    model = DVIClassifier(in_features=64, num_classes=10, **{**_BASE, **kwargs})
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(model, dm)
    seconds = time.perf_counter() - start
    dm.setup("test")
    pv, yv = _predict(model, dm.val_dataloader())
    pt, yt = _predict(model, dm.test_dataloader())
    t = fit_temperature(pv, yv)
    with torch.no_grad():
        out = model(dm.test_dataloader().dataset.tensors[0])
    return {
        "name": name,
        "epochs": epochs,
        "train_s": round(seconds, 1),
        "val": _metrics(pv, yv),
        "test": _metrics(pt, yt),
        "logit_var_median": round(float(out.var.median()), 3),
        "temperature": round(t, 3),
        "test_temperature_scaled": _metrics(temper_probs(pt, t), yt),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the chosen settings and print one JSON line each, then a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="setting names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="list the settings and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(SETTINGS))
        return
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = [run(name, args.seed) for name in (args.only or SETTINGS)]
    for row in rows:
        print(json.dumps(row))
    print(
        "\n| setting | val NLL | test acc | test NLL | test ECE | logit var (median) | T | "
        "test NLL / ECE after T |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        v, t, s = r["val"], r["test"], r["test_temperature_scaled"]
        print(
            f"| {r['name']} | {v['nll']:.3f} | {t['acc']:.3f} | {t['nll']:.3f} | {t['ece']:.3f} "
            f"| {r['logit_var_median']:.2f} | {r['temperature']:.2f} | {s['nll']:.3f} / "
            f"{s['ece']:.3f} |"
        )


if __name__ == "__main__":
    main()
