"""DVIRegressor / DVIClassifier: construction checks, predictives, a few Trainer steps."""

import math
import subprocess
import sys

import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch import Callback

from lightning_dvi import DVIClassifier, DVIRegressor, Gaussian
from lightning_dvi.data import DigitsDataModule, ToyHeteroscedasticDataModule
from lightning_dvi.nn import BayesLinear, ReLU, Sequential


def _trainer(**kwargs):
    return cpu_trainer(**{"enable_checkpointing": False, **kwargs})


def _toy(**kwargs):
    return ToyHeteroscedasticDataModule(
        **{"num_train": 32, "num_val": 16, "num_test": 16, "batch_size": 16, **kwargs}
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "exact"}, "mode"),
        ({"activation": "swish"}, "activation"),
        ({"likelihood": "laplace"}, "likelihood"),
        ({"prior": "horseshoe"}, "prior"),
        ({"eb_mode": "sometimes"}, "mode"),
        ({"hidden": [8, 0]}, "hidden"),
        ({"lr": 0.0}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"num_samples": 4}, "num_samples"),
        ({"mode": "sample", "num_samples": 0}, "num_samples"),
        ({"num_data": 0}, "num_data"),
        ({"in_features": 0}, "in_features"),
        ({"kl_warmup_fraction": 1.5}, "kl_warmup_fraction"),
        ({"kl_warmup_fraction": 0.5, "kl_warmup_steps": 10}, "either in steps"),
        ({"standardize_targets": "yes"}, "standardize_targets"),
        ({"target_scale": 0.0}, "target_scale"),
        ({"prior_variance": -1.0}, "prior_variance"),
        ({"kl_warmup_steps": -1}, "warmup_steps"),
        ({"lr_schedule": "step"}, "lr_schedule"),
        ({"min_lr": -1e-4}, "min_lr"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr"),
        ({"net": Sequential(BayesLinear(1, 3))}, "outputs"),
    ],
)
def test_regressor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DVIRegressor(**{"in_features": 1, "hidden": [4], **kwargs})


def test_classifier_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_classes"):
        DVIClassifier(in_features=2, num_classes=1)
    with pytest.raises(ValueError, match="method"):
        DVIClassifier(in_features=2, num_classes=3, likelihood_method="laplace")
    with pytest.raises(ValueError, match="ece_bins"):
        DVIClassifier(in_features=2, num_classes=3, ece_bins=0)


