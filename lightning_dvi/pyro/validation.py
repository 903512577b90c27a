r"""Held-out predictive NLL and best-snapshot keeping for a user's ``SVI`` loop.

Two plain pieces, no hidden state and no hooks into ``SVI``; the loop calls them:

* :func:`predictive_nll` (:func:`predictive_log_density` per row): the held-out negative log
  predictive density of any guide, from a fixed set of weight draws (a seeded generator of its
  own, the global one untouched);
* :class:`ValidationCheckpoint`: every ``every`` steps it evaluates a score (such as
  :func:`predictive_nll` on a validation split), copies the parameters whose score is the best
  so far, and puts that copy back on :meth:`~ValidationCheckpoint.restore`.

The deterministic loss of :class:`~lightning_dvi.pyro.DeterministicELBO` has no gradient noise,
so its run can climb the ELBO far in few steps; on a model whose further optimum predicts worse
(a ``Normal(0, 1)`` prior on every weight of a wide layer, ``docs/pyro.md``), the held-out
score says when to stop. The same rule applies to any guide (AutoNormal's run stopped by its
own validation NLL), so the two can be compared under one protocol:

.. code-block:: python

    checkpoint = ValidationCheckpoint(
        lambda: predictive_nll(model, guide, x_val, y_val, num_samples=100), every=25,
        params=guide,
    )
    for step in range(1, 1501):
        svi.step(x_fit, y_fit)
        checkpoint.update(step)
    checkpoint.restore()  # the parameters of checkpoint.best_step
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from torch import Tensor, nn

__all__ = ["ValidationCheckpoint", "predictive_log_density", "predictive_nll"]


def predictive_log_density(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    *args: Any,
    site: str = "obs",
    num_samples: int = 100,
    seed: int = 0,
    **kwargs: Any,
) -> Tensor:
    r"""Log posterior predictive density of each observed element of ``site``.

    With :math:`w_s \sim q` the guide's draws, :math:`s = 1..S`,

    .. math::

        \log \hat p(y_n\mid x_n) = \log\Big(\frac1S\sum_{s=1}^S p(y_n\mid x_n, w_s)\Big),

    each :math:`\log p(y_n\mid x_n, w_s)` the ``log_prob`` of ``site``'s distribution in the
    model replayed on the guide's draw (a ``logsumexp`` over draws, no underflow). The draws
    come from a generator seeded with ``seed`` inside :func:`torch.random.fork_rng`: every call
    with the same ``seed`` uses the same standard-normal noise (so two calls at different
    parameters differ by the parameters, not by the draws), and the global generator, hence a
    sampled guide's training, is the same as without the call. For a finite :math:`S` the log
    of the Monte Carlo mean is biased low (Jensen), most where the predictive is confident.

    Args:
        model: the Pyro model; called as ``model(*args, **kwargs)``, which must observe
            ``site`` with the held-out values (no subsampling plate: every row is scored).
        guide: any guide of ``model`` (``AutoNormal``, :class:`DeterministicGuide`, ...).
        *args: the model's arguments, the observations included.
        site: the name of the observed site.
        num_samples: the number of weight draws :math:`S`.
        seed: the seed of the draws.
        **kwargs: the model's keyword arguments.

    Returns:
        :math:`\log \hat p(y_n\mid x_n)`, the site's batch shape (one value per row).

    Raises:
        ValueError: if ``num_samples < 1`` or ``site`` is not an observed site of the model.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    draws = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for _ in range(num_samples):
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            replayed = poutine.replay(model, trace=guide_trace)
            model_trace = poutine.trace(replayed).get_trace(*args, **kwargs)
            node = model_trace.nodes.get(site)
            if node is None or node["type"] != "sample" or not node["is_observed"]:
                raise ValueError(f"{site!r} is not an observed sample site of the model")
            fn: Any = node["fn"]
            draws.append(fn.log_prob(node["value"]))
    return torch.logsumexp(torch.stack(draws), 0) - math.log(num_samples)


