"""The deterministic-optimiser path: L-BFGS through Lightning's closure, the convergence test."""

import math
import warnings

import pytest
import torch
from helpers import PoisonWeight, cpu_trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.lightning._convergence import ObjectiveConvergence
from lightning_dvi.optim import LBFGS


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread: a second one only contends for the 2 shared cores (minutes, not seconds)."""


def _diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_diabetes

    return tuple(torch.tensor(a, dtype=torch.float32) for a in load_diabetes(return_X_y=True))


def _full_batch(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=len(x))


def _trainer(**kwargs):
    return cpu_trainer(**{"enable_checkpointing": False, **kwargs})


def _train_loss(model: DVIRegressor, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model._elbo((x, y), 1.0, "val").loss)


def test_lbfgs_converges_on_diabetes_through_the_trainer():
    """The README's L-BFGS snippet: it stops on its criterion, well before the epoch budget."""
    x, y = _diabetes()
    record = _Losses()
    model = DVIRegressor(hidden=[50], optimizer="lbfgs", convergence_tol=1e-6)
    trainer = _trainer(max_epochs=200, callbacks=[record])
    trainer.fit(model, train_dataloaders=_full_batch(x, y))
    assert model.converged and trainer.current_epoch < 200
    # the stated criterion, checked on the recorded objectives: it held at the last epoch only
    changes = [
        abs(b - a) / max(1.0, abs(b))
        for a, b in zip(record.losses, record.losses[1:], strict=False)
    ]
    assert changes[-1] <= 1e-6 and all(c > 1e-6 for c in changes[:-1])
    # and a fit worth having: the predictive beats the unconditional N(mean, var) of y
    mean, var = model.predictive(x)
    ll = torch.distributions.Normal(mean, var.sqrt()).log_prob(y.double()).mean()
    baseline = torch.distributions.Normal(y.double().mean(), y.double().std()).log_prob(y.double())
    assert float(ll) > float(baseline.mean()) + 0.3


def test_lbfgs_reaches_a_lower_objective_than_adam_in_the_same_epochs():
    x, y = _diabetes()
    losses = {}
    for optimizer in ("adam", "lbfgs"):
        torch.manual_seed(0)
        model = DVIRegressor(hidden=[8], optimizer=optimizer, lr=1e-2, lbfgs_iterations=10)
        _trainer(max_epochs=5).fit(model, train_dataloaders=_full_batch(x, y))
        losses[optimizer] = _train_loss(model, x, y)
    assert losses["lbfgs"] < losses["adam"] - 0.1


def test_lbfgs_trains_the_classifier_too():
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()
    model = DVIClassifier(
        hidden=[8], num_classes=2, mode="diag", optimizer="lbfgs", lbfgs_iterations=5
    )
    _trainer(max_epochs=2).fit(model, train_dataloaders=_full_batch(x, y))
    accuracy = (model.predictive(x).argmax(-1) == y).float().mean()
    assert float(accuracy) > 0.8


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class _History(Callback):
    def __init__(self) -> None:
        self.iterations: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = trainer.optimizers[0].state
        self.iterations.append(next(iter(state.values()))["n_iter"])


def test_lbfgs_forgets_its_curvature_when_the_kl_weight_changes():
    """The warm-up changes the objective at step 2: the next step starts with no curvature pairs."""
    x, y = _diabetes()
    record = _History()
    model = DVIRegressor(
        hidden=[8], optimizer="lbfgs", lbfgs_iterations=5, kl_warmup_steps=2, kl_anneal_steps=0
    )
    _trainer(max_epochs=4, callbacks=[record]).fit(model, train_dataloaders=_full_batch(x, y))
    # L-BFGS counts its iterations in its state: the count restarts with the KL at step 2
    first, second, third, fourth = record.iterations
    assert 0 < first < second and third <= 5 and third < second and fourth > third


def test_lbfgs_rejects_what_breaks_its_line_search():
    with pytest.raises(ValueError, match="needs a deterministic objective"):
        DVIRegressor(in_features=2, hidden=[4], mode="sample", optimizer="lbfgs")
    with pytest.raises(ValueError, match="takes no lr_schedule or weight_decay"):
        DVIRegressor(in_features=2, hidden=[4], optimizer="lbfgs", lr_schedule="cosine")
    with pytest.raises(ValueError, match="takes no lr_schedule or weight_decay"):
        DVIRegressor(in_features=2, hidden=[4], optimizer="lbfgs", weight_decay=1e-4)
    with pytest.raises(ValueError, match="optimizer"):
        DVIRegressor(in_features=2, hidden=[4], optimizer="sgd")
    for name in ("lbfgs_iterations", "lbfgs_history"):
        with pytest.raises(ValueError, match=name):
            DVIRegressor(in_features=2, hidden=[4], optimizer="lbfgs", **{name: 0})
    with pytest.raises(ValueError, match="convergence_tol"):
        DVIRegressor(in_features=2, hidden=[4], convergence_tol=0.0)
    x = torch.randn(16, 2)
    y = x[:, 0] + 0.1 * torch.randn(16)
    model = DVIRegressor(hidden=[4], optimizer="lbfgs")
    with pytest.raises(ValueError, match="cannot be combined with gradient clipping"):
        _trainer(max_epochs=1, gradient_clip_val=1.0).fit(model, _full_batch(x, y))
    model = DVIRegressor(hidden=[4], optimizer="lbfgs")
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        _trainer(max_epochs=1, accumulate_grad_batches=2).fit(model, _full_batch(x, y))
    model = DVIRegressor(hidden=[4], optimizer="lbfgs")
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    with pytest.warns(UserWarning, match="sees 4 batches per epoch"):
        _trainer(max_steps=1).fit(model, loader)


