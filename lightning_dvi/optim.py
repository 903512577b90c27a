r"""L-BFGS for the deterministic objective, with a per-iteration cost independent of the history.

:class:`LBFGS` is the quasi-Newton method of :class:`torch.optim.LBFGS` (the same iterates in
exact arithmetic: the same two-loop recursion, initial scaling, strong-Wolfe line search and
stopping rules; see :func:`two_loop_direction` and :func:`strong_wolfe`), computed so that the
optimiser's own work is a few dozen tensor operations per iteration whatever the history size,
instead of about :math:`8m` (torch's loop runs two dot products and two ``axpy`` per stored pair,
each a dispatched operation). On a UCI-size network (about a thousand parameters, :math:`m = 50`)
torch's recursion took longer than the forward and backward pass it steers (issue 31,
docs/benchmarks.md).

The recursion's scalar work moves to an :math:`m \times m` Gram matrix
:math:`G_{ij} = s_i^\top y_j`, kept up to date with two matrix-vector products per stored pair.
With the pairs :math:`(s_i, y_i)` oldest first, :math:`\rho_i = 1 / s_i^\top y_i` and the initial
inverse Hessian :math:`H_0 = \gamma I`, :math:`\gamma = s_{k-1}^\top y_{k-1} / y_{k-1}^\top
y_{k-1}`, the first loop's coefficients solve the unit upper-triangular system

.. math::

    \alpha_i = -\rho_i \Big(s_i^\top g + \sum_{j > i} G_{ij}\,\alpha_j\Big),

the second loop's the unit lower-triangular one

.. math::

    \beta_i = \rho_i \Big(y_i^\top r_0 + \sum_{j < i} G_{ji}\,(\alpha_j - \beta_j)\Big),
    \qquad r_0 = -\gamma\,\big(g + \textstyle\sum_j \alpha_j y_j\big),

and the direction is :math:`d = r_0 + \sum_i (\alpha_i - \beta_i)\, s_i`: the recursion's own
forward and back substitutions, as two triangular solves in float64 and three matrix-vector
products in the parameters' dtype (Nocedal and Wright, *Numerical Optimization*, 2nd ed.,
algorithm 7.4 and section 7.2). The line search works on Python floats (float64), so an
overflowing trial point gives an infinite loss, which fails the sufficient-decrease test, instead
of a NaN step length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["LBFGS", "strong_wolfe", "two_loop_direction"]


def two_loop_direction(g: Tensor, S: Tensor, Y: Tensor, G: Tensor, gamma: float) -> Tensor:
    r"""The L-BFGS direction :math:`d = -H g` from ``k`` stored pairs, oldest first.

    Args:
        g: the gradient, ``[n]``.
        S: the steps :math:`s_i`, ``[k, n]`` (rows oldest first), ``g``'s dtype.
        Y: the gradient changes :math:`y_i`, ``[k, n]``.
        G: the Gram matrix :math:`G_{ij} = s_i^\top y_j`, ``[k, k]``, float64.
        gamma: the initial inverse-Hessian scale :math:`H_0 = \gamma I`.

    Returns:
        :math:`d`, ``[n]``; :math:`-\gamma g` when ``k = 0``.
    """
    if S.shape[0] == 0:
        return g.mul(-gamma)
    rho = G.diagonal().reciprocal()
    upper = torch.triu(G, diagonal=1) * rho[:, None]
    eye = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
    sg = torch.mv(S, g).to(G.dtype)
    alpha = torch.linalg.solve_triangular(
        eye + upper, (-rho * sg)[:, None], upper=True, unitriangular=True
    )[:, 0]
    r0 = torch.addmv(g, Y.t(), alpha.to(g.dtype)).mul_(-gamma)
    lower = torch.tril(G.t(), diagonal=-1) * rho[:, None]
    yr = torch.mv(Y, r0).to(G.dtype)
    rhs = rho * yr + torch.mv(lower, alpha)
    beta = torch.linalg.solve_triangular(eye + lower, rhs[:, None], upper=False, unitriangular=True)
    return torch.addmv(r0, S.t(), (alpha - beta[:, 0]).to(g.dtype))


def _cubic_minimum(
    x1: float, f1: float, g1: float, x2: float, f2: float, g2: float, bounds: tuple[float, float]
) -> float:
    """Minimiser of the cubic through two points with values and slopes, clipped to ``bounds``.

    The bounds' midpoint where the cubic has no real minimiser or a value is not finite.
    """
    lo, hi = bounds
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    square = d1 * d1 - g1 * g2
    if not math.isfinite(square) or square < 0:
        return (lo + hi) / 2
    d2 = math.sqrt(square)
    if x1 <= x2:
        position = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
    else:
        position = x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2))
    if not math.isfinite(position):
        return (lo + hi) / 2
    return min(max(position, lo), hi)


def strong_wolfe(
    evaluate: Callable[[float], tuple[float, Tensor, float]],
    t: float,
    f: float,
    g: Tensor,
    gtd: float,
    d_max: float,
    c1: float = 1e-4,
    c2: float = 0.9,
    tolerance_change: float = 1e-9,
    max_ls: int = 25,
) -> tuple[float, Tensor, float, int]:
    r"""A step length satisfying the strong Wolfe conditions (bracketing, then cubic zoom).

    :math:`f(t) \le f(0) + c_1 t f'(0)` and :math:`|f'(t)| \le c_2 |f'(0)|` along the
    direction, with the bracketing and zoom phases of :class:`torch.optim.LBFGS`'s line search
    (after minFunc's ``WolfeLineSearch``), on Python floats.

    Args:
        evaluate: ``t -> (f(t), gradient at t, f'(t))``.
        t: the first trial step.
        f: the objective at ``t = 0``.
        g: its gradient at ``t = 0``.
        gtd: its slope along the direction at ``t = 0`` (negative).
        d_max: the direction's largest entry in absolute value (the bracket's resolution).
        c1: sufficient-decrease constant.
        c2: curvature constant.
        tolerance_change: stop once the bracket's width times ``d_max`` is below this.
        max_ls: the most evaluations.

    Returns:
        ``(f(t), gradient at t, t, evaluations)`` at the accepted step.
    """
    f_new, g_new, gtd_new = evaluate(t)
    evaluations = 1
    t_prev, f_prev, g_prev, gtd_prev = 0.0, f, g, gtd
    done = False
    ls_iter = 0
    bracket: list[float] = []
    bracket_f: list[float] = []
    bracket_g: list[Tensor] = []
    bracket_gtd: list[float] = []
    while ls_iter < max_ls:
        if not f_new <= f + c1 * t * gtd or (ls_iter > 1 and f_new >= f_prev):
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new], [gtd_prev, gtd_new]
            break
        if abs(gtd_new) <= -c2 * gtd:
            bracket, bracket_f, bracket_g = [t], [f_new], [g_new]
            done = True
            break
        if gtd_new >= 0:
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new], [gtd_prev, gtd_new]
            break
        previous = t
        t = _cubic_minimum(
            t_prev, f_prev, gtd_prev, t, f_new, gtd_new, (t + 0.01 * (t - t_prev), t * 10)
        )
        t_prev, f_prev, g_prev, gtd_prev = previous, f_new, g_new, gtd_new
        f_new, g_new, gtd_new = evaluate(t)
        evaluations += 1
        ls_iter += 1
    if ls_iter == max_ls:
        bracket, bracket_f, bracket_g = [0.0, t], [f, f_new], [g, g_new]
        bracket_gtd = [gtd, gtd_new]
    insufficient = False
    low, high = (0, 1) if bracket_f[0] <= bracket_f[-1] else (1, 0)
    while not done and ls_iter < max_ls:
        if abs(bracket[1] - bracket[0]) * d_max < tolerance_change:
            break
        lo, hi = min(bracket), max(bracket)
        t = _cubic_minimum(
            bracket[0], bracket_f[0], bracket_gtd[0], bracket[1], bracket_f[1], bracket_gtd[1],
            (lo, hi),
        )  # fmt: skip
        # a trial close to the bracket's ends makes little progress: move it 10 % inside
        eps = 0.1 * (hi - lo)
        if min(hi - t, t - lo) < eps:
            if insufficient or t >= hi or t <= lo:
                t = hi - eps if abs(t - hi) < abs(t - lo) else lo + eps
                insufficient = False
            else:
                insufficient = True
        else:
            insufficient = False
        f_new, g_new, gtd_new = evaluate(t)
        evaluations += 1
        ls_iter += 1
        if not f_new <= f + c1 * t * gtd or f_new >= bracket_f[low]:
            bracket[high], bracket_f[high], bracket_g[high] = t, f_new, g_new
            bracket_gtd[high] = gtd_new
            low, high = (0, 1) if bracket_f[0] <= bracket_f[1] else (1, 0)
        else:
            if abs(gtd_new) <= -c2 * gtd:
                done = True
            elif gtd_new * (bracket[high] - bracket[low]) >= 0:
                bracket[high], bracket_f[high] = bracket[low], bracket_f[low]
                bracket_g[high], bracket_gtd[high] = bracket_g[low], bracket_gtd[low]
            bracket[low], bracket_f[low], bracket_g[low] = t, f_new, g_new
            bracket_gtd[low] = gtd_new
    return bracket_f[low], bracket_g[low], bracket[low], evaluations


class LBFGS(torch.optim.Optimizer):
    r"""L-BFGS with a strong-Wolfe line search; :class:`torch.optim.LBFGS`'s method, cheaper steps.

    The same arguments, state across :meth:`step` calls and stopping rules as
    :class:`torch.optim.LBFGS` with ``line_search_fn="strong_wolfe"``: one :meth:`step` runs up
    to ``max_iter`` iterations and ``max_eval`` evaluations of ``closure``, and ends early when
    the largest gradient entry is at most ``tolerance_grad`` or the step or the change of the
    objective is below ``tolerance_change``. A curvature pair is stored when
    :math:`s^\top y > 10^{-10}`; the first iteration of a fresh memory tries the step
    :math:`\min(1, 1/\lVert g\rVert_1)\cdot\text{lr}` along :math:`-g`. Clearing ``state``
    (``optimizer.state.clear()``) forgets the curvature memory. The direction and the line search
    are computed as the module docstring describes; they round differently from torch's, so the
    iterates agree with torch's to rounding, not bit for bit.

    Args:
        params: the parameters (one group; real, dense, on one device).
        lr: the first trial step of every line search after the first iteration.
        max_iter: iterations per :meth:`step`.
        max_eval: evaluations per :meth:`step` (default ``max_iter * 5 // 4``).
        tolerance_grad: stop when :math:`\max_i |g_i| \le` this.
        tolerance_change: stop when the step or the objective's change is below this.
        history_size: curvature pairs kept, :math:`m`.

    Raises:
        ValueError: for more than one parameter group or an argument out of range.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1.0,
        max_iter: int = 20,
        max_eval: int | None = None,
        tolerance_grad: float = 1e-7,
        tolerance_change: float = 1e-9,
        history_size: int = 100,
    ) -> None:
        if not lr > 0 or max_iter < 1 or history_size < 1:
            raise ValueError(
                f"LBFGS needs lr > 0, max_iter >= 1 and history_size >= 1, got lr={lr}, "
                f"max_iter={max_iter}, history_size={history_size}"
            )
        max_eval = max_iter * 5 // 4 if max_eval is None else max_eval
        defaults = {
            "lr": lr,
            "max_iter": max_iter,
            "max_eval": max_eval,
            "tolerance_grad": tolerance_grad,
            "tolerance_change": tolerance_change,
            "history_size": history_size,
        }
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("LBFGS takes one parameter group")
        self._params: list[Tensor] = self.param_groups[0]["params"]
        if any(p.is_complex() or p.is_sparse for p in self._params):
            raise ValueError("LBFGS takes real, dense parameters")
        self._numels = [p.numel() for p in self._params]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`torch.optim.Optimizer.load_state_dict`, keeping the Gram matrix in float64.

        torch casts every floating-point state tensor to its parameter's dtype on loading; the
        Gram matrix :math:`G` is float64 whatever the parameters' dtype (the recursion's
        triangular solves run in float64), so a float32 model resumed from a checkpoint would
        continue from a rounded :math:`G` and drift from the uninterrupted run.
        """
        grams = {key: v["G"] for key, v in state_dict["state"].items() if "G" in v}
        super().load_state_dict(state_dict)
        for key, gram in grams.items():
            param = self.param_groups[0]["params"][key]
            self.state[param]["G"] = gram.to(dtype=torch.float64, device=param.device)

    def _flat_grad(self) -> Tensor:
        return torch.cat(
            [
                p.new_zeros(n) if p.grad is None else p.grad.reshape(-1)
                for p, n in zip(self._params, self._numels, strict=True)
            ]
        )

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [v.view_as(p) for v, p in zip(flat.split(self._numels), self._params, strict=True)]

    def _store_pair(self, state: dict[str, Any], s: Tensor, y: Tensor, ys: float) -> None:
        """Append :math:`(s, y)` to the memory, dropping the oldest pair when it is full."""
        S, Y, G = state["S"], state["Y"], state["G"]
        k, m = state["k"], S.shape[0]
        if k == m:  # shift the rows (and the Gram matrix) by one: the oldest pair goes
            S[:-1] = S[1:].clone()
            Y[:-1] = Y[1:].clone()
            G[:-1, :-1] = G[1:, 1:].clone()
            k -= 1
        S[k], Y[k] = s, y
        G[k, : k + 1] = torch.mv(Y[: k + 1], s).to(G.dtype)
        G[:k, k] = torch.mv(S[:k], y).to(G.dtype)
        G[k, k] = ys
        state["k"] = k + 1

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]  # the closure is required
        """Up to ``max_iter`` L-BFGS iterations.

        Args:
            closure: zeroes the gradients, evaluates the objective, calls ``backward`` and
                returns the objective.

        Returns:
            The objective at the step's start (``closure``'s first value).
        """
        closure = torch.enable_grad()(closure)
        group = self.param_groups[0]
        lr, max_iter, max_eval = float(group["lr"]), group["max_iter"], group["max_eval"]
        tolerance_grad, tolerance_change = group["tolerance_grad"], group["tolerance_change"]
        history = group["history_size"]
        params = self._params
        state = self.state[params[0]]
        state.setdefault("func_evals", 0)
        state.setdefault("n_iter", 0)

        orig_loss = closure()
        loss = float(orig_loss)
        evaluations = 1
        state["func_evals"] += 1
        g = self._flat_grad()
        if float(g.abs().max()) <= tolerance_grad:
            return orig_loss

        d, t = state.get("d"), state.get("t", lr)
        prev_g, prev_loss = state.get("prev_flat_grad"), state.get("prev_loss")
        n_iter = 0
        while n_iter < max_iter:
            n_iter += 1
            state["n_iter"] += 1
            if state["n_iter"] == 1:
                d = g.neg()
                state["S"] = g.new_zeros(history, g.numel())
                state["Y"] = g.new_zeros(history, g.numel())
                state["G"] = torch.zeros(history, history, dtype=torch.float64, device=g.device)
                state["k"], state["gamma"] = 0, 1.0
            else:
                assert d is not None and prev_g is not None
                y = g - prev_g
                s = d.mul(t)
                ys = float(y.dot(s))
                if ys > 1e-10:
                    self._store_pair(state, s, y, ys)
                    state["gamma"] = ys / float(y.dot(y))
                k = state["k"]
                d = two_loop_direction(
                    g, state["S"][:k], state["Y"][:k], state["G"][:k, :k], state["gamma"]
                )
            if prev_g is None:
                prev_g = g.clone()
            else:
                prev_g.copy_(g)
            prev_loss = loss
            t = min(1.0, 1.0 / float(g.abs().sum())) * lr if state["n_iter"] == 1 else lr
            gtd = float(g.dot(d))
            if gtd > -tolerance_change:  # not a descent direction any more
                break

            start = [p.detach().clone() for p in params]
            d_views = self._views(d)

            def evaluate(
                step: float,
                d: Tensor = d,
                d_views: list[Tensor] = d_views,
                start: list[Tensor] = start,
            ) -> tuple[float, Tensor, float]:
                torch._foreach_copy_(params, start)
                torch._foreach_add_(params, d_views, alpha=step)
                value = float(closure())
                grad = self._flat_grad()
                return value, grad, float(grad.dot(d))

            loss, g, t, used = strong_wolfe(
                evaluate,
                t,
                loss,
                g,
                gtd,
                float(d.abs().max()),
                tolerance_change=tolerance_change,
                max_ls=max_eval - evaluations,
            )
            torch._foreach_copy_(params, start)
            torch._foreach_add_(params, d_views, alpha=t)
            evaluations += used
            state["func_evals"] += used
            if n_iter == max_iter or evaluations >= max_eval:
                break
            if float(g.abs().max()) <= tolerance_grad:
                break
            if float(d.abs().max()) * abs(t) <= tolerance_change:
                break
            if abs(loss - prev_loss) < tolerance_change:
                break

        state["d"], state["t"] = d, t
        state["prev_flat_grad"], state["prev_loss"] = prev_g, prev_loss
        return orig_loss
