"""The validation-gated post-hoc calibration of DVIClassifier (issue 41 item 4).

``paired_choice`` against a hand-written oracle; ``calibrate_classifier`` / ``select_classifier``
fitted on the validation rows only, leaving the model bit-for-bit as trained when nothing
clears the gate; the default ``fit`` path (``calibrate=True``) and its checkpoints.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier
from lightning_dvi.callbacks import PredictiveCalibration, TemperatureScaling
from lightning_dvi.lightning.temperature import (
    calibrate_classifier,
    fit_temperature,
    fit_temperature_floor,
    floor_probs,
    paired_choice,
    select_classifier,
    temper_probs,
)
from lightning_dvi.nn import export_predictive
from lightning_dvi.nn.posthoc import scale_posterior


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen)
    noisy = x[:, 0] + 0.7 * torch.randn(n, generator=gen)
    return x, (noisy > 0).long() + (x[:, 1] > 0.5).long()


def _trained(epochs: int = 4, seed: int = 0, **kwargs: object) -> DVIClassifier:
    torch.manual_seed(seed)
    x, y = _data(256, 0)
    settings: dict[str, object] = {"lr": 1e-2, "calibrate": False, **kwargs}
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[16], num_data=256, **settings)  # type: ignore[arg-type]
    trainer = cpu_trainer(max_epochs=epochs, enable_checkpointing=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64))
    return model.eval()


def _label_nll(model: DVIClassifier, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    probs = model.predictive(x).double().numpy()
    return -np.log(np.take_along_axis(probs, y.numpy()[:, None], 1)[:, 0])


def test_paired_choice_matches_a_hand_written_oracle() -> None:
    rng = np.random.default_rng(0)
    ref = np.log(rng.uniform(0.2, 0.9, 200))
    noise = rng.standard_normal((2, 200))
    variants = [ref, ref + 0.02 + 0.05 * noise[0], ref + 0.05 + 0.01 * noise[1], ref - 0.01]
    variants.append(ref + 0.3 * rng.standard_normal(200))  # large mean gain possible, noisy
    for z in (0.0, 1.0, 2.0, 5.0, 1e9):
        kept, table = paired_choice([torch.from_numpy(v) for v in variants], z)
        beats = []
        for v, lp in enumerate(variants):
            d = lp - ref
            se = d.std(ddof=1) / math.sqrt(len(d))
            assert table[v] == pytest.approx((-lp.mean(), d.mean(), se), abs=1e-12)
            if v > 0 and d.mean() > z * se:
                beats.append(v)
        expected = min([0, *beats], key=lambda v: -variants[v].mean())
        assert kept == expected
    assert paired_choice([torch.from_numpy(v) for v in variants], 1e9)[0] == 0
    assert (
        paired_choice([torch.from_numpy(v) for v in variants], 0.0)[0] == 2
    )  # +0.05, little noise
    one = torch.tensor([-0.5])
    assert paired_choice([one, one + 1.0], 0.0)[0] == 0  # N = 1: an infinite standard error
    with pytest.raises(ValueError, match="paired_choice"):
        paired_choice([])
    with pytest.raises(ValueError, match="paired_choice"):
        paired_choice([torch.zeros(3), torch.zeros(4)])


def test_calibration_changes_nothing_when_no_variant_clears_the_gate() -> None:
    model = _trained()
    before = copy.deepcopy(model.state_dict())
    xv, yv = _data(120, 1)
    choice = calibrate_classifier(model, xv, yv, z=1e9)
    assert choice.chosen == 0 and choice.kept.kind == "trained"
    assert [v.kind for v in choice.variants] == [
        "trained",
        "temperature",
        "temperature+floor",
        "scale",
        "scale+temperature",
        "scale+temperature+floor",
    ]
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit
    # the variants were really fitted (else the gate proves nothing)
    assert all(v.temperature != 1.0 for v in choice.variants if "temperature" in v.kind)
    assert all(v.scale != 1.0 for v in choice.variants if "scale" in v.kind)


def test_calibration_fits_on_the_rows_it_is_given_and_writes_the_kept_variant() -> None:
    model = _trained()
    scale_posterior(model.net, 6.0)  # off the trained scales: some variant gains
    xv, yv = _data(300, 1)
    reference = _label_nll(model, xv, yv)
    trained = copy.deepcopy(model)
    choice = calibrate_classifier(model, xv, yv, z=0.0)
    kept = choice.kept
    assert kept.kind != "trained"
    # oracle: the written model scores the recorded validation NLL and paired gain
    nll = _label_nll(model, xv, yv)
    assert nll.mean() == pytest.approx(kept.val_nll, abs=1e-6)
    assert (reference - nll).mean() == pytest.approx(kept.gain, abs=1e-6)
    assert choice.variants[0].val_nll == pytest.approx(reference.mean(), abs=1e-6)
    # the temperature is fitted to the (scaled) validation predictive, not to other rows
    for v in choice.variants:
        if v.kind == "temperature":
            assert v.temperature == pytest.approx(
                fit_temperature(trained.predictive(xv), yv), rel=1e-6
            )
    # other rows give other numbers: the fit reads only the rows passed
    xt, yt = _data(256, 0)
    other = calibrate_classifier(copy.deepcopy(trained), xt, yt, z=0.0)
    assert other.variants[1].temperature != pytest.approx(choice.variants[1].temperature)
    # the written model is the trained one with c on its stds and T on its predictive
    scale_posterior(trained.net, kept.scale)
    expected = temper_probs(trained.predictive(xv), kept.temperature)
    assert torch.allclose(model.predictive(xv), expected, atol=1e-6)


def test_select_classifier_keeps_another_candidate_only_on_evidence() -> None:
    weak, strong = _trained(epochs=1, seed=1, lr=1e-4), _trained(epochs=6, seed=2)
    xv, yv = _data(300, 1)
    states = [copy.deepcopy(m.state_dict()) for m in (weak, strong)]
    choice = select_classifier([weak, strong], xv, yv, kinds=("temperature",))
    assert [(v.candidate, v.kind) for v in choice.variants] == [
        (0, "trained"),
        (0, "temperature"),
        (1, "trained"),
        (1, "temperature"),
    ]
    assert choice.kept.candidate == 1  # the barely trained reference loses clearly
    assert all(torch.equal(states[0][k], v) for k, v in weak.state_dict().items())
    assert float(strong.predictive_temperature) == pytest.approx(choice.kept.temperature, rel=1e-6)
    with pytest.raises(ValueError, match="select_classifier"):
        select_classifier([], xv, yv)
    with pytest.raises(ValueError, match="select_classifier"):
        select_classifier([weak], xv, yv, kinds=("nope",))  # type: ignore[arg-type]


def test_sample_mode_gets_the_temperature_variant_only() -> None:
    model = _trained(epochs=2, mode="sample", num_samples=2)
    xv, yv = _data(60, 1)
    torch.manual_seed(0)
    choice = calibrate_classifier(model, xv, yv, z=1e9)
    assert [v.kind for v in choice.variants] == ["trained", "temperature", "temperature+floor"]


class _Snapshot(Callback):
    """Copies the module at fit end, before the module's own on_fit_end (the calibration)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        self.model = copy.deepcopy(pl_module)


