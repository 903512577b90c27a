"""The outcome transform (one owner of target units) and the datamodule protocol (issue 40 item 1)."""

import io
import math

import numpy as np
import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch import Callback, LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.data import TargetStatistics, ToyHeteroscedasticDataModule
from lightning_dvi.data._base import fit_standardizer
from lightning_dvi.lightning._base import logs_this_step
from lightning_dvi.nn import export_predictive
from lightning_dvi.nn.export import ProvidesPredictive
from lightning_dvi.transforms import Standardize, location_scale

F64 = torch.float64


def test_round_trip_and_moments_in_original_units():
    y = torch.tensor([3.0, 7.5, -1.25, 10.0], dtype=F64)
    t = Standardize().fit(y)
    assert float(t.loc) == float(y.mean()) and float(t.scale) == float(y.std(correction=0))
    z = t(y)
    assert abs(float(z.mean())) < 1e-15 and float(z.std(correction=0)) == pytest.approx(1, 1e-15)
    mean, var = t.untransform(z, torch.ones(4, dtype=F64))
    torch.testing.assert_close(mean, y, rtol=0, atol=1e-14)
    torch.testing.assert_close(var, t.scale.square().expand(4))
    # batches that already hold standardised targets pass through, and map back
    pre = Standardize(float(t.loc), float(t.scale), batches_standardized=True)
    torch.testing.assert_close(pre(z), z, rtol=0, atol=0)
    torch.testing.assert_close(pre.original_targets(z), y, rtol=0, atol=1e-14)


def test_untransformed_log_density_is_the_change_of_variables():
    # the density of y = m + s * y_std, with y_std ~ N(mu, sigma^2): exactly N(m + s mu, s^2 sigma^2)
    t = Standardize(4.0, 2.5)
    mu, sigma = torch.tensor([0.3, -1.0], dtype=F64), torch.tensor([0.7, 1.4], dtype=F64)
    y = torch.tensor([5.1, -0.2], dtype=F64)
    standard = torch.distributions.Normal(mu, sigma).log_prob(t.transform(y))
    mean, var = t.untransform(mu, sigma.square())
    exact = torch.distributions.Normal(mean, var.sqrt()).log_prob(y)
    torch.testing.assert_close(t.untransform_log_prob(standard), exact, rtol=0, atol=1e-13)


def test_untransformed_log_density_integrates_to_one_by_monte_carlo():
    # E_{y~q}[p(y) / q(y)] = 1 for q a wide proposal in original units
    t = Standardize(-3.0, 0.2)
    gen = torch.Generator().manual_seed(0)
    q = torch.distributions.Normal(torch.tensor(-3.0, dtype=F64), torch.tensor(0.5, dtype=F64))
    y = q.mean + q.stddev * torch.randn(400_000, generator=gen, dtype=F64)
    standard = torch.distributions.Normal(0.1, 0.9).log_prob(t.transform(y))
    ratio = (t.untransform_log_prob(standard) - q.log_prob(y)).exp()
    assert float(ratio.mean()) == pytest.approx(1.0, abs=5 * float(ratio.std()) / math.sqrt(4e5))


def test_float64_all_the_way_and_overflow_named():
    t = Standardize(1e8, 1.0)
    y = torch.tensor([1e8 + 0.5], dtype=F64)
    assert float(t.untransform(t(y, torch.float32), torch.zeros(1))[0]) == 1e8 + 0.5
    with pytest.raises(ValueError, match=r"does not fit in torch\.float32"):
        Standardize(0.0, 1.0)(torch.tensor([1e39], dtype=F64), torch.float32)


def test_saved_as_plain_tensors_and_reloaded_with_weights_only():
    t = Standardize().fit(torch.tensor([1.0, 2.0, 4.0]))
    buffer = io.BytesIO()
    torch.save(t.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state) == {"loc", "scale"} and state["loc"].dtype == F64
    loaded = Standardize()
    loaded.load_state_dict(state)
    assert (float(loaded.loc), float(loaded.scale)) == (float(t.loc), float(t.scale))


def test_one_fitting_function_for_the_data_modules_and_the_regressor():
    gen = np.random.default_rng(0)
    values = gen.normal(5.0, 3.0, size=(50, 3))
    values[:, 2] = 7.0  # constant: scale 1
    loc, scale = fit_standardizer(values)
    np.testing.assert_allclose(loc, values.mean(0), rtol=1e-13)
    np.testing.assert_allclose(scale[:2], values[:, :2].std(0), rtol=1e-13)
    assert scale[2] == 1.0
    huge = np.array([[1e308], [-1e308], [5e307]])  # sums overflow float64
    huge_loc, huge_scale = fit_standardizer(huge)
    np.testing.assert_allclose(huge_loc, [5e307 / 3], rtol=1e-12)
    assert np.isfinite(huge_scale).all()
    t = Standardize().fit(torch.from_numpy(values[:, 0]))
    one_loc, one_scale = location_scale(torch.from_numpy(values[:, 0]))
    assert (float(t.loc), float(t.scale)) == (float(one_loc), float(one_scale))


