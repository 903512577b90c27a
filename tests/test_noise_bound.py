"""The heteroscedastic predictive far from the data (issue 44, item 3): finite, bounded, saved.

A model trained on x in [-1, 1] used to predict a noise std of 1e14 at x = 10 and ``inf`` at
x = 100 (E[e^l] = exp(<l> + S_ll/2) overflowing float32), with no warning.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import warnings

import lightning
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor
from lightning_dvi.likelihoods import HeteroscedasticGaussian, NoiseBoundWarning
from lightning_dvi.likelihoods import functional as F
from lightning_dvi.nn import export_predictive, mlp

FAR = torch.tensor([[0.0], [5.0], [10.0], [100.0], [1e4]])


def _net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp(1, [16], 2).to(dtype)


def _sine(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(n, 1, generator=gen) - 1
    return x, torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(n, generator=gen)


def _fit(tmp_path, **kwargs) -> tuple[DVIRegressor, lightning.Trainer]:
    kwargs.setdefault("noise_bound", "training_range")
    x, y = _sine()
    lightning.seed_everything(0, verbose=False)
    model = DVIRegressor(in_features=1, hidden=[16], num_data=len(x), lr=1e-2, **kwargs)
    trainer = lightning.Trainer(
        max_epochs=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lightning.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    return model.eval(), trainer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bound", ["none", "training_range"])
def test_far_inputs_give_a_finite_variance_and_a_warning_naming_the_rows(dtype, bound):
    net = _net(dtype)
    lik = HeteroscedasticGaussian(noise_bound=bound)
    lik.record_noise_range(net(2 * torch.rand(200, 1, dtype=dtype) - 1, mode="full"))
    far = FAR.to(dtype)
    for mode in ("full", "diag"):
        with pytest.warns(NoiseBoundWarning, match=r"rows? \((\d+, )*4\)"):
            var = lik.predictive(net(far, mode=mode)).variance
        assert var.dtype == dtype and bool(torch.isfinite(var).all()), (mode, var)
    if bound == "training_range":  # the noise stays at the training range's scale
        noise = var - lik.epistemic_variance(net(far, mode="diag"))
        high = lik.noise_range[1] + 0.5 * lik.noise_range[2] + 1.5 * torch.log(torch.tensor(2.0))
        assert bool((noise <= high.exp().to(dtype) + 1e-5 * var).all())  # var's rounding


def test_the_unbounded_variance_overflows_without_the_cap():
    """The case above is a real overflow: the model's exact E[e^l] is inf in float32 there."""
    net = _net(torch.float32)
    out = net(FAR, mode="full")
    _, exact = F.heteroscedastic_predictive_moments(
        out.mean[..., 0], out.var[..., 0], out.mean[..., 1], out.var[..., 1]
    )
    assert not bool(torch.isfinite(exact[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inside_the_training_range_the_bound_changes_nothing(dtype):
    net = _net(dtype)
    gen = torch.Generator().manual_seed(1)
    x_train = 2 * torch.rand(300, 1, generator=gen, dtype=dtype) - 1
    lik = HeteroscedasticGaussian(noise_bound="training_range")
    lik.record_noise_range(net(x_train, mode="full"))
    inside = torch.cat([x_train, torch.linspace(-1, 1, 1001, dtype=dtype)[:, None]])
    for mode in ("full", "diag"):
        out = net(inside, mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoiseBoundWarning)  # nothing bounded, nothing said
            dist = lik.predictive(out)
        mean, var = F.heteroscedastic_predictive_moments(  # the formula before the bound
            out.mean[..., 0], out.var[..., 0], out.mean[..., 1], out.var[..., 1]
        )
        torch.testing.assert_close(dist.mean, mean, rtol=0, atol=0)
        torch.testing.assert_close(dist.variance, var, rtol=1e-6, atol=0)


def test_an_unrecorded_or_switched_off_bound_is_the_exact_model():
    net = _net(torch.float64)
    out = net(torch.tensor([[3.0], [-4.0]], dtype=torch.float64), mode="full")
    expected = F.heteroscedastic_predictive_moments(
        out.mean[..., 0], out.var[..., 0], out.mean[..., 1], out.var[..., 1]
    )[1]
    fresh = HeteroscedasticGaussian(noise_bound="training_range")
    assert not fresh.noise_range_recorded
    off = HeteroscedasticGaussian(noise_bound="none")
    off.record_noise_range(net(torch.zeros(4, 1, dtype=torch.float64), mode="full"))
    for lik in (fresh, off):
        torch.testing.assert_close(lik.predictive(out).variance, expected, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="noise_bound must be one of"):
        HeteroscedasticGaussian(noise_bound="softplus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_bound"):
        DVIRegressor(in_features=1, noise_bound="clamp")  # type: ignore[arg-type]


def test_the_issue_table_has_no_inf_at_x_100(tmp_path):
    """The issue's models, trained briefly on sin(3x): finite std at x = 100, bounded noise."""
    model, _ = _fit(tmp_path)
    assert model.likelihood.noise_range_recorded  # recorded at the end of fit
    with pytest.warns(NoiseBoundWarning):
        mean, var = model.predictive(FAR)
    assert bool(torch.isfinite(var).all()) and bool(torch.isfinite(mean).all())
    with pytest.warns(NoiseBoundWarning):
        aleatoric, _ = model.variance_decomposition(FAR)
    _, hi, v_hi = model.likelihood.noise_range.double().tolist()
    widest = math.exp(hi + math.log(2) + 0.5 * (v_hi + math.log(2)))  # the bound and its margin
    assert bool((aleatoric <= widest * model.target_scale**2 * (1 + 1e-5) + 1e-5 * var).all())
    homo = DVIRegressor(in_features=1, hidden=[16], num_data=64, likelihood="homoscedastic")
    assert bool(torch.isfinite(homo.predictive(FAR)[1]).all())


def test_the_default_is_unbounded_but_finite(tmp_path):
    """Chosen by measurement (docs/lightning.md): the exact noise, capped only at the overflow."""
    assert HeteroscedasticGaussian().noise_bound == "none"
    model, _ = _fit(tmp_path, noise_bound="none")
    assert model.likelihood.noise_bound == "none"
    assert not model.likelihood.noise_range_recorded  # no extra pass over the data for "none"
    with pytest.warns(NoiseBoundWarning, match="overflows"):
        _, var = model.predictive(FAR)
    assert bool(torch.isfinite(var).all())
    # bounding it afterwards: switch, and record the range on the training inputs
    model.likelihood.noise_bound = "training_range"
    with torch.no_grad():
        model.likelihood.record_noise_range(model.net(_sine()[0], mode=model.mode))
    with pytest.warns(NoiseBoundWarning, match="bounded to it"):
        _, bounded = model.predictive(FAR)
    assert bool((bounded[-1] < var[-1]).all())


def test_the_bound_round_trips_through_checkpoints(tmp_path):
    model, trainer = _fit(tmp_path)
    # a checkpoint written during fit holds the range of the weights it holds (plain tensors)
    raw = torch.load(tmp_path / "last.ckpt", weights_only=True)
    saved = raw["state_dict"]["likelihood.noise_range"]
    assert type(saved) is torch.Tensor and bool(torch.isfinite(saved).all())
    torch.testing.assert_close(saved, model.likelihood.noise_range, rtol=0, atol=0)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    for name in ("last.ckpt", "after.ckpt"):
        loaded = DVIRegressor.load_from_checkpoint(tmp_path / name, weights_only=True).eval()
        assert loaded.likelihood.noise_bound == "training_range"
        torch.testing.assert_close(loaded.likelihood.noise_range, model.likelihood.noise_range)
        with pytest.warns(NoiseBoundWarning):
            torch.testing.assert_close(loaded.predictive(FAR), model.predictive(FAR))
    off = DVIRegressor.load_from_checkpoint(tmp_path / "after.ckpt", noise_bound="none")
    assert off.likelihood.noise_bound == "none"
    # a checkpoint from before the bound (no noise_range) loads strictly, as "not recorded"
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("noise_range")}
    old = DVIRegressor(in_features=1, hidden=[16], num_data=64)
    old.load_state_dict(state, strict=True)
    assert not old.likelihood.noise_range_recorded


def test_the_bound_travels_with_the_exported_predictive(tmp_path):
    model, _ = _fit(tmp_path)
    with pytest.warns(NoiseBoundWarning):
        mean, var = model.predictive(FAR)
    export_predictive(model).save(str(tmp_path / "reg.pt2"), FAR[:2])
    export_predictive(model).save(str(tmp_path / "reg.onnx"), FAR[:2])
    # run the files in a fresh process, as a served model is
    script = textwrap.dedent(
        f"""
        import json, numpy as np, torch, onnxruntime as ort
        x = torch.tensor({FAR.tolist()})
        pt2 = torch.export.load(r"{tmp_path / "reg.pt2"}").module()(x)
        sess = ort.InferenceSession(r"{tmp_path / "reg.onnx"}")
        onnx = sess.run(None, {{sess.get_inputs()[0].name: x.numpy()}})
        print(json.dumps([[t.tolist() for t in pt2], [a.tolist() for a in onnx]]))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )

    pt2, onnx = json.loads(run.stdout.strip().splitlines()[-1])
    for got in (pt2, onnx):
        got_mean, got_var = torch.tensor(got[0]), torch.tensor(got[1])
        assert bool(torch.isfinite(got_var).all())
        torch.testing.assert_close(got_mean, mean.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_var, var.float(), rtol=1e-5, atol=1e-5)
    # unbounded export: still finite (capped below float32's overflow)
    model.likelihood.noise_bound = "none"
    unbounded = export_predictive(model)(FAR)[1]
    assert bool(torch.isfinite(unbounded).all()) and bool((unbounded[-1] > var[-1]).all())


def test_the_monte_carlo_predictive_is_finite_far_out():
    torch.manual_seed(0)
    model = DVIRegressor(in_features=1, hidden=[16], num_data=64, mode="local", num_samples=8)
    with pytest.warns(NoiseBoundWarning, match=r"rows? \((\d+, )*4\)"):
        _, var = model.predictive(FAR * 100)
    assert bool(torch.isfinite(var).all())


def test_a_bounded_row_warns_once_per_metrics_update_and_per_log_density():
    """The metrics build the predictive twice (moments, then its float64 density): one warning."""
    torch.manual_seed(0)
    model = DVIRegressor(in_features=1, hidden=[8], target_loc=0.0, target_scale=1.0)
    model.likelihood.noise_bound = "training_range"
    model.likelihood.record_noise_range(model.net(torch.linspace(-1, 1, 20)[:, None], mode="full"))
    x, y = torch.tensor([[50.0], [0.0]]), torch.zeros(2)
    for call in (
        lambda: model._update_metrics(model.test_metrics, x, y),
        lambda: model.predictive_log_prob(x, y),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        bounded = [w for w in caught if issubclass(w.category, NoiseBoundWarning)]
        assert len(bounded) == 1 and "1 row (0)" in str(bounded[0].message)
