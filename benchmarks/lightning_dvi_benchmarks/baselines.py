r"""Non-DVI rows of the classification benchmark: plain, weight decay, ensemble, MC dropout, Laplace.

Every baseline trains with the same protocol as the DVI rows (:class:`Budget`: Adam, the
learning rate, batch size and number of epochs, the weights of the epoch with the lowest
validation NLL) and returns a :class:`Fitted` whose ``predict`` gives class probabilities.
Hyper-parameters that a baseline needs (weight decay, dropout rate, prior precision) are chosen
on the validation rows, never on the test rows.

The last-layer Laplace approximation is written here (the ``laplace-torch`` package pulls in
``torchvision``, which must stay out of the test environment): a generalised Gauss-Newton
Hessian of the last linear layer of the trained network, in full,

.. math::
    H = \sum_n \Lambda_n \otimes \tilde\phi_n\tilde\phi_n^\top + \delta I,\qquad
    \Lambda_n = \operatorname{diag}(p_n) - p_np_n^\top,\qquad
    \tilde\phi_n = (\phi(x_n), 1),

a Gaussian over the logits :math:`f(x) \sim \mathcal N(W\tilde\phi, \Sigma_f)`,
:math:`(\Sigma_f)_{kl} = \tilde\phi^\top (H^{-1})_{k\cdot,l\cdot}\tilde\phi`, and the predictive
by Monte Carlo over the logits (fixed seed); the prior precision :math:`\delta` is chosen on the
validation NLL (laplace-torch's ``gridsearch``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .data import Budget, ClassificationSplit

__all__ = [
    "Fitted",
    "fit_ensemble",
    "fit_last_layer_laplace",
    "fit_mc_dropout",
    "fit_plain",
    "fit_plain_tuned",
    "last_layer_ggn",
    "nll",
]

NetFactory = Callable[[float], nn.Module]
"""Builds a fresh network; the argument is the dropout rate (0 for none)."""


@dataclass
class Fitted:
    """A trained row: its predictive and what it cost.

    Attributes:
        predict: inputs ``[B, ...]`` to class probabilities ``[B, K]`` (no gradient).
        train_seconds: CPU seconds (``time.process_time``) spent training, hyper-parameter
            selection included.
        best_epoch: the epoch whose weights were kept (the last member's, for an ensemble).
        samples: inputs and a count ``S`` to class-probability samples ``[S, B, K]`` (rows
            with a posterior or dropout), else ``None``.
        details: the chosen hyper-parameters and anything else worth reporting.
        net: the trained network, when there is one.
    """

    predict: Callable[[Tensor], Tensor]
    train_seconds: float
    best_epoch: int
    samples: Callable[[Tensor, int], Tensor] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    net: nn.Module | None = None


def nll(probs: Tensor, y: Tensor) -> float:
    """Mean negative log-probability of the labels (probabilities floored at 1e-12)."""
    return float(-probs.gather(-1, y.long().unsqueeze(-1)).clamp_min(1e-12).log().mean())


def _train(
    net: nn.Module,
    split: ClassificationSplit,
    budget: Budget,
    seed: int,
    weight_decay: float,
    val_probs: Callable[[nn.Module, Tensor], Tensor],
) -> tuple[int, float, float]:
    """Adam on cross-entropy; loads the weights of the best validation epoch.

    Returns ``(best_epoch, best_val_nll, cpu_seconds)``.
    """
    start = time.process_time()
    optimiser = torch.optim.Adam(net.parameters(), lr=budget.lr, weight_decay=weight_decay)
    best, best_epoch, state = float("inf"), -1, copy.deepcopy(net.state_dict())
    for epoch in range(budget.epochs):
        net.train()
        for x, y in split.train_loader(budget.batch_size, seed + epoch):
            optimiser.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimiser.step()
        net.eval()
        with torch.no_grad():
            value = nll(val_probs(net, split.x_val), split.y_val)
        if value < best:
            best, best_epoch, state = value, epoch, copy.deepcopy(net.state_dict())
    net.load_state_dict(state)
    net.eval()
    return best_epoch, best, time.process_time() - start


def _softmax(net: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return torch.softmax(net(x), dim=-1)


def fit_plain(
    split: ClassificationSplit,
    make_net: NetFactory,
    budget: Budget,
    seed: int,
    weight_decay: float = 0.0,
) -> Fitted:
    """A deterministic network trained on cross-entropy (Adam's ``weight_decay``)."""
    torch.manual_seed(seed)
    net = make_net(0.0)
    epoch, best, seconds = _train(net, split, budget, seed, weight_decay, _softmax)
    details = {"weight_decay": weight_decay, "val_nll": best}
    return Fitted(lambda x: _softmax(net, x), seconds, epoch, details=details, net=net)


def fit_plain_tuned(
    split: ClassificationSplit,
    make_net: NetFactory,
    budget: Budget,
    seed: int,
    weight_decays: Sequence[float] = (0.0, 1e-4, 1e-3, 1e-2),
) -> Fitted:
    """:func:`fit_plain` for each weight decay; keeps the lowest validation NLL (time: all of them)."""
    fits = [fit_plain(split, make_net, budget, seed, wd) for wd in weight_decays]
    best = min(fits, key=lambda f: f.details["val_nll"])
    best.train_seconds = sum(f.train_seconds for f in fits)
    return best


def fit_ensemble(
    split: ClassificationSplit,
    make_net: NetFactory,
    budget: Budget,
    seed: int,
    members: int = 5,
    weight_decay: float = 0.0,
) -> Fitted:
    """A deep ensemble: ``members`` plain networks from different seeds, probabilities averaged."""
    fits = [
        fit_plain(split, make_net, budget, 1000 * m + seed, weight_decay) for m in range(members)
    ]

    def samples(x: Tensor, num_samples: int = members) -> Tensor:
        return torch.stack([f.predict(x) for f in fits])

    return Fitted(
        lambda x: samples(x).mean(0),
        sum(f.train_seconds for f in fits),
        fits[-1].best_epoch,
        samples=samples,
        details={"members": members, "weight_decay": weight_decay},
    )


def fit_mc_dropout(
    split: ClassificationSplit,
    make_net: NetFactory,
    budget: Budget,
    seed: int,
    rates: Sequence[float] = (0.05, 0.1, 0.2),
    num_samples: int = 64,
) -> Fitted:
    """MC dropout (Gal & Ghahramani 2016): dropout kept on at test time, ``num_samples`` passes averaged.

    The rate is chosen among ``rates`` on the validation NLL of the MC predictive (time: every
    rate's run).
    """

    def draws(net: nn.Module, x: Tensor, count: int) -> Tensor:
        net.train()  # dropout on
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)  # fixed masks: a deterministic predictive
        with torch.no_grad():
            out = torch.stack([torch.softmax(net(x), -1) for _ in range(count)])
        torch.random.set_rng_state(gen_state)
        net.eval()
        return out

    fits = []
    for rate in rates:
        torch.manual_seed(seed)
        net = make_net(rate)
        epoch, best, seconds = _train(
            net, split, budget, seed, 0.0, lambda n, x: draws(n, x, num_samples).mean(0)
        )
        fits.append((best, rate, net, epoch, seconds))
    best, rate, net, epoch, _ = min(fits, key=lambda f: f[0])
    return Fitted(
        lambda x: draws(net, x, num_samples).mean(0),
        sum(f[4] for f in fits),
        epoch,
        samples=lambda x, count: draws(net, x, count),
        details={"dropout": rate, "val_nll": best},
        net=net,
    )


def _split_last_linear(net: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """``(feature extractor, last nn.Linear)`` of an ``nn.Sequential`` ending in a linear layer."""
    if not isinstance(net, nn.Sequential) or not isinstance(net[-1], nn.Linear):
        raise ValueError("last-layer Laplace needs an nn.Sequential that ends in an nn.Linear")
    return net[:-1], net[-1]


def fit_last_layer_laplace(
    split: ClassificationSplit,
    base: Fitted,
    prior_precisions: Sequence[float] = (1e-2, 1e-1, 1.0, 10.0, 1e2, 1e3, 1e4),
    num_samples: int = 1000,
) -> Fitted:
    """Last-layer Laplace (GGN, full Hessian) on a trained plain network (``base.net``).

    The prior precision is chosen on the validation NLL; time: ``base``'s training plus the fit.
    """
    if base.net is None:
        raise ValueError("fit_last_layer_laplace needs a Fitted with its network (base.net)")
    start = time.process_time()
    features, last = _split_last_linear(base.net)
    ggn = last_layer_ggn(base.net, split.x_train)
    k, d = last.out_features, last.in_features + 1
    eye = torch.eye(k * d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    eps = torch.randn(num_samples, k, generator=gen, dtype=torch.float64)

    def predictive(x: Tensor, covariance: Tensor) -> Tensor:
        with torch.no_grad():
            f = _with_bias(features(x).double())
            mean = f @ _weights(last).T
            blocks = covariance.view(k, d, k, d)
            cov = torch.einsum("na,kalb,nb->nkl", f, blocks, f)
            chol = torch.linalg.cholesky(cov + 1e-10 * torch.eye(k, dtype=cov.dtype))
            logits = mean.unsqueeze(0) + torch.einsum("nkl,sl->snk", chol, eps)
            return torch.softmax(logits, -1).mean(0).float()

    scored = []
    for delta in prior_precisions:
        covariance = torch.linalg.inv(ggn + delta * eye)
        scored.append((nll(predictive(split.x_val, covariance), split.y_val), delta, covariance))
    best, delta, covariance = min(scored, key=lambda s: s[0])
    seconds = base.train_seconds + time.process_time() - start
    return Fitted(
        lambda x: predictive(x, covariance),
        seconds,
        base.best_epoch,
        details={"prior_precision": delta, "val_nll": best, **base.details},
    )


def last_layer_ggn(net: nn.Module, x: Tensor) -> Tensor:
    r"""The Gauss-Newton matrix of the cross-entropy summed over ``x`` in the last layer's weights.

    :math:`\sum_n\Lambda_n\otimes\tilde\phi_n\tilde\phi_n^\top`, ``[K(D+1), K(D+1)]``
    float64, parameters ordered as ``vec`` of the ``[K, D + 1]`` matrix (weight, then bias as
    the last column). The last layer is linear, so this is the exact Hessian there.
    """
    features, last = _split_last_linear(net)
    with torch.no_grad():
        phi = _with_bias(features(x).double())
        probs = torch.softmax(phi @ _weights(last).T, -1)
        lam = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
        k, d = probs.shape[-1], phi.shape[-1]
        return torch.einsum("nkl,na,nb->kalb", lam, phi, phi).reshape(k * d, k * d)


def _with_bias(phi: Tensor) -> Tensor:
    return torch.cat([phi, torch.ones_like(phi[:, :1])], dim=-1)


def _weights(last: nn.Linear) -> Tensor:
    """``[K, D + 1]``: the last layer's weight with its bias as the last column, float64."""
    bias = last.bias if last.bias is not None else torch.zeros(last.out_features)
    return torch.cat([last.weight, bias.unsqueeze(-1)], dim=-1).detach().double()
