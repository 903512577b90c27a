"""The heteroscedastic noise bound (issue 44, item 3): far-out predictive std and calibration.

Trains ``DVIRegressor`` on ``y = sin(3x) + 0.1 eps``, ``x`` in [-1, 1] (the issue's models), and on
the paper's toy data (``x`` in [-0.5, 0.5], noise ``0.45 (x + 0.5)^2``), then scores the same
fitted model with ``noise_bound="none"`` and ``"training_range"``: the predictive std at far-out
inputs, and test NLL and the coverage of the central 90% interval inside and outside the
training range. With ``--uci DIR``, also the UCI benchmark's default protocol on
boston, concrete, energy and wine (splits 0-4), each fitted model's test LL scored both ways.
Run::

    .venv/bin/python recipes/noise_bound.py [--epochs 300] [--seeds 0 1] [--uci ../shared/data/uci]

``--epochs 60 --hidden 32 --seeds 0 1 2`` takes about 7 CPU minutes. The figures are in
docs/lightning.md (noise bound section).
"""

from __future__ import annotations

import argparse
import math
import warnings

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor
from lightning_dvi.data.toy import make_toy_heteroscedastic, toy_mean, toy_noise_std
from lightning_dvi.likelihoods import NoiseBoundWarning

Z90 = 1.6448536269514722  # the 95% normal quantile: the central 90% interval


def sine_data(n: int, lo: float, hi: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` uniform on ``[lo, hi]``, ``y = sin(3x) + 0.1 eps``."""
    gen = torch.Generator().manual_seed(seed)
    x = lo + (hi - lo) * torch.rand(n, 1, generator=gen)
    return x, torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(n, generator=gen)


def toy_data(n: int, lo: float, hi: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's toy function and noise, with ``x`` uniform on ``[lo, hi]``."""
    gen = torch.Generator().manual_seed(seed)
    x = lo + (hi - lo) * torch.rand(n, 1, generator=gen)
    eps = torch.randn(n, generator=gen)
    return x, toy_mean(x[:, 0]) + toy_noise_std(x[:, 0]) * eps


def fit(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int, **kwargs: object) -> DVIRegressor:
    """A ``DVIRegressor`` fitted on ``(x, y)`` (full batch for L-BFGS, batches of 50 for Adam)."""
    lightning.seed_everything(seed, verbose=False)
    model = DVIRegressor(in_features=1, num_data=len(x), **kwargs)  # type: ignore[arg-type]
    lbfgs = kwargs.get("optimizer") == "lbfgs"
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x) if lbfgs else 50, shuffle=True)
    trainer = lightning.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return model.eval()


def predictive(
    model: DVIRegressor, x: torch.Tensor, bound: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.predictive(x)`` with the noise bound set to ``bound`` (warnings silenced)."""
    if hasattr(model.likelihood, "noise_bound"):
        model.likelihood.noise_bound = bound  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseBoundWarning)
        return model.predictive(x)


def scores(
    model: DVIRegressor, x: torch.Tensor, y: torch.Tensor, bound: str
) -> tuple[float, float]:
    """Mean test NLL (original units) and the coverage of the central 90% interval."""
    mean, var = predictive(model, x, bound)
    nll = -torch.distributions.Normal(mean, var.sqrt()).log_prob(y.double()).mean()
    inside = ((y.double() - mean).abs() <= Z90 * var.sqrt()).double().mean()
    return float(nll), float(inside)


def uci_rows(data_dir: str, splits: int = 5) -> None:
    """Test LL of the UCI default protocol's fitted model, scored with both settings."""
    from lightning_dvi_benchmarks import uci

    plain_score = uci.score
    scored: list[dict[str, float]] = []

    def both(model: DVIRegressor, x: torch.Tensor, y: torch.Tensor, mc: int) -> tuple[float, float]:
        found = {}
        for bound in ("none", "training_range"):
            model.likelihood.noise_bound = bound  # type: ignore[assignment]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NoiseBoundWarning)
                found[bound] = plain_score(model, x, y, mc)[0]
        scored.append(found)
        return plain_score(model, x, y, mc)

    uci.score = both  # run_job scores through this module attribute
    print("| data set | split | test LL, none | test LL, training_range |")
    print("|---|---|---|---|")
    try:
        for name in ("boston", "concrete", "energy", "wine"):
            for split in range(splits):
                job = uci.Job(data_dir, name, "dvi", split, 50, 0.0, None, uci.PRESETS["lbfgs"])
                uci.run_job(job)
                row = scored[-1]
                print(f"| {name} | {split} | {row['none']:.4f} | {row['training_range']:.4f} |")
    finally:
        uci.score = plain_score
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=None, help="default: the model's")
    parser.add_argument("--uci", default=None, help="UCI data directory (standard layout)")
    args = parser.parse_args()
    if args.uci is not None:
        uci_rows(args.uci)
    width = {} if args.hidden is None else {"hidden": args.hidden}
    far = torch.tensor([[0.0], [5.0], [10.0], [100.0]])
    models = {
        "DVIRegressor(lr=1e-2)": {"lr": 1e-2, **width},
        "hidden=[50], L-BFGS": {"hidden": [50], "optimizer": "lbfgs"},
        'likelihood="homoscedastic"': {"likelihood": "homoscedastic", "lr": 1e-2, **width},
    }
    print("| model | noise_bound | std at x = 0 | x = 5 | x = 10 | x = 100 |")
    print("|---|---|---|---|---|---|")
    x, y = sine_data(200, -1.0, 1.0, seed=0)
    fitted = {}
    for name, kwargs in models.items():
        epochs = args.epochs if kwargs.get("optimizer") != "lbfgs" else min(args.epochs, 60)
        fitted[name] = model = fit(x, y, epochs, seed=0, **kwargs)
        bounds = ("none", "training_range") if "homoscedastic" not in name else ("-",)
        for bound in bounds:
            std = predictive(model, far, bound)[1].sqrt().tolist()
            print(f"| `{name}` | {bound} | " + " | ".join(f"{s:.3g}" for s in std) + " |")

    print("\n| data | test inputs | noise_bound | NLL | 90% coverage |")
    print("|---|---|---|---|---|")
    cases = {
        "sin(3x), x in [-1, 1]": (
            lambda n, s: sine_data(n, -1.0, 1.0, s),
            {"inside [-1, 1]": (-1.0, 1.0), "[1, 2]": (1.0, 2.0), "[-2, -1]": (-2.0, -1.0)},
            sine_data,
        ),
        "paper toy, x in [-0.5, 0.5]": (
            lambda n, s: make_toy_heteroscedastic(n, seed=s),
            {"inside [-0.5, 0.5]": (-0.5, 0.5), "[0.5, 1]": (0.5, 1.0), "[-1, -0.5]": (-1.0, -0.5)},
            toy_data,
        ),
    }
    for data_name, (train, ranges, draw) in cases.items():
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for seed in args.seeds:
            xs, ys = train(500, seed)
            model = fit(xs, ys, args.epochs, seed=seed, lr=1e-2, **width)
            for where, (lo, hi) in ranges.items():
                xt, yt = draw(1000, lo, hi, 100 + seed)
                for bound in ("none", "training_range"):
                    results.setdefault((where, bound), []).append(scores(model, xt, yt, bound))
        for (where, bound), values in results.items():
            nll = sum(v[0] for v in values) / len(values)
            cover = sum(v[1] for v in values) / len(values)
            nll_text = f"{nll:.3f}" if math.isfinite(nll) else str(nll)
            print(f"| {data_name} | {where} | {bound} | {nll_text} | {cover:.3f} |")


if __name__ == "__main__":
    main()