def test_default_fit_calibrates_on_the_validation_rows_and_checkpoints_keep_it(tmp_path) -> None:
    torch.manual_seed(0)
    (x, y), (xv, yv) = _data(256, 0), _data(200, 1)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[16], num_data=256, lr=1e-2)
    assert model.calibrate and model.hparams["calibrate"] is True
    snap = _Snapshot()
    trainer = cpu_trainer(max_epochs=3, callbacks=[snap], default_root_dir=tmp_path)
    train = DataLoader(TensorDataset(x, y), batch_size=64)
    trainer.fit(model, train, DataLoader(TensorDataset(xv, yv), batch_size=64))
    assert model.calibration is not None
    oracle = calibrate_classifier(snap.model.eval(), xv, yv)  # the same rule, by hand
    assert model.calibration == oracle
    model.eval()
    assert torch.allclose(model.predictive(xv), snap.model.predictive(xv), atol=1e-6)
    # a checkpoint saved after fit loads with weights_only=True and predicts the same
    path = tmp_path / "calibrated.ckpt"
    trainer.save_checkpoint(path)
    torch.load(path, weights_only=True)
    loaded = DVIClassifier.load_from_checkpoint(path).eval()
    assert torch.allclose(loaded.predictive(xv), model.predictive(xv), atol=1e-6)