@pytest.mark.parametrize("mode", ["full", "diag", "sample", "local"])
def test_forward_and_predictive_shapes(mode):
    samples = 3 if mode in ("sample", "local") else None
    model = DVIRegressor(
        in_features=2, hidden=[4, 4], residual=True, mode=mode, num_samples=samples
    )
    out = model(torch.randn(5, 2))
    if samples is None:
        assert isinstance(out, Gaussian) and out.mean.shape == (5, 2)
        assert out.cov is not None  # diag mode too: a narrow head keeps it (moments.HEAD_WIDTH)
    else:
        assert out.shape == (3, 5, 2)
    mean, var = model.predictive(torch.randn(5, 2))
    assert mean.shape == var.shape == (5,) and (var > 0).all()
    clf = DVIClassifier(in_features=2, num_classes=3, hidden=[4], mode=mode, num_samples=samples)
    probs = clf.predictive(torch.randn(5, 2))
    assert probs.shape == (5, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_heteroscedastic_noise_starts_low():
    model = DVIRegressor(in_features=1, hidden=[8], init_log_noise=-4.0)
    assert model.net[-1].bias_loc[1].item() == -4.0


@pytest.mark.parametrize("likelihood", ["heteroscedastic", "homoscedastic"])
def test_monte_carlo_predictive_is_the_mixture_moments(likelihood):
    torch.manual_seed(1)
    model = DVIRegressor(
        in_features=1, hidden=[8], mode="sample", num_samples=5, likelihood=likelihood
    )
    x = torch.randn(4, 1)
    torch.manual_seed(2)
    f = model.net(x, mode="sample", num_samples=5)
    torch.manual_seed(2)
    mean, var = model.predictive_standardized(x)
    if likelihood == "heteroscedastic":
        means, noise = f[..., 0], f[..., 1].exp()
    else:
        means, noise = f[..., 0], model.likelihood.noise_variance.expand_as(f[..., 0])
    torch.testing.assert_close(mean, means.mean(0))
    expected_var = noise.mean(0) + (means**2).mean(0) - means.mean(0) ** 2
    torch.testing.assert_close(var, expected_var, rtol=1e-5, atol=1e-6)


def test_predictive_in_original_units():
    torch.manual_seed(0)
    model = DVIRegressor(in_features=1, hidden=[4], target_loc=2.0, target_scale=3.0)
    x = torch.randn(6, 1)
    mean_std, var_std = model.predictive_standardized(x)
    mean, var = model.predictive(x)
    # the way back to the original units is float64 (a float32 one rounds 1e8 + 0.5 to 1e8)
    assert mean.dtype == var.dtype == torch.float64
    torch.testing.assert_close(mean, mean_std.double() * 3.0 + 2.0)
    torch.testing.assert_close(var, var_std.double() * 9.0)
    assert {"target_loc", "target_scale"} <= set(model.state_dict())


def test_fit_logs_elbo_parts_and_metrics_and_takes_n_from_the_datamodule():
    model = DVIRegressor(hidden=[8], in_features=1, lr=0.01)
    dm = _toy()
    trainer = _trainer(max_epochs=2, log_every_n_steps=1)
    trainer.fit(model, dm)
    assert model.num_data == 32 and model.hparams.num_data == 32
    assert model.hparams.target_loc == 0.0 and model.hparams.target_scale == 1.0
    keys = set(trainer.callback_metrics)
    for key in ("train/loss", "train/elbo", "train/expected_log_likelihood", "train/kl"):
        assert key in keys
    for key in ("val/elbo", "val/nll", "val/rmse", "val/crps", "val/mace", "val/coverage_90"):
        assert key in keys
    trainer.test(model, dm)
    assert math.isfinite(float(trainer.callback_metrics["test/nll"]))
    curve = model.calibration_curves["test"]
    assert curve["expected"].shape == curve["observed"].shape == (100,)
    predictions = trainer.predict(model, dm)
    assert set(predictions[0]) == {"mean", "var", "aleatoric_var", "epistemic_var"}
    assert predictions[0]["mean"].shape == (16,)


def test_metrics_are_reported_in_original_units():
    torch.manual_seed(0)
    model = DVIRegressor(in_features=1, hidden=[4], target_loc=5.0, target_scale=10.0)
    x, y_orig = torch.randn(8, 1), 5.0 + 10.0 * torch.randn(8)  # batches hold raw targets
    model._update_metrics(model.test_metrics, x, y_orig)
    mean, var = model.predictive(x)
    computed = model.test_metrics.compute()
    rmse = (y_orig - mean).square().mean().sqrt()
    torch.testing.assert_close(computed["test/rmse"], rmse, rtol=1e-5, atol=1e-5)
    # the NLL is the exact predictive's (heavier tails than the Gaussian with these moments)
    nll = -model.predictive_log_prob(x, y_orig).mean()
    torch.testing.assert_close(computed["test/nll"], nll, rtol=1e-5, atol=1e-5)
    homoscedastic = DVIRegressor(
        in_features=1, hidden=[4], likelihood="homoscedastic", target_loc=5.0, target_scale=10.0
    )
    homoscedastic._update_metrics(homoscedastic.test_metrics, x, y_orig)
    mean, var = homoscedastic.predictive(x)
    nll = (0.5 * torch.log(2 * math.pi * var) + (y_orig - mean) ** 2 / (2 * var)).mean()
    computed = homoscedastic.test_metrics.compute()["test/nll"]
    torch.testing.assert_close(computed, nll, rtol=1e-5, atol=1e-5)


def test_coverage_and_nll_of_a_heteroscedastic_model_read_its_exact_predictive():
    """Targets drawn from the model's own predictive: its CDF's intervals cover the nominal share."""
    torch.manual_seed(0)
    net = Sequential(BayesLinear(2, 2, init_scale=0.6))
    with torch.no_grad():
        net[0].bias_loc.copy_(torch.tensor([0.0, -1.0]))
    model = DVIRegressor(net=net.double(), target_loc=1.0, target_scale=3.0).double()
    x = torch.randn(6000, 2, dtype=torch.float64)
    with torch.no_grad():
        predictive = model.likelihood.predictive(model.net(x, mode="full"))
        target = 1.0 + 3.0 * predictive.sample()  # original units
    model._update_metrics(model.test_metrics, x, target)
    computed = model.test_metrics.compute()
    for level in (50, 90, 95):  # 4 binomial standard errors
        assert abs(float(computed[f"test/coverage_{level}"]) - level / 100) < 4 * 0.0065
    nll = -model.predictive_log_prob(x, target).mean()
    torch.testing.assert_close(computed["test/nll"], nll)
    # the Gaussian with the same moments misses the shares: this predictive's tails are heavier
    mean, var = model.predictive(x)
    inside = (target - mean).abs() <= 0.6745 * var.sqrt()
    assert float(inside.double().mean()) > 0.5 + 4 * 0.0065


class _Stream(torch.utils.data.IterableDataset):
    """A training stream without a length: N cannot be read from it."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(8):
            yield torch.randn(1, generator=generator), torch.randn((), generator=generator)


def test_missing_num_data_without_datamodule_is_a_clear_error():
    model = DVIRegressor(in_features=1, hidden=[4])
    loader = torch.utils.data.DataLoader(_Stream(), batch_size=4)
    with pytest.raises(ValueError, match="num_data"):
        _trainer(max_steps=1).fit(model, train_dataloaders=loader)


class _RecordLR(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_cosine_lr_schedule_decays_per_step_to_min_lr():
    model = DVIRegressor(in_features=1, hidden=[4], lr=0.1, lr_schedule="cosine", min_lr=0.01)
    record = _RecordLR()
    # 2 batches per epoch, 3 epochs: T = 6 optimisation steps.
    _trainer(max_epochs=3, callbacks=[record], limit_val_batches=0).fit(model, _toy())
    expected = [0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * t / 6)) for t in range(6)]
    assert record.lrs == pytest.approx(expected, rel=1e-12)
    assert model.lr_schedulers().get_last_lr()[0] == pytest.approx(0.01)


def test_constant_lr_is_the_default_and_cosine_needs_a_finite_horizon():
    model = DVIRegressor(in_features=1, hidden=[4], lr=0.1)
    record = _RecordLR()
    _trainer(max_steps=3, callbacks=[record], limit_val_batches=0).fit(model, _toy())
    assert record.lrs == [0.1, 0.1, 0.1]
    cosine = DVIRegressor(in_features=1, hidden=[4], lr_schedule="cosine")
    with pytest.raises(ValueError, match="finite number of optimisation steps"):
        _trainer(max_epochs=-1, max_steps=-1).fit(cosine, _toy())


def test_non_finite_loss_stops_training_naming_the_step():
    # exp(1000) overflows the heteroscedastic precision: the loss is infinite at once.
    model = DVIRegressor(in_features=1, hidden=[4], init_log_noise=-1000.0)
    with pytest.raises(FloatingPointError, match="global step 0"):
        _trainer(max_steps=2).fit(model, _toy())


def test_classifier_fit_and_predict():
    dm = DigitsDataModule(batch_size=256, seed=0)
    model = DVIClassifier(hidden=[16], in_features=64, num_classes=10, mode="diag", lr=0.01)
    trainer = _trainer(
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
    )
    trainer.fit(model, dm)
    for key in ("val/acc", "val/nll", "val/brier", "val/ece", "val/elbo"):
        assert key in trainer.callback_metrics
    trainer.test(model, dm)
    curve = model.calibration_curves["test"]
    assert int(curve["count"].sum()) == 256
    probs = trainer.predict(model, dm)[0]
    assert probs.shape == (256, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(256))


def test_injected_network():
    net = Sequential(BayesLinear(1, 6), ReLU(), BayesLinear(6, 2))
    model = DVIRegressor(net=net, num_data=32)
    assert model.net is net and "net" not in model.hparams
    _trainer(max_steps=2, limit_val_batches=0).fit(model, _toy())


def test_import_lightning_dvi_does_not_import_lightning():
    code = "import sys, lightning_dvi; assert 'lightning' not in sys.modules, 'imported lightning'"
    subprocess.run([sys.executable, "-c", code], check=True)
