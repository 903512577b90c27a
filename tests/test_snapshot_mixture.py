"""PairedEarlyStopping(mixture=...) and SnapshotMixture (issue 45): a mixture of the last kept steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import overfit_fit, overfit_loaders
from scipy.special import logsumexp

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import PairedEarlyStopping
from lightning_dvi.lightning.early_stopping import SnapshotMixture, choose_mixture_window


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread: a second one only contends for the 2 shared cores."""


def _window_oracle(rows: list[np.ndarray], trim: int) -> int:
    """Written out with numpy and scipy: every power-of-two window, the trimmed mean paired gain."""
    best_k, best = 1, 0.0
    for k in (2, 4, 8, 16, 32):
        if k > len(rows):
            break
        mixed = logsumexp(np.stack(rows[-k:]), axis=0) - np.log(k)
        d = np.sort(mixed - rows[-1])
        if trim and len(d) >= 2 * trim + 2:
            d = d[trim:-trim]
        if d.mean() > best:
            best_k, best = k, d.mean()
    return best_k


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("trim", [0, 1])
def test_the_window_is_the_one_with_the_largest_trimmed_mean_gain(seed, trim):
    rng = np.random.default_rng(seed)
    base = rng.normal(-1.0, 1.0, size=40)
    rows = [
        base + rng.normal(0.0, 0.3 * (seed % 3 + 1), size=40) - 0.02 * (11 - k) for k in range(11)
    ]
    chosen = choose_mixture_window([torch.as_tensor(r) for r in rows], trim)
    assert chosen == _window_oracle(rows, trim)


def test_steps_good_on_different_rows_are_mixed_and_a_worse_past_is_not():
    """Two steps, each fitting half the rows: mixing wins; steps clearly worse everywhere: K = 1."""
    good, bad = np.full(20, -1.0), np.full(20, -6.0)
    a, b = np.concatenate([good, bad]), np.concatenate([bad, good])
    assert choose_mixture_window([torch.as_tensor(a), torch.as_tensor(b)]) == 2
    worse = [torch.full((40,), -5.0)] * 3 + [torch.full((40,), -1.0)]
    assert choose_mixture_window(worse) == 1


def test_one_row_alone_cannot_make_a_mixture_with_trim():
    """One row gains 30 nats by mixing, every other row loses a little: trim=1 keeps the last step."""
    last = np.full(30, -1.0)
    earlier = np.full(30, -1.5)
    last[0], earlier[0] = -40.0, -2.0
    rows = [torch.as_tensor(earlier), torch.as_tensor(last)]
    assert choose_mixture_window(rows, trim=0) == 2
    assert choose_mixture_window(rows, trim=1) == 1


def _fit(callback: PairedEarlyStopping, epochs: int = 12) -> DVIRegressor:
    model: DVIRegressor = overfit_fit([callback], epochs)
    return model


def test_in_a_fit_the_mixture_is_the_best_window_of_the_last_kept_steps_on_the_carve_out():
    paired = PairedEarlyStopping(patience=100, z=3.0, mixture=16)
    model = _fit(paired)
    kept = [k for k, (_, ok) in enumerate(paired.history) if ok]
    # windows of 1, 2 and 4 to choose from (steps where L-BFGS changed nothing are not kept)
    assert len(paired._snapshots) >= 4
    assert [k for k, _, _ in paired._snapshots] == kept[-16:]
    steps = paired.mixture_steps
    assert steps is not None and steps[-1] == paired.kept_step
    assert len(steps) in (1, 2, 4, 8, 16) and steps == kept[-len(steps) :]
    mixture = paired.mixture_predictive(model)
    x, y = overfit_loaders()[1].dataset.tensors
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = float(mixture.predictive_log_prob(x, y).mean())
    for key, value in model.state_dict().items():  # the module itself is left alone
        torch.testing.assert_close(value, before[key])
    # trim=0: no window of the last kept steps scores the carve-out better than the chosen one
    states = [s for _, _, s in paired._snapshots]
    for k in (1, 2, 4, 8, 16):
        if k <= len(states):
            other = float(SnapshotMixture(model, states[-k:]).predictive_log_prob(x, y).mean())
            assert ours >= other - 1e-9
    single = float(model.predictive_log_prob(x, y).mean())
    assert single == pytest.approx(paired.history[paired.kept_step][0], rel=1e-6)


def test_the_mixture_density_and_moments_against_its_components_and_monte_carlo():
    model = _fit(PairedEarlyStopping(patience=100, z=1.0))
    g = torch.Generator().manual_seed(1)
    states = []  # three different weights: the fitted ones moved at random
    for scale in (0.0, 0.3, 0.6):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for key in ("net.layers.0.weight_loc", "net.layers.2.weight_loc"):
            state[key] += scale * torch.randn(state[key].shape, generator=g)
        states.append(state)
    mixture = SnapshotMixture(model, states)
    x, y = overfit_loaders()[1].dataset.tensors
    copy = DVIRegressor(in_features=2, hidden=[64], num_data=15, optimizer="lbfgs")
    copy.load_state_dict(model.state_dict())
    copy.eval()
    parts, moments = [], []
    for state in states:
        copy.load_state_dict(state)
        parts.append(copy.predictive_log_prob(x, y).numpy())
        moments.append([t.numpy() for t in copy.predictive(x)])
    np.testing.assert_allclose(
        mixture.predictive_log_prob(x, y).numpy(),
        logsumexp(np.stack(parts), axis=0) - math.log(3),
        rtol=1e-10,
        atol=1e-10,
    )
    # Monte Carlo of the mixture: pick a component, draw from its Gaussian
    rng = np.random.default_rng(0)
    n = 200_000
    pick = rng.integers(0, 3, size=n)
    mu = np.stack([m for m, _ in moments])[pick, :3]
    sd = np.sqrt(np.stack([v for _, v in moments])[pick, :3])
    draws = mu + sd * rng.standard_normal(mu.shape)
    mean, var = (t.numpy()[:3] for t in mixture.predictive(x))
    np.testing.assert_allclose(mean, draws.mean(0), atol=4 * np.sqrt(var / n).max())
    np.testing.assert_allclose(var, draws.var(0), rtol=0.02)


def test_mixture_arguments_and_state():
    with pytest.raises(ValueError, match="PairedEarlyStopping"):
        PairedEarlyStopping(mixture=-1)
    with pytest.raises(RuntimeError, match="mixture"):
        PairedEarlyStopping().mixture_predictive(
            DVIRegressor(in_features=2, hidden=[4], num_data=3)
        )
    with pytest.raises(ValueError, match="no steps"):
        choose_mixture_window([])
    with pytest.raises(ValueError, match="at least one"):
        SnapshotMixture(DVIRegressor(in_features=2, hidden=[4], num_data=3), [])
    callback = PairedEarlyStopping(z=1.0, mixture=2)
    module = torch.nn.Linear(1, 1)
    rng = np.random.default_rng(3)
    for _ in range(5):
        callback.decide(torch.as_tensor(rng.normal(size=20)), module)  # type: ignore[arg-type]
    assert 1 <= len(callback._snapshots) <= 2
    again = PairedEarlyStopping(z=1.0, mixture=2)
    again.load_state_dict(callback.state_dict())
    assert [k for k, _, _ in again._snapshots] == [k for k, _, _ in callback._snapshots]
