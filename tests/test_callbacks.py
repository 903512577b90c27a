"""The empirical-Bayes callback (schedule, state, logging) and the plot callbacks."""

import pytest
from helpers import cpu_trainer

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.callbacks import (
    CalibrationPlot,
    EmpiricalBayes,
    PredictiveBandPlot,
    ReliabilityDiagram,
)
from lightning_dvi.data import DigitsDataModule, ToyHeteroscedasticDataModule
from lightning_dvi.priors import named_parameter_groups


def _trainer(tmp_path=None, **kwargs):
    defaults = dict(enable_checkpointing=False, log_every_n_steps=1)
    if tmp_path is not None:
        defaults["default_root_dir"] = tmp_path
    return cpu_trainer(**{**defaults, **kwargs})


def _toy():
    return ToyHeteroscedasticDataModule(num_train=32, num_val=16, num_test=16, batch_size=8)


def _variances(model):
    return {name: float(g.prior_variance) for name, g in named_parameter_groups(model.net)}


def test_schedule():
    eb = EmpiricalBayes(every_n_steps=3, warmup_steps=2, freeze_after_steps=9)
    assert [s for s in range(12) if eb.should_refresh(s)] == [2, 5, 8]
    assert [s for s in range(5) if EmpiricalBayes().should_refresh(s)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_n_steps": 0},
        {"warmup_steps": -1},
        {"freeze_after_steps": -2},
        {"every_n_steps": 1.5},
    ],
)
def test_rejects_bad_schedules(kwargs):
    with pytest.raises(ValueError):
        EmpiricalBayes(**kwargs)


def test_state_round_trip_and_key():
    eb = EmpiricalBayes(every_n_steps=4)
    eb.last_refresh_step, eb.num_refreshes = 8, 3
    other = EmpiricalBayes(every_n_steps=4)
    other.load_state_dict(eb.state_dict())
    assert (other.last_refresh_step, other.num_refreshes) == (8, 3)
    assert eb.state_key == other.state_key != EmpiricalBayes(every_n_steps=5).state_key
    assert "every_n_steps" in eb.state_key


def test_buffer_mode_refreshes_on_schedule():
    model = DVIRegressor(in_features=1, hidden=[8], eb_mode="buffer", prior_variance=1.0)
    eb = EmpiricalBayes(every_n_steps=2, warmup_steps=1, freeze_after_steps=6)
    # Gradient accumulation: several batches share one optimiser step; refresh once per step.
    trainer = _trainer(max_steps=8, callbacks=[eb], limit_val_batches=0, accumulate_grad_batches=2)
    trainer.fit(model, _toy())
    assert eb.num_refreshes == 3  # steps 1, 3, 5
    assert eb.last_refresh_step == 5
    values = _variances(model)
    assert all(v != 1.0 for v in values.values())
    assert set(trainer.callback_metrics) >= {f"prior_variance/{n}" for n in values}


def test_buffer_mode_buffers_equal_the_optimum_right_after_a_refresh():
    model = DVIRegressor(in_features=1, hidden=[8], eb_mode="buffer")
    eb = EmpiricalBayes()
    trainer = _trainer(max_steps=1, callbacks=[eb], limit_val_batches=0)
    before = {
        n: (g.loc.detach().clone(), g.scale.detach().clone())
        for n, g in named_parameter_groups(model.net)
    }
    trainer.fit(model, _toy())
    # The refresh ran before step 0's update, from the initial parameters.
    for name, value in _variances(model).items():
        expected = model.prior.optimal_variance(*before[name])
        assert value == pytest.approx(float(expected), rel=1e-6)


def test_in_graph_mode_only_logs():
    model = DVIRegressor(in_features=1, hidden=[8], eb_mode="in_graph")
    eb = EmpiricalBayes(every_n_steps=1)
    trainer = _trainer(max_steps=2, callbacks=[eb], limit_val_batches=0)
    trainer.fit(model, _toy())
    assert eb.num_refreshes == 0
    logged = {
        k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("prior_variance/")
    }
    assert len(logged) == 4
    # In-graph: the values logged after step 1 are the optimum at the parameters step 1 saw.
    assert all(v > 0 for v in logged.values())


def test_gaussian_prior_warns():
    model = DVIRegressor(in_features=1, hidden=[4], prior="gaussian", prior_variance=0.5)
    with pytest.warns(UserWarning, match="not empirical"):
        _trainer(max_steps=1, callbacks=[EmpiricalBayes()], limit_val_batches=0).fit(model, _toy())
    assert set(_variances(model).values()) == {0.5}


def test_regression_plots_are_written(tmp_path):
    model = DVIRegressor(in_features=1, hidden=[8], lr=0.01)
    band, calibration = PredictiveBandPlot(num_grid=50), CalibrationPlot()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[band, calibration])
    dm = _toy()
    trainer.fit(model, dm)
    trainer.test(model, dm)
    for name in ("predictive_band.png", "calibration_val.png", "calibration_test.png"):
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 1000
    assert band.path == tmp_path / "predictive_band.png"


def test_band_plot_skips_multidimensional_inputs(tmp_path):
    dm = DigitsDataModule(batch_size=512)
    model = DVIRegressor(in_features=64, hidden=[4], num_data=dm.num_train)
    x, y = dm.train_dataset.tensors
    dm.train_dataset.tensors = (x, y.float())
    with pytest.warns(UserWarning, match="1-D inputs"):
        _trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[PredictiveBandPlot()]).fit(
            model, dm
        )
    assert not (tmp_path / "predictive_band.png").exists()


def test_reliability_diagram_is_written(tmp_path):
    dm = DigitsDataModule(batch_size=256)
    model = DVIClassifier(in_features=64, num_classes=10, hidden=[8], mode="diag")
    trainer = _trainer(
        tmp_path,
        max_epochs=1,
        limit_train_batches=2,
        limit_test_batches=1,
        callbacks=[ReliabilityDiagram()],
    )
    trainer.fit(model, dm)
    trainer.test(model, dm)
    for name in ("reliability_val.png", "reliability_test.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_callback_needs_a_dvi_module():
    from lightning.pytorch.demos.boring_classes import BoringModel

    with pytest.raises(ValueError, match="`net` and `prior`"):
        _trainer(max_steps=1, callbacks=[EmpiricalBayes()]).fit(BoringModel())


def test_callbacks_importable_from_both_paths():
    import lightning_dvi.lightning as front_end

    assert front_end.EmpiricalBayes is EmpiricalBayes
    assert front_end.PredictiveBandPlot is PredictiveBandPlot
