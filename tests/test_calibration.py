"""Tempered KL (``kl_weight``) and post-hoc temperature scaling of the classifier (issue 13)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier
from lightning_dvi.callbacks import TemperatureScaling
from lightning_dvi.lightning.temperature import fit_temperature, temper_probs
from lightning_dvi.objective import elbo


def _data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True])
def test_kl_weight_must_be_a_positive_finite_number(bad) -> None:
    with pytest.raises(ValueError, match="kl_weight"):
        DVIClassifier(in_features=5, num_classes=3, hidden=[4], num_data=10, kl_weight=bad)


class _FirstLoss(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss = float(outputs["loss"])


@pytest.mark.parametrize("method", ["delta", "clark"])
def test_kl_weight_multiplies_the_kl_in_the_training_loss_only(method, tmp_path) -> None:
    torch.manual_seed(0)
    x, y = _data()
    model = DVIClassifier(
        in_features=5,
        num_classes=3,
        hidden=[8],
        num_data=64,
        kl_weight=0.25,
        likelihood_method=method,
    )
    before = copy.deepcopy(model)
    grab = _FirstLoss()
    trainer = cpu_trainer(
        max_steps=1, callbacks=[grab], enable_checkpointing=False, default_root_dir=tmp_path
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64))
    terms = elbo(before.net, before.likelihood, before.prior, x, y, num_data=64, mode=before.mode)
    expected = -(terms.expected_log_likelihood - 0.25 * terms.kl / 64)
    assert grab.loss == pytest.approx(float(expected.detach()), rel=1e-5)
    # Evaluation reports the untempered ELBO.
    metrics = trainer.validate(model, DataLoader(TensorDataset(x, y), batch_size=64), verbose=False)
    after = elbo(model.net, model.likelihood, model.prior, x, y, num_data=64, mode=model.mode)
    assert metrics[0]["val/elbo"] == pytest.approx(float(after.elbo), rel=1e-4)


def test_fit_temperature_matches_a_grid_search_oracle() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(500, 4, generator=gen, dtype=torch.float64) * 0.7
    y = torch.multinomial(torch.softmax(logits * 3, -1), 1, generator=gen)[:, 0]
    probs = torch.softmax(logits, -1)  # under-confident by a factor 3 in the logits
    t = fit_temperature(probs, y)
    grid = torch.linspace(0.05, 2.0, 3901, dtype=torch.float64)
    log_p = torch.log_softmax(probs.log() / grid[:, None, None], -1)  # [G, N, K]
    nll = -log_p.gather(-1, y.expand(len(grid), -1).unsqueeze(-1)).mean((-1, -2))
    best = float(grid[nll.argmin()])
    assert t == pytest.approx(best, abs=1e-3)
    assert t < 0.6  # sharpening, near the generating 1/3
    assert torch.equal(temper_probs(probs, t).argmax(-1), probs.argmax(-1))


def test_fit_temperature_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="probs"):
        fit_temperature(torch.rand(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="probs"):
        fit_temperature(torch.rand(0, 3), torch.zeros(0, dtype=torch.long))


def test_temperature_scaling_callback_fits_on_validation_and_survives_checkpoints(
    tmp_path,
) -> None:
    torch.manual_seed(0)
    x, y = _data(96)
    xv, yv = _data(64, seed=1)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[8], num_data=96, lr=1e-2)
    scaler = TemperatureScaling()
    trainer = cpu_trainer(
        max_epochs=3, callbacks=[scaler], default_root_dir=tmp_path, enable_checkpointing=False
    )
    train = DataLoader(TensorDataset(x, y), batch_size=32)
    val = DataLoader(TensorDataset(xv, yv), batch_size=32)
    trainer.fit(model, train, val)
    t = float(model.predictive_temperature)
    assert t == pytest.approx(scaler.result["temperature"]) and t != 1.0
    assert scaler.result["val_nll_after"] <= scaler.result["val_nll_before"] + 1e-12
    model.eval()
    tempered = model.predictive(xv)
    model.predictive_temperature.fill_(1.0)
    plain = model.predictive(xv)
    assert torch.allclose(tempered, temper_probs(plain, t), atol=1e-6)
    assert torch.equal(tempered.argmax(-1), plain.argmax(-1))
    # The temperature is saved with the weights; old state dicts without it load as T = 1.
    model.predictive_temperature.fill_(t)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = DVIClassifier.load_from_checkpoint(path)
    assert float(loaded.predictive_temperature) == pytest.approx(t)
    ckpt = torch.load(path, weights_only=False)
    del ckpt["state_dict"]["predictive_temperature"]
    torch.save(ckpt, path)
    assert float(DVIClassifier.load_from_checkpoint(path).predictive_temperature) == 1.0


def test_temperature_scaling_needs_validation_data_and_a_classifier(tmp_path) -> None:
    x, y = _data(32)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[4], num_data=32)
    trainer = cpu_trainer(
        max_steps=1,
        callbacks=[TemperatureScaling()],
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ValueError, match="validation data"):
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
    with pytest.raises(ValueError, match="predictive"):
        TemperatureScaling().on_fit_end(trainer, torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def _closed_form_kl(model: DVIClassifier, variance: float) -> float:
    """KL(q || N(0, s)) summed over every weight and bias, from the layers' means and scales."""
    total = 0.0
    for layer in model.net.layers:
        if not hasattr(layer, "weight_loc"):
            continue
        for loc, scale in (
            (layer.weight_loc, layer.weight_scale),
            (layer.bias_loc, layer.bias_scale),
        ):
            v = scale.detach().double() ** 2
            m2 = loc.detach().double() ** 2
            total += float(0.5 * (v / variance + m2 / variance - 1 - torch.log(v / variance)).sum())
    return total


def test_the_defaults_are_the_elbo_under_a_gaussian_prior_of_variance_one_tenth() -> None:
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[4], num_data=10)
    assert model.kl_weight == 1.0 and model.hparams["kl_weight"] == 1.0
    assert model.hparams["prior"] == "gaussian" and model.hparams["prior_variance"] == 0.1
    kl = float(model.prior.kl(model.net).detach())
    assert kl == pytest.approx(_closed_form_kl(model, 0.1), rel=1e-5)
    assert kl != pytest.approx(_closed_form_kl(model, 1.0), rel=1e-2)
    again = DVIClassifier(**model.hparams)  # what a checkpoint rebuilds
    assert again.hparams["prior_variance"] == 0.1 and again.kl_weight == 1.0


def test_the_prior_variance_default_applies_to_the_gaussian_shorthand_only() -> None:
    from lightning_dvi.priors import EmpiricalBayes, GaussianPrior

    shared = {"in_features": 5, "num_classes": 3, "hidden": [4], "num_data": 10}
    given = DVIClassifier(**shared, prior_variance=0.5)
    assert given.hparams["prior_variance"] == 0.5
    assert float(given.prior.kl(given.net).detach()) == pytest.approx(
        _closed_form_kl(given, 0.5), rel=1e-5
    )
    eb = DVIClassifier(**shared, prior="empirical_bayes", eb_mode="buffer")
    assert isinstance(eb.prior, EmpiricalBayes) and eb.hparams["prior_variance"] == 1.0
    assert float(eb.net.layers[0].weight_prior_variance) == 1.0  # the buffers start at 1
    own = DVIClassifier(**shared, prior=GaussianPrior(2.0))  # an object keeps its variance
    assert float(own.prior.kl(own.net).detach()) == pytest.approx(
        _closed_form_kl(own, 2.0), rel=1e-5
    )