def test_the_regressor_owns_one_transform_with_the_checkpoint_names():
    model = DVIRegressor(in_features=2, hidden=[4], target_loc=2.0, target_scale=3.0)
    assert isinstance(model.outcome_transform, Standardize)
    assert model.target_loc is model.outcome_transform.loc
    state = model.state_dict()
    assert {"target_loc", "target_scale"} <= set(state)
    assert not any(k.startswith("outcome_transform.") for k in state)
    fresh = DVIRegressor(in_features=2, hidden=[4])
    fresh.load_state_dict(state)  # the names checkpoints of every version use
    assert (float(fresh.target_loc), float(fresh.target_scale)) == (2.0, 3.0)


def test_export_reads_the_declared_parts_not_attributes():
    model = DVIRegressor(in_features=2, hidden=[4], target_loc=2.0, target_scale=3.0).double()
    assert isinstance(model, ProvidesPredictive)
    assert isinstance(DVIClassifier(in_features=2, num_classes=3, hidden=[4]), ProvidesPredictive)
    x = torch.randn(5, 2, dtype=F64)
    mean, var = export_predictive(model, mode="diag")(x)
    expected = model.predictive(x, "closed_form")
    torch.testing.assert_close(mean, expected[0])
    torch.testing.assert_close(var, expected[1])

    class HasNetAttributes(torch.nn.Module):  # duck-typed .net/.likelihood are not enough now
        def __init__(self) -> None:
            super().__init__()
            self.net, self.likelihood = model.net, model.likelihood

    with pytest.raises(ValueError, match=r"needs a lightning_dvi\.nn network"):
        export_predictive(HasNetAttributes())


class _UserTargets(LightningDataModule):
    """A user's own datamodule implementing TargetStatistics (no library base class)."""

    def __init__(self, x, y, declare=("target_loc", "target_scale", "targets_standardized")):
        super().__init__()
        self.x, self.y = x, y
        if "target_loc" in declare:
            self.target_loc = float(y.mean()) + 1.0  # deliberately not the data's: it must win
        if "target_scale" in declare:
            self.target_scale = 2.0
        if "targets_standardized" in declare:
            self.targets_standardized = False

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8)


def _xy():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, generator=gen)
    return x, 3 * x[:, 0] + 10


def test_a_user_datamodule_implementing_the_protocol_is_read():
    x, y = _xy()
    dm = _UserTargets(x, y)
    assert isinstance(dm, TargetStatistics)
    assert isinstance(ToyHeteroscedasticDataModule(num_train=8, batch_size=8), TargetStatistics)
    model = DVIRegressor(hidden=[4])
    cpu_trainer(fast_dev_run=1).fit(model, dm)
    assert float(model.target_loc) == pytest.approx(float(y.mean()) + 1.0)
    assert float(model.target_scale) == 2.0 and model.hparams.target_scale == 2.0


def test_a_datamodule_with_part_of_the_protocol_fails_clearly():
    x, y = _xy()
    dm = _UserTargets(x, y, declare=("target_loc",))
    assert not isinstance(dm, TargetStatistics)
    with pytest.raises(
        ValueError, match="has target_loc but not target_scale, targets_standardized"
    ):
        cpu_trainer(fast_dev_run=1).fit(DVIRegressor(hidden=[4]), dm)


def test_a_datamodule_without_the_protocol_leaves_the_fit_to_the_training_targets():
    x, y = _xy()
    dm = _UserTargets(x, y, declare=())
    model = DVIRegressor(hidden=[4])
    cpu_trainer(fast_dev_run=1).fit(model, dm)
    loc, scale = location_scale(y)
    assert (float(model.target_loc), float(model.target_scale)) == (float(loc), float(scale))


class _LogsThisStep(Callback):
    """Records the library's answer next to Lightning's own (read privately, as the oracle)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[bool, bool]] = []

    def _record(self, trainer) -> None:
        oracle = trainer._logger_connector.should_update_logs
        self.pairs.append((logs_this_step(trainer), bool(oracle)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._record(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer)


def test_logs_this_step_agrees_with_lightning_from_public_counters():
    x, y = _xy()
    record = _LogsThisStep()
    loader = DataLoader(TensorDataset(x, y), batch_size=3)  # 6 batches an epoch
    trainer = cpu_trainer(max_epochs=2, log_every_n_steps=4, callbacks=[record])
    trainer.fit(DVIRegressor(in_features=2, hidden=[4]), loader)
    assert len(record.pairs) == 24
    assert [ours for ours, _ in record.pairs] == [theirs for _, theirs in record.pairs]
    assert sum(ours for ours, _ in record.pairs) == 6  # steps 4, 8, 12: before and after each
