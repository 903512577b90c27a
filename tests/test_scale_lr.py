"""``scale_lr``: the posterior scales' own Adam learning rate, found by protocol and wired."""

import math
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.lightning._config import (
    OptimiserConfig,
    param_groups,
    posterior_scale_parameters,
)
from lightning_dvi.nn import BayesConv2d, BayesLinear, BayesLinearFullCov, ReLU, Sequential


def test_scale_parameters_are_found_by_protocol_not_by_name():
    net = Sequential(BayesLinear(3, 4), ReLU(), BayesLinear(4, 2, bias=False))
    found = {id(p) for p in posterior_scale_parameters(net)}
    named = dict(net.named_parameters())
    expected = {k for k in named if k.endswith("raw_scale")}
    assert expected == {
        f"layers.{k}" for k in ("0.weight_raw_scale", "0.bias_raw_scale", "2.weight_raw_scale")
    }
    assert found == {id(named[k]) for k in expected}
    # a full-covariance layer: its Cholesky factor and diagonal, not its means
    full = BayesLinearFullCov(3, 2)
    got = {id(p) for p in posterior_scale_parameters(full)}
    means = {id(full.weight_loc), id(full.bias_loc)}
    assert got and not got & means
    assert got | means == {id(p) for p in full.parameters()}
    conv = BayesConv2d(1, 2, 3)
    conv_scales = {id(q) for q in posterior_scale_parameters(conv)}
    names = {n for n, p in conv.named_parameters() if id(p) in conv_scales}
    assert names == {"weight_raw_scale", "bias_raw_scale"}


def test_param_groups_split_only_when_asked():
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    one = param_groups([a, b, c], [b], 0.1, None)
    assert len(param_groups([a, b, c], [b], 0.1, 0.1)) == 1
    assert len(one) == 1 and one[0]["params"] == [a, b, c] and one[0]["lr"] == 0.1
    two = param_groups([a, b, c], [b, torch.nn.Parameter(torch.zeros(1))], 0.1, 0.03)
    assert [g["params"] for g in two] == [[a, c], [b]]
    assert [g["lr"] for g in two] == pytest.approx([0.1, 0.03])
    assert len(param_groups([a], [b], 0.1, 0.03)) == 1  # no scale among the trained parameters


def test_scale_lr_is_checked():
    with pytest.raises(ValueError, match="scale_lr must be a finite number > 0"):
        OptimiserConfig(scale_lr=0.0)
    with pytest.raises(ValueError, match="nor scale_lr"):
        DVIRegressor(in_features=1, optimizer="lbfgs", scale_lr=0.5)


def _fit(model, steps=4):
    torch.manual_seed(0)
    x, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
    trainer = Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return trainer


def test_a_fit_trains_the_scales_at_their_own_rate():
    model = DVIClassifier(hidden=[5], lr=0.01, scale_lr=0.0025, lr_schedule="cosine")
    assert model.hparams.scale_lr == 0.0025
    trainer = _fit(model)
    (optimiser,) = trainer.optimizers
    scales = {id(p) for p in posterior_scale_parameters(model.net)}
    assert len(optimiser.param_groups) == 2
    rest, group = optimiser.param_groups
    assert {id(p) for p in group["params"]} == scales and not {
        id(p) for p in rest["params"]
    } & scales
    assert group["initial_lr"] == pytest.approx(0.0025) and rest["initial_lr"] == pytest.approx(
        0.01
    )
    # the cosine schedule scales both groups alike (after 4 of 4 steps: min_lr 0)
    assert group["lr"] == pytest.approx(0.0) and rest["lr"] == pytest.approx(0.0)
    # Adam's first step moves every raw scale by about its group's rate (the sign of the gradient)
    layer = model.net.layers[0]
    fresh = DVIClassifier(in_features=3, num_classes=2, hidden=[5], lr=0.01, scale_lr=0.0025)
    before = fresh.net.layers[0].weight_raw_scale.detach().clone()
    _fit(fresh, steps=1)
    step = (fresh.net.layers[0].weight_raw_scale.detach() - before).abs()
    assert torch.allclose(step[step > 0], torch.full_like(step[step > 0], 0.0025), rtol=1e-3)
    assert isinstance(layer, BayesLinear)


def test_default_is_one_group():
    model = DVIRegressor(in_features=2, hidden=[3])
    optimiser = model.configure_optimizers()
    assert isinstance(optimiser, torch.optim.Adam) and len(optimiser.param_groups) == 1
    assert math.isclose(optimiser.param_groups[0]["lr"], 1e-3)