def test_forced_calibration_is_saved_with_the_checkpoint(tmp_path) -> None:
    torch.manual_seed(0)
    (x, y), (xv, yv) = _data(256, 0), _data(200, 1)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[16], num_data=256, lr=1e-2)
    calibrator = PredictiveCalibration(z=0.0)  # any gain will do: something is written
    trainer = cpu_trainer(max_epochs=2, callbacks=[calibrator], default_root_dir=tmp_path)
    trainer.fit(
        model,
        DataLoader(TensorDataset(x, y), batch_size=64),
        DataLoader(TensorDataset(xv, yv), batch_size=64),
    )
    assert model.calibration is None  # the callback decided, not the module
    assert calibrator.choice is not None and calibrator.choice.kept.kind != "trained"
    path = tmp_path / "forced.ckpt"
    trainer.save_checkpoint(path)
    loaded = DVIClassifier.load_from_checkpoint(path).eval()
    model.eval()
    assert float(loaded.predictive_temperature) == pytest.approx(
        calibrator.choice.kept.temperature, rel=1e-6
    )
    assert torch.allclose(loaded.predictive(xv), model.predictive(xv), atol=1e-6)


@pytest.mark.parametrize("decider", ["module", "callback"])
def test_the_runs_last_checkpoint_predicts_what_the_calibrated_model_does(tmp_path, decider):
    # last.ckpt is written during training, before the calibration at the end of fit: it is
    # rewritten, so `predict --ckpt_path last` gives the probabilities behind the test metrics
    from lightning_dvi.callbacks import RunCheckpoint

    torch.manual_seed(0)
    (x, y), (xv, yv) = _data(256, 0), _data(200, 1)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[16], num_data=256, lr=1e-2)
    run = RunCheckpoint(dirpath=tmp_path / "ckpt")
    callbacks: list[Callback] = [run]
    if decider == "callback":
        callbacks.append(PredictiveCalibration(z=0.0))  # any gain: something is written
    else:
        snap = _Snapshot()
        callbacks.append(snap)
    trainer = cpu_trainer(max_epochs=2, callbacks=callbacks, default_root_dir=tmp_path)
    train = DataLoader(TensorDataset(x, y), batch_size=64)
    trainer.fit(model, train, DataLoader(TensorDataset(xv, yv), batch_size=64))
    choice = model.calibration if decider == "module" else callbacks[-1].choice  # type: ignore[attr-defined]
    assert choice is not None and choice.chosen != 0  # the calibration changed the model
    model.eval()
    loaded = DVIClassifier.load_from_checkpoint(run.last_model_path, weights_only=True).eval()
    assert torch.allclose(loaded.predictive(xv), model.predictive(xv), atol=1e-6)
    before = snap.model if decider == "module" else None
    if before is not None:  # and the file no longer holds the posterior as trained
        assert not torch.allclose(loaded.predictive(xv), before.eval().predictive(xv), atol=1e-3)


