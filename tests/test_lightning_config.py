"""The Lightning constructors' argument groups: each checked once, by the object it becomes."""

import inspect

import pytest
import torch

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.lightning import _config, _network, _validation
from lightning_dvi.lightning._base import DVIModule
from lightning_dvi.lightning._config import KLScheduleConfig, OptimiserConfig
from lightning_dvi.nn import BayesLinear, ReLU, Sequential


@pytest.fixture
def checks(monkeypatch):
    """Every message a front-end check was asked to verify during a construction."""
    seen: list[str] = []

    def check(condition, message):
        seen.append(message)
        if not condition:
            raise ValueError(message)

    for module in (_validation, _config, _network):
        monkeypatch.setattr(module, "check", check)
    return seen


@pytest.mark.parametrize(
    "build",
    [
        lambda: DVIRegressor(in_features=2, hidden=[4], mode="sample", lr_schedule="cosine"),
        lambda: DVIRegressor(hidden=[4, 4], prior="gaussian", kl_warmup_fraction=0.3),
        lambda: DVIRegressor(net=Sequential(BayesLinear(2, 4), ReLU(), BayesLinear(4, 2))),
        lambda: DVIClassifier(in_features=2, num_classes=3, init_scale=0.05, kl_anneal_steps=4),
    ],
)
def test_no_argument_is_checked_twice(checks, build):
    build()
    assert checks, "the spy saw no check"
    repeated = {m for m in checks if checks.count(m) > 1}
    assert not repeated, repeated


@pytest.mark.parametrize("model", [DVIRegressor, DVIClassifier])
def test_hparams_record_every_argument_at_its_default(model):
    """The hyper-parameters of a default construction are the signatures' defaults (checkpoints)."""
    params = {
        name: p.default
        for cls in (DVIModule, model)  # the subclass's defaults win (in_features, hidden)
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and name not in ("net", "out_features")
    }
    # DVIClassifier's prior_variance=None is recorded resolved: N(0, 0.1) under "gaussian"
    if model is DVIClassifier:
        assert params["prior_variance"] is None
        params["prior_variance"] = 0.1
    assert dict(model().hparams) == params


def test_sample_mode_records_its_resolved_num_samples():
    assert DVIRegressor(in_features=1, mode="sample").hparams.num_samples == 1
    assert DVIRegressor(in_features=1, mode="local", num_samples=3).hparams.num_samples == 3
    assert DVIRegressor(in_features=1).hparams.num_samples is None


def test_lr_is_the_optimiser_configs_and_stays_checked():
    """``model.lr`` (what Lightning's learning-rate finder sets) is the optimiser's, re-checked."""
    model = DVIRegressor(in_features=1, hidden=[4], lr=0.1, min_lr=0.01, weight_decay=0.5)
    model.lr = 0.05
    optimiser = model.configure_optimizers()
    assert isinstance(optimiser, torch.optim.Adam)
    assert optimiser.defaults["lr"] == 0.05 and optimiser.defaults["weight_decay"] == 0.5
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        model.lr = 0.0
    with pytest.raises(ValueError, match=r"min_lr \(0.01\) must not exceed lr \(0.001\)"):
        model.lr = 0.001
    assert model.lr == 0.05


def test_optimiser_config_normalises_and_rejects():
    config = OptimiserConfig(lr=1, lr_schedule="cosine", min_lr=0, weight_decay=0)
    assert (type(config.lr), type(config.min_lr)) == (float, float)
    with pytest.raises(ValueError, match="lr_schedule must be 'constant' or 'cosine'"):
        OptimiserConfig(lr_schedule="step")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "total", "steps"),
    [
        (KLScheduleConfig(warmup_steps=3, anneal_steps=2), 1000, (3, 2)),
        (KLScheduleConfig(warmup_fraction=0.5, anneal_fraction=0.25), 10, (5, 2)),  # round(2.5)
        (KLScheduleConfig(warmup_fraction=0.3), None, (0, 0)),  # before the run: full KL
    ],
)
def test_kl_schedule_config_turns_fractions_into_steps(config, total, steps):
    schedule = config.schedule(total)
    assert (schedule.warmup_steps, schedule.anneal_steps) == steps
    assert config.by_fraction == (config.warmup_fraction > 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, "warmup_steps must be a non-negative int"),
        ({"anneal_fraction": 2.0}, r"kl_anneal_fraction must be a fraction in \[0, 1\]"),
        ({"warmup_fraction": 0.7, "anneal_fraction": 0.4}, "must not exceed 1, got 0.7 \\+ 0.4"),
        ({"warmup_fraction": 0.1, "anneal_steps": 5}, "either in steps"),
    ],
)
def test_kl_schedule_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KLScheduleConfig(**kwargs)


def test_the_classifier_has_its_own_learning_rate_default():
    """3e-3 for ``DVIClassifier`` (1e-3 left it under-trained on digits, docs/calibration.md)."""
    model = DVIClassifier(in_features=2, num_classes=3)
    assert model.lr == 3e-3 and model.configure_optimizers().defaults["lr"] == 3e-3
    assert DVIRegressor().lr == 1e-3