def predictive_nll(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    *args: Any,
    site: str = "obs",
    num_samples: int = 100,
    seed: int = 0,
    **kwargs: Any,
) -> float:
    r"""Mean negative log posterior predictive density of the observed ``site``.

    :math:`-\frac1N\sum_n \log \hat p(y_n\mid x_n)`, the mean of
    :func:`predictive_log_density`'s values negated (same arguments, same fixed draws).

    Returns:
        The NLL per observed element, averaged (nats).

    Raises:
        ValueError: if ``num_samples < 1`` or ``site`` is not an observed site of the model.
    """
    log_p = predictive_log_density(
        model, guide, *args, site=site, num_samples=num_samples, seed=seed, **kwargs
    )
    return -log_p.mean().item()


class ValidationCheckpoint:
    r"""Keep the parameters of the best held-out score seen along an ``SVI`` run.

    The loop calls :meth:`update` after each step with the step's number (1-based);
    every ``every`` steps it evaluates ``score()`` (lower is better, e.g.
    :func:`predictive_nll` on a validation split) and, when :math:`s < s_\text{best}`, copies
    the parameters. :meth:`restore` copies the best copy back into the live tensors, in
    place, so an optimiser's references stay valid (its moments are not restored: restore at
    the end of a run, or expect the next steps to start from the optimiser's later state).

    With ``patience=P``, :meth:`update` returns ``True`` once ``P`` evaluations in a row have
    not improved on the best: the step budget's remainder can be skipped. With
    ``patience=None`` it never asks to stop and the checkpoint is the best of the whole run.

    Args:
        score: the held-out score of the current parameters; called with no arguments.
        every: evaluate at steps ``every, 2*every, ...``.
        patience: evaluations without improvement before :meth:`update` returns ``True``;
            ``None``: never.
        params: whose parameters to keep: an ``nn.Module`` (a guide, its ``named_parameters()``,
            which are the param store's own tensors) or ``None`` for every parameter of Pyro's
            global param store. Give the guide when several guides share the store.

    Raises:
        ValueError: if ``every < 1`` or ``patience < 1``.
    """

    def __init__(
        self,
        score: Callable[[], float],
        every: int = 25,
        patience: int | None = None,
        params: nn.Module | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be at least 1 or None, got {patience}")
        self.score = score
        self.every = every
        self.patience = patience
        self.params = params
        self.history: list[tuple[int, float]] = []
        self.best_step: int | None = None
        self.best_score = math.inf
        self.best_params: dict[str, Tensor] = {}
        self.since_best = 0

    def _named(self) -> Iterator[tuple[str, Tensor]]:
        if self.params is None:
            return iter(pyro.get_param_store().named_parameters())
        return self.params.named_parameters()

    def update(self, step: int) -> bool:
        """Evaluate at a multiple of ``every``; return ``True`` when patience has run out."""
        if step % self.every:
            return False
        return self.evaluate(step)

    def evaluate(self, step: int) -> bool:
        """Evaluate now (e.g. at a last step that is not a multiple of ``every``).

        Returns:
            ``True`` when ``patience`` evaluations in a row did not improve on the best.
        """
        value = float(self.score())
        self.history.append((step, value))
        if value < self.best_score:  # NaN never improves
            self.best_step, self.best_score = step, value
            self.best_params = {name: p.detach().clone() for name, p in self._named()}
            self.since_best = 0
        else:
            self.since_best += 1
        return self.patience is not None and self.since_best >= self.patience

    def restore(self) -> int:
        """Copy the best parameters back into the live tensors; return :attr:`best_step`.

        Raises:
            RuntimeError: before any evaluation with a finite score, or if a kept parameter
                no longer exists.
        """
        if self.best_step is None:
            raise RuntimeError("no evaluation with a finite score yet: nothing to restore")
        live = dict(self._named())
        missing = sorted(set(self.best_params) - set(live))
        if missing:
            raise RuntimeError(f"kept parameters no longer exist: {', '.join(missing)}")
        with torch.no_grad():
            for name, value in self.best_params.items():
                live[name].copy_(value)
        return self.best_step
