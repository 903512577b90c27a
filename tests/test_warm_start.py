"""The point-estimate warm start: its loss, its plain pass, its fit and its Lightning callback."""

from __future__ import annotations

import math

import lightning
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.callbacks import PointEstimateWarmStart
from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian, HomoscedasticGaussian
from lightning_dvi.nn import (
    BayesConv2d,
    BayesLinear,
    BayesLinearFullCov,
    ReLU,
    Residual,
    Sequential,
    mlp,
)
from lightning_dvi.warm_start import fit_point_estimate, point_forward


def _plain_copy(net: Sequential) -> nn.Sequential:
    """The same MLP in plain torch, every weight at the posterior mean (the oracle)."""
    layers: list[nn.Module] = []
    for m in net:
        if isinstance(m, BayesLinear):
            lin = nn.Linear(m.in_features, m.out_features, dtype=m.weight_loc.dtype)
            with torch.no_grad():
                lin.weight.copy_(m.weight_loc)
                lin.bias.copy_(m.bias_loc)
            layers.append(lin)
        else:
            assert isinstance(m, ReLU)
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _data(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.05 * torch.randn(n, generator=g)
    return x, y


def test_gaussian_point_fit_loss_is_the_squared_error_of_the_mean_output():
    f, y = torch.randn(7, 2), torch.randn(7)
    for lik in (HeteroscedasticGaussian(), HomoscedasticGaussian()):
        got = lik.point_fit_loss(f if isinstance(lik, HeteroscedasticGaussian) else f[:, :1], y)
        torch.testing.assert_close(got, (y - f[:, 0]) ** 2)
    # [B, 1] targets are accepted as regression targets are everywhere
    torch.testing.assert_close(
        HeteroscedasticGaussian().point_fit_loss(f, y[:, None]), (y - f[:, 0]) ** 2
    )


def test_categorical_point_fit_loss_is_the_cross_entropy():
    logits, labels = torch.randn(9, 4), torch.randint(0, 4, (9,))
    got = Categorical(4).point_fit_loss(logits, labels)
    torch.testing.assert_close(got, F.cross_entropy(logits, labels, reduction="none"))


def test_point_forward_is_the_plain_network_at_the_means():
    torch.manual_seed(0)
    net = mlp(3, [16, 8], 2, init_scale=0.3)
    x = torch.randn(5, 3)
    torch.testing.assert_close(point_forward(net, x), _plain_copy(net)(x))
    # differentiable in the means, and only in them
    point_forward(net, x).sum().backward()
    assert net[0].weight_loc.grad is not None and net[0].weight_raw_scale.grad is None


def test_point_forward_through_a_full_covariance_layer_and_a_residual_block():
    torch.manual_seed(0)
    first, inner, last = BayesLinearFullCov(3, 8), BayesLinear(8, 8), BayesLinear(8, 2)
    net = Sequential(first, ReLU(), Residual(ReLU(), inner), last)
    x = torch.randn(6, 3)

    def affine(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ layer.weight_loc.T + layer.bias_loc

    h = torch.relu(affine(first, x))
    expected = affine(last, h + affine(inner, torch.relu(h)))
    torch.testing.assert_close(point_forward(net, x), expected)


def test_point_forward_through_a_convolution_is_the_plain_conv_at_the_means():
    """``BayesConv2d`` takes weight values since issue 44's item 6 (it used to refuse them)."""
    torch.manual_seed(0)
    conv = BayesConv2d(1, 2, 3, stride=2, padding=1)
    x = torch.randn(2, 1, 5, 5)
    expected = F.conv2d(x, conv.weight_loc, conv.bias_loc, stride=2, padding=1)
    torch.testing.assert_close(point_forward(Sequential(conv), x), expected)


def test_the_fit_moves_only_the_means_and_lowers_the_loss():
    torch.manual_seed(0)
    net, lik = mlp(2, [32], 2), HeteroscedasticGaussian()
    x, y = _data()
    scales = {k: v.clone() for k, v in net.state_dict().items() if "loc" not in k}
    with torch.no_grad():
        before = float(F.mse_loss(point_forward(net, x)[:, 0], y))
    result = fit_point_estimate(net, lik, x, y, max_steps=30)
    with torch.no_grad():
        after = float(F.mse_loss(point_forward(net, x)[:, 0], y))
    assert after < 0.05 * before and after == pytest.approx(result.train_loss, rel=1e-5)
    assert result.val_loss is None and result.stopped in ("converged", "max_steps")
    for k, v in net.state_dict().items():
        if "loc" not in k:
            assert torch.equal(v, scales[k]), k
    assert all(p.grad is None for p in net.parameters())


def test_early_stopping_keeps_the_best_held_out_step():
    torch.manual_seed(1)
    # 12 noisy training rows, a wide net: the held-out loss turns up while the training loss falls
    net, lik = mlp(2, [64], 2, init_scale=0.3), HeteroscedasticGaussian()
    x, y = _data(12, seed=1)
    y = y + 0.5 * torch.randn(12)
    xv, yv = _data(200, seed=2)
    trail: list[float] = []
    original = lik.point_fit_loss

    def recording(f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        loss = original(f, t)
        if not torch.is_grad_enabled() and t.shape[0] == 200:
            trail.append(float(loss.mean()))
        return loss

    lik.point_fit_loss = recording  # type: ignore[method-assign]
    result = fit_point_estimate(net, lik, x, y, xv, yv, max_steps=100, patience=3, iterations=5)
    assert result.stopped == "patience"
    # trail: the start, then one held-out loss per step (and the final one of the kept means)
    per_step = trail[1 : 1 + result.steps]
    assert result.best_step == 1 + per_step.index(min(per_step))
    assert result.steps - result.best_step == 3
    assert result.val_loss == pytest.approx(min(per_step), rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_steps": 0}, "max_steps"),
        ({"patience": True}, "patience"),
        ({"iterations": 1.5}, "iterations"),
        ({"tolerance": float("nan")}, "tolerance"),
        ({"x_val": torch.zeros(3, 2)}, "both x_val and y_val"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    x, y = _data(20)
    with pytest.raises(ValueError, match=match):
        fit_point_estimate(mlp(2, [4], 2), HeteroscedasticGaussian(), x, y, **kwargs)


def test_a_non_finite_start_is_an_error_not_a_nan_fit():
    x, y = _data(20)
    x[3, 1] = float("nan")
    with pytest.raises(FloatingPointError, match="start"):
        fit_point_estimate(mlp(2, [4], 2), HeteroscedasticGaussian(), x, y)
    with pytest.raises(FloatingPointError, match="held-out"):
        fit_point_estimate(mlp(2, [4], 2), HeteroscedasticGaussian(), *_data(20), x, y)
    with pytest.raises(ValueError, match="NaN or Inf"):  # the likelihood's own target check
        fit_point_estimate(
            mlp(2, [4], 2), HeteroscedasticGaussian(), *_data(20)[:1], torch.full((20,), math.inf)
        )


def _regression_trainer(warm: PointEstimateWarmStart, steps: int, **kwargs) -> lightning.Trainer:
    return lightning.Trainer(
        max_steps=steps,
        callbacks=[warm],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def test_the_callback_warm_starts_a_regressor_on_its_own_dataloaders():
    lightning.seed_everything(0, verbose=False)
    x, y = _data(240)
    y = 50.0 + 10.0 * y  # the regressor standardises: the fit must see standardised targets
    train = DataLoader(TensorDataset(x[:200], y[:200]), batch_size=200, shuffle=True)
    val = DataLoader(TensorDataset(x[200:], y[200:]), batch_size=64)
    model = DVIRegressor(in_features=2, hidden=[32], num_data=200, optimizer="lbfgs")
    warm = PointEstimateWarmStart(patience=3)
    _regression_trainer(warm, 1).fit(model, train, val)
    assert warm.result is not None and warm.result.val_loss is not None
    # the kept means' held-out loss, in standardised units: a fit, not the prior's start
    assert warm.result.val_loss < 0.1
    model.eval()
    with torch.no_grad():
        mean, _ = model.predictive(x[200:])
    assert float((mean - y[200:]).square().mean().sqrt()) < 0.35 * float(y.std())


def test_the_callback_does_not_refit_a_resumed_run(tmp_path):
    x, y = _data(100)
    loader = DataLoader(TensorDataset(x, y), batch_size=100)
    model = DVIRegressor(in_features=2, hidden=[8], num_data=100)
    first = PointEstimateWarmStart()
    trainer = _regression_trainer(first, 2)
    trainer.fit(model, loader)
    # no validation batches: a held-out tenth of the 100 rows stops the warm start
    assert first.result is not None and first.result.val_loss is not None
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    resumed = PointEstimateWarmStart()
    model = DVIRegressor(in_features=2, hidden=[8], num_data=100)
    _regression_trainer(resumed, 4).fit(model, loader, ckpt_path=path)
    assert resumed.result is None


def test_validation_batches_the_trainer_skips_are_not_read():
    """``limit_val_batches=0``: the warm start holds out training rows, never the val loader's."""
    x, y = _data(100)
    train = DataLoader(TensorDataset(x, y), batch_size=100)
    absurd = DataLoader(TensorDataset(x[:10], torch.full((10,), 1e3)), batch_size=10)
    warm = PointEstimateWarmStart()
    model = DVIRegressor(in_features=2, hidden=[8], num_data=100)
    _regression_trainer(warm, 1, limit_val_batches=0).fit(model, train, absurd)
    assert warm.result is not None and warm.result.val_loss is not None
    assert warm.result.val_loss < 1.0  # standardised units; the absurd targets would be ~1e5
    # the control: a Trainer that validates hands the warm start its validation batches
    model = DVIRegressor(in_features=2, hidden=[8], num_data=100)
    _regression_trainer(warm, 1).fit(model, train, absurd)
    assert warm.result is not None and warm.result.val_loss is not None
    assert warm.result.val_loss > 1e3


def test_without_a_holdout_the_warm_start_runs_until_the_loss_stops_changing():
    x, y = _data(100)
    loader = DataLoader(TensorDataset(x, y), batch_size=100)
    warm = PointEstimateWarmStart(holdout=0.0, max_steps=15)
    _regression_trainer(warm, 1).fit(DVIRegressor(in_features=2, hidden=[8], num_data=100), loader)
    assert warm.result is not None and warm.result.val_loss is None
    assert warm.result.stopped in ("converged", "max_steps")
    assert warm.result.best_step == warm.result.steps


def test_the_callback_fits_a_classifier_by_cross_entropy():
    lightning.seed_everything(0, verbose=False)
    x = torch.randn(300, 2)
    labels = (x[:, 0] * x[:, 1] > 0).long()  # XOR: not linearly separable
    loader = DataLoader(TensorDataset(x, labels), batch_size=300)
    model = DVIClassifier(in_features=2, num_classes=2, hidden=[32], num_data=300)
    warm = PointEstimateWarmStart()
    _regression_trainer(warm, 1).fit(model, loader)
    assert warm.result is not None
    logits = point_forward(model.net, x)
    accuracy = float((logits.argmax(-1) == labels).float().mean())
    assert accuracy > 0.9 and warm.result.train_loss < 0.3


def test_the_callback_refuses_bad_settings():
    with pytest.raises(ValueError, match="patience"):
        PointEstimateWarmStart(patience=0)
    with pytest.raises(ValueError, match="holdout"):
        PointEstimateWarmStart(holdout=1.0)
