"""lightning_dvi.optim.LBFGS against torch.optim.LBFGS and against dense BFGS algebra."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lightning_dvi.optim import LBFGS, strong_wolfe, two_loop_direction


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 12, generator=g, dtype=torch.float64)
    w = torch.randn(12, generator=g, dtype=torch.float64)
    y = (x @ w + 0.5 * torch.randn(200, generator=g, dtype=torch.float64) > 0).double()
    return x, y


def _fit(optimiser_cls, steps: int, **kwargs):
    """Logistic regression with a quartic penalty (not quadratic: curvature changes along the path)."""
    x, y = _problem()
    w = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimiser = optimiser_cls([w, b], **kwargs)

    def closure():
        optimiser.zero_grad()
        logits = x @ w + b
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss = loss + 0.05 * w.pow(4).sum()
        loss.backward()
        return loss

    path = []
    for _ in range(steps):
        optimiser.step(closure)
        path.append(torch.cat([w, b]).detach().clone())
    return path, optimiser.state[w]


@pytest.mark.parametrize("history", [2, 50])
def test_the_iterates_are_torchs(history):
    """Same method as torch.optim.LBFGS(line_search_fn="strong_wolfe"): same path to rounding.

    History 2 over 4 steps of 3 iterations exercises dropping the oldest pair.
    """
    common = dict(lr=1, max_iter=3, max_eval=10, history_size=history, tolerance_grad=1e-14,
                  tolerance_change=1e-16)  # fmt: skip
    ours, state = _fit(LBFGS, 4, **common)
    theirs, torch_state = _fit(torch.optim.LBFGS, 4, line_search_fn="strong_wolfe", **common)
    assert state["func_evals"] == torch_state["func_evals"]
    assert state["n_iter"] == torch_state["n_iter"] == 12
    assert state["k"] == len(torch_state["old_dirs"]) == min(history, 11)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the path moved: the comparison is not between two starting points
    assert float((ours[-1] - ours[0]).abs().max()) > 1e-3


def _dense_bfgs_direction(g, pairs, gamma):
    """-H g with H built by the BFGS inverse update, H0 = gamma I (Nocedal & Wright eq. 6.17)."""
    n = g.numel()
    h = gamma * torch.eye(n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    for s, y in pairs:
        rho = 1.0 / float(s @ y)
        h = (eye - rho * torch.outer(s, y)) @ h @ (eye - rho * torch.outer(y, s))
        h = h + rho * torch.outer(s, s)
    return -(h @ g)


@pytest.mark.parametrize("k", [0, 1, 5, 9])
def test_the_direction_is_minus_the_bfgs_inverse_hessian_times_the_gradient(k):
    g_ = torch.Generator().manual_seed(k)
    n = 9
    a = torch.randn(n, n, generator=g_, dtype=torch.float64)
    hessian = a @ a.T + n * torch.eye(n, dtype=torch.float64)  # curvature pairs of an SPD matrix
    s = torch.randn(k, n, generator=g_, dtype=torch.float64)
    y = s @ hessian
    grad = torch.randn(n, generator=g_, dtype=torch.float64)
    gamma = float(s[-1] @ y[-1] / (y[-1] @ y[-1])) if k else 1.0
    d = two_loop_direction(grad, s, y, s @ y.T, gamma)
    torch.testing.assert_close(d, _dense_bfgs_direction(grad, list(zip(s, y, strict=True)), gamma))


def test_the_line_search_step_satisfies_the_strong_wolfe_conditions():
    """f(t) = (t - 3)^2 + sin(3t) along a unit direction, from t = 0 with a first trial of 10."""

    def f(t):
        return (t - 3) ** 2 + math.sin(3 * t), 2 * (t - 3) + 3 * math.cos(3 * t)

    def evaluate(t):
        value, slope = f(t)
        return value, torch.tensor([slope]), slope

    f0, g0 = f(0.0)
    value, grad, t, evaluations = strong_wolfe(evaluate, 10.0, f0, torch.tensor([g0]), g0, 1.0)
    assert value == pytest.approx(f(t)[0]) and float(grad) == pytest.approx(f(t)[1])
    assert value <= f0 + 1e-4 * t * g0  # sufficient decrease
    assert abs(f(t)[1]) <= 0.9 * abs(g0)  # curvature
    assert 1 < evaluations <= 25


def test_an_overflowing_trial_point_backs_off_instead_of_giving_nan():
    """Beyond t = 2 the objective overflows: the search must bracket and come back, finite."""

    def evaluate(t):
        if t > 2:
            return math.inf, torch.tensor([math.nan]), math.nan
        return (t - 1.5) ** 2, torch.tensor([2 * (t - 1.5)]), 2 * (t - 1.5)

    value, _, t, _ = strong_wolfe(evaluate, 8.0, 2.25, torch.tensor([-3.0]), -3.0, 1.0)
    assert math.isfinite(t) and 0 < t <= 2 and value < 2.25


def test_clearing_the_state_forgets_the_curvature_memory():
    _, state = _fit(LBFGS, 2, max_iter=4, history_size=5)
    assert state["k"] > 0
    x, y = _problem()
    w = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    optimiser = LBFGS([w], max_iter=2, max_eval=10)

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y)
        loss.backward()
        return loss

    optimiser.step(closure)
    assert optimiser.state[w]["n_iter"] == 2
    optimiser.state.clear()
    optimiser.step(closure)
    assert optimiser.state[w]["n_iter"] == 2 and optimiser.state[w]["k"] == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_state_saves_and_loads_with_weights_only_and_continues_identically(dtype):
    """In float32 too: torch's loading casts state tensors to the parameters' dtype, and the
    Gram matrix must come back in float64, unrounded."""
    x, y = (t.to(dtype) for t in _problem())

    def make():
        w = torch.zeros(12, dtype=dtype, requires_grad=True)
        return w, LBFGS([w], max_iter=3, history_size=4)

    def closure_for(w, optimiser):
        def closure():
            optimiser.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y)
            loss = loss + 0.05 * w.pow(4).sum()
            loss.backward()
            return loss

        return closure

    w, optimiser = make()
    for _ in range(3):
        optimiser.step(closure_for(w, optimiser))
    buffer = io.BytesIO()
    torch.save({"w": w.detach().clone(), "opt": optimiser.state_dict()}, buffer)
    optimiser.step(closure_for(w, optimiser))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    w2, optimiser2 = make()
    with torch.no_grad():
        w2.copy_(saved["w"])
    optimiser2.load_state_dict(saved["opt"])
    gram = optimiser2.state[w2]["G"]
    assert gram.dtype == torch.float64 and torch.equal(gram, saved["opt"]["state"][0]["G"])
    optimiser2.step(closure_for(w2, optimiser2))
    assert torch.equal(w.detach(), w2.detach())


def test_float32_parameters_and_a_parameter_without_gradient():
    w = torch.zeros(5, requires_grad=True)
    unused = torch.ones(2, requires_grad=True)
    target = torch.arange(5.0)
    optimiser = LBFGS([w, unused], max_iter=20)

    def closure():
        optimiser.zero_grad()
        loss = (w - target).square().sum()
        loss.backward()
        return loss

    optimiser.step(closure)
    torch.testing.assert_close(w.detach(), target)
    assert torch.equal(unused.detach(), torch.ones(2))


@pytest.mark.parametrize(
    "kwargs", [{"lr": 0.0}, {"max_iter": 0}, {"history_size": 0}], ids=["lr", "iter", "history"]
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="LBFGS needs"):
        LBFGS([torch.zeros(1, requires_grad=True)], **kwargs)


def test_two_parameter_groups_are_refused():
    groups = [{"params": [torch.zeros(1, requires_grad=True)]},
              {"params": [torch.zeros(1, requires_grad=True)]}]  # fmt: skip
    with pytest.raises(ValueError, match="one parameter group"):
        LBFGS(groups)
