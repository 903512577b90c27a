"""A likelihood defined here, outside the package, through every front-end path (issue 40 item 3).

``LaplaceMean`` is :math:`y\\sim\\operatorname{Laplace}(f, b)` with a fixed scale ``b``: not in the
library, so training, the predictive, the KL, export and a checkpoint reload all have to go
through the :class:`~lightning_dvi.likelihoods.Likelihood` interface alone. Its closed-form
expected log-likelihood is checked against the base class's Monte Carlo estimate.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor, Gaussian
from lightning_dvi.likelihoods import (
    ExportOptions,
    Likelihood,
    PredictiveHead,
    RegressionHead,
    register_likelihood,
)
from lightning_dvi.nn import export_predictive


class _LaplaceHead(RegressionHead):
    name = "laplace"

    def __init__(self, options: ExportOptions, scale: float) -> None:
        super().__init__(options)
        self.noise = 2.0 * scale * scale

    def standardized(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        return out.mean[..., 0], out.var[..., 0] + self.noise


@register_likelihood
class LaplaceMean(Likelihood):
    r""":math:`p(y\mid f) = \operatorname{Laplace}(y; f, b)`, one output.

    :math:`\mathbb E|y - f|` for :math:`f\sim\mathcal N(\mu, v)` is the folded normal's mean
    :math:`\sigma\sqrt{2/\pi}e^{-d^2/2\sigma^2} + d(1 - 2\Phi(-d/\sigma))`, :math:`d = y-\mu`.
    """

    def __init__(self, scale: float = 0.5, mc_samples: int = 256) -> None:
        super().__init__(mc_samples)
        self.scale = float(scale)

    def conditional(self, f: Tensor) -> torch.distributions.Laplace:
        return torch.distributions.Laplace(f[..., 0], self.scale)

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        y = self.validate_target(y, self.validate_output(out))
        d, sd = y - out.mean[..., 0], out.var[..., 0].clamp_min(1e-12).sqrt()
        normal = torch.distributions.Normal(torch.zeros_like(d), torch.ones_like(d))
        folded = sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * (d / sd) ** 2) + d * (
            1 - 2 * normal.cdf(-d / sd)
        )
        return -math.log(2 * self.scale) - folded / self.scale

    def predictive(self, out: Gaussian) -> torch.distributions.Normal:
        self.validate_output(out)
        return torch.distributions.Normal(
            out.mean[..., 0], (out.var[..., 0] + 2 * self.scale**2).sqrt()
        )

    def epistemic_variance(self, out: Gaussian) -> Tensor:
        return out.var[..., 0]

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        return _LaplaceHead(options, self.scale)


def _data(n: int = 64) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=gen) * 4 - 2
    noise = torch.distributions.Laplace(0.0, 0.3).sample((n,))
    return x, 3.0 * x[:, 0] + 1.0 + noise


def test_closed_form_matches_monte_carlo() -> None:
    torch.manual_seed(0)
    lik = LaplaceMean(scale=0.7)
    out = Gaussian(torch.randn(5, 1, dtype=torch.float64), var=torch.rand(5, 1).double() + 0.1)
    y = torch.randn(5, dtype=torch.float64)
    mc = Likelihood.expected_log_prob(lik, out, y, mc_samples=400_000)
    torch.testing.assert_close(lik.expected_log_prob(out, y), mc, atol=5e-3, rtol=0)


def test_user_likelihood_trains_predicts_exports_and_reloads(tmp_path) -> None:
    torch.manual_seed(0)
    x, y = _data()
    model = DVIRegressor(in_features=1, hidden=[16], likelihood=LaplaceMean(scale=0.3), lr=0.02)
    assert model.hparams["likelihood"] == {
        "class_path": f"{__name__}.LaplaceMean",
        "init_args": {"scale": 0.3, "mc_samples": 256},
    }
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    trainer = Trainer(
        max_epochs=60,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    before = model.predictive(x)[0]
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    mean, var = model.predictive(x)
    # the fit learned the line: far better than the untrained network and than the mean
    err = (mean - y.double()).square().mean()
    assert err < 0.5 * (before - y.double()).square().mean()
    assert err < 0.2 * y.double().var()
    assert bool((var > 2 * 0.3**2 * float(model.target_scale) ** 2).all())
    aleatoric, epistemic = model.variance_decomposition(x)
    torch.testing.assert_close(aleatoric + epistemic, var)
    metrics = trainer.callback_metrics
    assert float(metrics["val/kl"]) > 0  # the KL of the posterior against the prior
    assert torch.isfinite(metrics["val/nll"]) and torch.isfinite(metrics["val/elbo"])
    # Monte Carlo predictive through the base class (conditional + sampled_variance)
    mc_mean, _ = model.predictive(x, "mc", 200)
    torch.testing.assert_close(mc_mean, mean, atol=0.2, rtol=0)
    # export: the likelihood's head, in original units
    served = export_predictive(model, mode="diag")
    e_mean, e_var = served(x)
    diag_mean, diag_var = model.predictive(x)  # the model trained in diag mode
    torch.testing.assert_close(e_mean.double(), diag_mean, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(e_var.double(), diag_var, atol=1e-4, rtol=1e-4)
    # checkpoint: weights_only, the likelihood rebuilt from its plain record
    path = tmp_path / "user.ckpt"
    trainer.save_checkpoint(path)
    reloaded = DVIRegressor.load_from_checkpoint(path)
    assert type(reloaded.likelihood) is LaplaceMean and reloaded.likelihood.scale == 0.3
    torch.testing.assert_close(reloaded.predictive(x)[0], mean)


def test_an_unregistered_likelihood_is_refused_at_load(tmp_path) -> None:
    class Unlisted(LaplaceMean):
        pass

    model = DVIRegressor(in_features=1, hidden=[4], likelihood=Unlisted(), num_data=8)
    trainer = Trainer(max_epochs=1, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    path = tmp_path / "unlisted.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(ValueError, match=r"refusing to build the likelihood .*Unlisted"):
        DVIRegressor.load_from_checkpoint(path)


def test_a_likelihood_argument_that_is_not_plain_data_is_refused() -> None:
    with pytest.raises(ValueError, match="plain values"):
        DVIRegressor(in_features=1, likelihood=LaplaceMean(scale=torch.tensor(0.5)))  # type: ignore[arg-type]


def test_classifier_takes_a_likelihood_object_and_reloads_it(tmp_path) -> None:
    from lightning_dvi import DVIClassifier
    from lightning_dvi.likelihoods import Categorical

    torch.manual_seed(0)
    model = DVIClassifier(in_features=2, hidden=[4], likelihood=Categorical(3, "clark"))
    assert model.num_classes == 3 and model.likelihood.method == "clark"
    assert model.hparams["likelihood"] == {
        "class_path": "lightning_dvi.likelihoods.Categorical",
        "init_args": {"num_classes": 3, "method": "clark", "mc_samples": 32},
    }
    with pytest.raises(ValueError, match="num_classes must be 3 or unset"):
        DVIClassifier(in_features=2, num_classes=4, likelihood=Categorical(3))
    with pytest.raises(ValueError, match="is a regression likelihood"):
        DVIClassifier(in_features=2, likelihood=LaplaceMean())
    trainer = Trainer(max_epochs=1, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    path = tmp_path / "classifier.ckpt"
    trainer.save_checkpoint(path)
    reloaded = DVIClassifier.load_from_checkpoint(path)
    x = torch.randn(5, 2)
    assert reloaded.likelihood.method == "clark"
    torch.testing.assert_close(reloaded.predictive(x), model.predictive(x))


def test_a_checkpoint_naming_another_class_as_likelihood_is_refused(tmp_path) -> None:
    model = DVIRegressor(in_features=1, hidden=[4], num_data=8)
    trainer = Trainer(max_epochs=1, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    path = tmp_path / "forged.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"]["likelihood"] = {"class_path": "os.system", "init_args": {}}
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=r"refusing to build the likelihood 'os\.system'"):
        DVIRegressor.load_from_checkpoint(path)


def test_the_buildable_library_classes_are_the_exported_likelihoods():
    import lightning_dvi.likelihoods as package
    from lightning_dvi.likelihoods import Likelihood
    from lightning_dvi.likelihoods.config import _LIBRARY

    exported = {
        obj
        for name in package.__all__
        if isinstance(obj := getattr(package, name), type) and issubclass(obj, Likelihood)
    }
    assert set(_LIBRARY) == exported