def test_without_validation_data_the_default_skips_and_the_callback_raises(tmp_path) -> None:
    x, y = _data(64, 0)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[4], num_data=64)
    before = copy.deepcopy(model.state_dict())
    cpu_trainer(max_steps=1, enable_checkpointing=False).fit(model, loader)
    assert model.calibration is None
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # trained
    with pytest.raises(ValueError, match="validation data"):
        trainer = cpu_trainer(
            max_steps=1, callbacks=[PredictiveCalibration()], enable_checkpointing=False
        )
        trainer.fit(DVIClassifier(in_features=5, num_classes=3, hidden=[4], num_data=64), loader)


def test_temperature_scaling_callback_takes_precedence_over_the_default(tmp_path) -> None:
    torch.manual_seed(0)
    (x, y), (xv, yv) = _data(128, 0), _data(96, 1)
    model = DVIClassifier(in_features=5, num_classes=3, hidden=[8], num_data=128, lr=1e-2)
    scaler = TemperatureScaling()
    trainer = cpu_trainer(max_epochs=2, callbacks=[scaler], enable_checkpointing=False)
    trainer.fit(
        model,
        DataLoader(TensorDataset(x, y), batch_size=32),
        DataLoader(TensorDataset(xv, yv), batch_size=32),
    )
    assert model.calibration is None
    assert float(model.predictive_temperature) == pytest.approx(scaler.result["temperature"])


def test_fit_temperature_floor_matches_a_grid_search_oracle() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(3000, 6, generator=gen, dtype=torch.float64)
    clean = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
    noisy = torch.rand(3000, generator=gen, dtype=torch.float64) < 0.15  # labels replaced
    y = torch.where(noisy, torch.randint(0, 6, (3000,), generator=gen), clean)
    probs = torch.softmax(logits / 1.5, -1)  # under-confident: T < 1 sharpens it back
    t, eps = fit_temperature_floor(probs, y)
    temps = torch.linspace(0.4, 1.2, 161, dtype=torch.float64)
    floors = torch.linspace(0.0, 0.4, 161, dtype=torch.float64)
    tempered = torch.softmax(probs.log()[None] / temps[:, None, None], -1)  # [G, N, K]
    picked = tempered.gather(-1, y.expand(len(temps), -1).unsqueeze(-1)).squeeze(-1)  # [G, N]
    mixed = (1 - floors[:, None, None]) * picked[None] + floors[:, None, None] / 6
    nll = -mixed.log().mean(-1)  # [F, G]
    f, g = divmod(int(nll.argmin()), len(temps))
    assert t == pytest.approx(float(temps[g]), abs=0.01)
    assert eps == pytest.approx(float(floors[f]), abs=0.005)
    assert 0.5 < t < 0.85 and 0.08 < eps < 0.2  # near the generating 1/1.5 and 0.15 * 5/6
    # without label noise the floor is not wanted: the temperature alone
    t_clean, eps_clean = fit_temperature_floor(probs, clean)
    assert eps_clean < 0.01 and t_clean == pytest.approx(fit_temperature(probs, clean), rel=0.05)
    assert torch.allclose(floor_probs(probs, 0.3).sum(-1), torch.ones(3000, dtype=torch.float64))


def test_the_floor_is_applied_saved_and_exported() -> None:
    model = _trained()
    xv = _data(80, 1)[0]
    plain = model.predictive(xv)
    model.predictive_temperature.fill_(0.8)
    model.predictive_floor.fill_(0.1)
    expected = floor_probs(temper_probs(plain, 0.8), 0.1)
    assert torch.allclose(model.predictive(xv), expected, atol=1e-6)
    exported = export_predictive(model, mode="diag")
    assert torch.allclose(exported(xv), expected, atol=1e-5)
    state = model.state_dict()
    assert float(state["predictive_floor"]) == pytest.approx(0.1)
    # a state from before the floor existed loads with no floor
    del state["predictive_floor"]
    fresh = DVIClassifier(in_features=5, num_classes=3, hidden=[16], num_data=256)
    fresh.on_load_checkpoint({"state_dict": state})
    fresh.load_state_dict(state)
    assert float(fresh.predictive_floor) == 0.0
