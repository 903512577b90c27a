

class _Poison(Callback):
    """Sets a weight to NaN after the given steps (callbacks run before the module's hook)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = math.nan


def test_a_non_finite_lbfgs_step_is_undone_once_then_an_error():
    x, y = _diabetes()
    model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
    trainer = _trainer(max_epochs=4, callbacks=[_Poison({2})])
    with pytest.warns(UserWarning, match="left non-finite parameters"):
        trainer.fit(model, train_dataloaders=_full_batch(x, y))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3)
    trainer = _trainer(max_epochs=4, callbacks=[_Poison({2, 3})])
    with pytest.raises(FloatingPointError, match="also after restarting it"):
        trainer.fit(model, train_dataloaders=_full_batch(x, y))
