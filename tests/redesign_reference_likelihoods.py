"""Fixed-seed reference of the front ends' likelihood paths (issue 40, item 3).

Run before and after a change that must not alter behaviour:

    python tests/redesign_reference_likelihoods.py capture /tmp/ref_lik.pt
    python tests/redesign_reference_likelihoods.py compare /tmp/ref_lik.pt

``capture`` records, in float64 at fixed seeds and one torch thread, for each regression
likelihood (heteroscedastic with and without the training-range noise bound, homoscedastic with
a target resolution, Poisson) and each classification likelihood (categorical, Bernoulli): a
2-epoch Adam fit (weights, losses, logged metrics, the warnings it raised), the predictive
(closed form and Monte Carlo), the predictive log-density, the variance decomposition, the
exported predictive and the hyper-parameters. ``compare`` recomputes everything and reports each
entry that is not bit-identical, with the comparison of
``tests/redesign_reference_supervision.py``. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.nn import export_predictive

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from redesign_reference_supervision import _trainer, main

F64 = torch.float64

REGRESSORS: dict[str, dict[str, Any]] = {
    "heteroscedastic": {},
    "heteroscedastic/bounded": {"noise_bound": "training_range"},
    "homoscedastic/resolution": {"likelihood": "homoscedastic", "target_resolution": "auto"},
    "homoscedastic/sample": {"likelihood": "homoscedastic", "mode": "sample", "num_samples": 4},
    "poisson": {"likelihood": "poisson", "standardize_targets": False},
}
CLASSIFIERS: dict[str, dict[str, Any]] = {
    "categorical": {},
    "bernoulli": {"likelihood": "bernoulli"},
}


def _data(kind: str, n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, 3, generator=gen, dtype=F64)
    z = x[:, 0] - 0.5 * x[:, 1] ** 2
    if kind == "poisson":
        return x, torch.poisson(z.clamp(-2, 2).exp(), generator=gen).to(F64)
    if kind == "bernoulli":
        return x, (z > 0).long()
    if kind == "categorical":
        return x, (z * 1.5).floor().clamp(-1, 1).long() + 1
    return x, ((z + 0.1 * torch.randn(n, generator=gen, dtype=F64)) * 2).round() / 2


def _fit(model: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    trainer = _trainer(max_epochs=2, precision="64-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    ours = sorted({str(w.message) for w in caught if "lightning_dvi" in str(w.filename)})
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
        "warnings": ours,
        "hparams": {k: repr(v) for k, v in model.hparams.items()},
    }


def capture() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, kwargs in REGRESSORS.items():
        kind = "poisson" if "poisson" in name else "regression"
        x, y = _data(kind)
        torch.manual_seed(0)
        model = DVIRegressor(in_features=3, hidden=[8], lr=0.01, **kwargs)
        entry = _fit(model, x, y)
        torch.manual_seed(1)
        entry["predictive"] = model.predictive(x)
        entry["predictive/mc"] = model.predictive(x, "mc", 5)
        entry["log_prob"] = model.predictive_log_prob(x, y)
        entry["log_prob/mc"] = model.predictive_log_prob(x, y, "mc", 5)
        entry["split"] = model.variance_decomposition(x)
        entry["export"] = export_predictive(model.double(), mode="diag")(x)
        out[f"regressor/{name}"] = entry
    for name, kwargs in CLASSIFIERS.items():
        x, y = _data(name)
        torch.manual_seed(0)
        model = DVIClassifier(in_features=3, hidden=[8], **kwargs)
        entry = _fit(model, x, y)
        torch.manual_seed(1)
        entry["predictive"] = model.predictive(x)
        entry["export"] = export_predictive(model.double(), mode="diag")(x)
        out[f"classifier/{name}"] = entry
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv, capture, __doc__ or ""))