def test_adam_defaults_are_unchanged():
    """Explicit Adam settings build the same optimiser as before the L-BFGS option."""
    model = DVIRegressor(in_features=2, hidden=[4], lr=0.05, weight_decay=1e-3)
    optimiser = model.configure_optimizers()
    assert isinstance(optimiser, torch.optim.Adam)
    assert optimiser.defaults["lr"] == 0.05 and optimiser.defaults["weight_decay"] == 1e-3
    assert model.hparams["optimizer"] == "adam" and model.hparams["convergence_tol"] is None


def test_convergence_counts_only_epochs_at_the_final_kl_weight():
    conv = ObjectiveConvergence(1e-4)
    for value, final in ((5.0, False), (5.0, False), (4.0, True)):
        conv.add(torch.tensor(value))
        assert not conv.epoch_end(final)  # flat during the warm-up means nothing
    conv.add(torch.tensor(4.001))
    assert not conv.epoch_end(True)  # changed by 1e-3 > 1e-4 * 4
    conv.add(torch.tensor(4.0011))
    assert conv.epoch_end(True)  # changed by 1e-4 <= 1e-4 * 4.0011
    conv.add(torch.tensor(math.nan))
    assert not conv.epoch_end(True)
    assert not ObjectiveConvergence(None).enabled


def test_a_non_finite_lbfgs_step_is_undone_once_then_an_error():
    x, y = _diabetes()
    model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
    trainer = _trainer(max_epochs=4, callbacks=[PoisonWeight({2})])
    with pytest.warns(UserWarning, match="left non-finite parameters"):
        trainer.fit(model, train_dataloaders=_full_batch(x, y))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
    trainer = _trainer(max_epochs=4, callbacks=[PoisonWeight({2, 3})])
    with pytest.raises(FloatingPointError, match="also after restarting it"):
        trainer.fit(model, train_dataloaders=_full_batch(x, y))


def test_an_lbfgs_step_that_never_moves_is_reported_after_a_restart(monkeypatch):
    """A step that leaves the parameters where they were: memory cleared, then a warning.

    The optimiser's step is replaced by one that only evaluates the closure, as a search that
    finds no decrease does: step 1 clears the curvature memory silently; step 2, after that
    restart, still does not move, with the gradient as large as at the start: a warning, once.
    """

    def stalled_step(self, closure):
        with torch.enable_grad():
            return closure()

    monkeypatch.setattr(LBFGS, "step", stalled_step)
    x, y = _diabetes()
    model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
    with pytest.warns(UserWarning, match="L-BFGS step 2 did not move the parameters") as record:
        _trainer(max_epochs=4).fit(model, train_dataloaders=_full_batch(x, y))
    assert sum("did not move" in str(w.message) for w in record) == 1  # once per fit


class _StiffStart(DVIRegressor):
    r"""A DVIRegressor whose training loss is :math:`\tfrac12(10^8 a^2 + b^2)` from (1e-3, 1).

    The float32 stall of UCI protein split 2 in two parameters: L-BFGS's first step moves
    along the stiff coordinate and stores one pair of curvature 1e8, which scales every later
    direction by 1e-8; the line search's trials then change the float32 loss by less than its
    rounding, and the optimiser alone (``torch.optim.LBFGS`` as well) leaves ``b`` at 1 for ever
    (checked below).
    """

    def __init__(self) -> None:
        super().__init__(hidden=[2], in_features=1, optimizer="lbfgs", lbfgs_iterations=10)
        self.stiff = torch.nn.Parameter(torch.tensor([1e-3, 1.0]))

    def training_step(self, batch, batch_idx):
        a, b = self.stiff
        return 0.5 * (1e8 * a.square() + b.square())


def test_the_optimiser_alone_stalls_on_the_stiff_start():
    """The reproduction is real: the L-BFGS optimiser alone (same settings) never moves ``b``."""
    model = _StiffStart()
    optimiser = model.configure_optimizers()
    for _ in range(6):
        optimiser.step(lambda: _closure(model, optimiser))
    assert float(model.stiff.detach()[1]) == 1.0


def _closure(model, optimiser):
    optimiser.zero_grad()
    loss = model.training_step(None, 0)
    loss.backward()
    return loss


def test_lbfgs_restarts_out_of_a_float32_stall():
    """Through the Trainer the stalled step clears the memory, and the next one reaches the optimum."""
    model = _StiffStart()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*did not move the parameters.*")
        _trainer(max_epochs=6).fit(model, train_dataloaders=_full_batch(*_diabetes()))
    assert abs(float(model.stiff.detach()[1])) < 1e-3


def test_a_real_lbfgs_fit_does_not_report_a_stall():
    x, y = _diabetes()
    model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*did not move the parameters.*")
        _trainer(max_epochs=3).fit(model, train_dataloaders=_full_batch(x, y))


def test_the_supervision_state_is_checkpointed_and_a_resumed_fit_continues_it(
    monkeypatch, tmp_path
):
    """The supervisor's counters travel in the checkpoint as plain numbers, and come back.

    With the stalled optimiser of the test above, the first fit warns at step 2. A fit resumed
    from its last checkpoint continues the count (steps 4 and 5 stall again) and, having
    warned already, stays silent; a supervisor that started afresh would count two new stalls
    and warn again at step 5.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    def stalled_step(self, closure):
        with torch.enable_grad():
            return closure()

    monkeypatch.setattr(LBFGS, "step", stalled_step)
    x, y = _diabetes()

    def fit(epochs: int, ckpt_path: str | None = None) -> list[str]:
        model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
        trainer = cpu_trainer(max_epochs=epochs, callbacks=[checkpoint])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, train_dataloaders=_full_batch(x, y), ckpt_path=ckpt_path)
        return [str(w.message) for w in caught if "did not move" in str(w.message)]

    first = fit(3)
    assert len(first) == 1 and "L-BFGS step 2 did not move" in first[0]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    state = saved["callbacks"]["LBFGSSupervisor"]
    assert state["stalls"] == 3 and state["stall_warned"] is True and state["restarts"] == 0
    assert state["kl_weight"] == 1.0 and math.isfinite(state["first_loss"])
    assert fit(5, ckpt_path=str(tmp_path / "last.ckpt")) == []
    resumed = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 5
    assert resumed["callbacks"]["LBFGSSupervisor"]["stalls"] == 5
    assert resumed["callbacks"]["LBFGSSupervisor"]["first_loss"] == state["first_loss"]


def test_an_lbfgs_step_logs_its_last_evaluation_once(monkeypatch):
    """The closure runs about ten times a step; its terms are logged once, with the last values."""
    x, y = _diabetes()
    x, y = x[:120], y[:120]
    model = DVIRegressor(hidden=[8], optimizer="lbfgs")
    evaluations: list[tuple[int, float]] = []  # (global step, loss) of every closure call
    logged: list[tuple[int, str, float]] = []
    seen_at_batch_end: list[tuple[int, float]] = []

    elbo = model._elbo

    def spy_elbo(batch, kl_weight, stage):
        terms = elbo(batch, kl_weight, stage)
        if stage == "train":
            evaluations.append((model.global_step, float(terms.loss.detach())))
        return terms

    log = type(model).log

    def spy_log(self, name, value, *args, **kwargs):
        if name.startswith("train/"):
            logged.append((self.global_step, name, float(value)))
        return log(self, name, value, *args, **kwargs)

    class AtBatchEnd(Callback):  # a user's callback reads the step's logged loss
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen_at_batch_end.append(
                (trainer.global_step, float(trainer.callback_metrics["train/loss"]))
            )

    monkeypatch.setattr(model, "_elbo", spy_elbo)
    monkeypatch.setattr(type(model), "log", spy_log)
    trainer = _trainer(max_epochs=3, log_every_n_steps=1, callbacks=[AtBatchEnd()])
    trainer.fit(model, train_dataloaders=_full_batch(x, y))
    steps = sorted({s for s, _ in evaluations})
    assert len(steps) == 3 and len(evaluations) > 2 * len(steps)  # several evaluations a step
    for step in steps:
        names = [n for s, n, _ in logged if s == step]
        assert sorted(names) == sorted(
            ["train/loss", "train/elbo", "train/expected_log_likelihood", "train/kl",
             "train/kl_weight"]
        )  # fmt: skip
        last = [loss for s, loss in evaluations if s == step][-1]
        (value,) = [v for s, n, v in logged if s == step and n == "train/loss"]
        assert value == last
    assert [v for _, v in seen_at_batch_end] == [
        [loss for s, loss in evaluations if s == step][-1] for step in steps
    ]
