"""A Pyro tutorial classifier trained with AutoNormal + Trace_ELBO and with DVI (issue 23).

The model is the Pyro tutorial BNN classifier, unchanged between the two runs: two
``PyroModule[nn.Linear]`` layers (hidden width 64) with ``PyroSample(Normal(0, 1))`` weights,
ReLU, and ``pyro.sample("obs", <likelihood>, obs=y)`` inside ``pyro.plate("data", N)``. Data:
scikit-learn's digits (10 classes), breast-cancer (2 classes) or digits-parity (2 classes: odd
digit or not) set, standardised with the
training statistics, a 78/22 split with ``--seed``. ``--likelihood`` picks the observation:
``categorical`` (``dist.Categorical(logits=f)``) or, for two classes, ``bernoulli``
(``dist.Bernoulli(logits=f.squeeze(-1))``, one output).

Printed per guide: the final loss the objective reports, the "true" loss of the same guide
(the mean of ``--check-draws`` single-draw ``Trace_ELBO`` evaluations, with its standard
error), test accuracy and NLL of the posterior predictive (``Predictive`` with ``--predictive``
weight draws, the mixture of the class probabilities), wall and CPU time per step.

``--prior fan_in`` changes the model for both guides alike (weight matrices
``Normal(0, 1/fan_in)``; see :class:`Classifier`); ``--json PATH`` appends one JSON line per
guide (options, seed, the printed figures).

``--protocol`` picks how a run ends, the same for both guides:

* ``fixed``: the parameters after ``--steps`` steps on all training rows;
* ``validation``: ``--val-fraction`` of the training rows (a seeded draw) are held out; each
  guide trains on the rest for ``--steps`` steps, its held-out NLL
  (:func:`lightning_dvi.pyro.predictive_nll`, ``--val-draws`` weight draws with a fixed seed) is
  evaluated every ``--val-every`` steps, and a
  :class:`lightning_dvi.pyro.ValidationCheckpoint` restores the parameters of the best
  evaluation (``best_step``; ``nll_last``: the test NLL at the last step, before the restore).

``--trace-evals`` records, at each validation evaluation, the validation rows' log predictive
densities and the test NLL from ``--trace-draws`` vectorised draws (``trace`` in the JSON line;
:func:`traced_score`), so that other selection rules can be replayed offline.
``--final-draws N`` evaluates the test NLL from ``N`` weight draws, vectorised
(:func:`vectorised_probs`), instead of ``--predictive`` model runs. ``--categorical-method``
(analysis only) trains the deterministic guide's ``Categorical`` site with another method of
:class:`lightning_dvi.likelihoods.Categorical` (``tight``, the default, or ``bound``).

Run:  .venv/bin/python recipes/pyro_classifier_swap.py --data digits --steps 1500 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import Tensor, nn

from lightning_dvi import likelihoods
from lightning_dvi.pyro import (
    DeterministicELBO,
    DeterministicGuide,
    ValidationCheckpoint,
    predictive_log_density,
    predictive_nll,
)


class Classifier(PyroModule):
    """``x -> relu(W1 x + b1) -> W2 h + b2``, Normal priors, one observed site.

    ``prior="standard"`` (the tutorial's): every weight and bias ``Normal(0, 1)``.
    ``prior="fan_in"``: each weight matrix ``Normal(0, 1/fan_in)`` (Neal's scaling, the prior
    that keeps a unit's prior pre-activation variance of order one whatever the layer's
    width), biases ``Normal(0, 1)``.
    """

    def __init__(
        self, d_in: int, outputs: int, likelihood: str, hidden: int = 64, prior: str = "standard"
    ) -> None:
        super().__init__()
        if prior not in ("standard", "fan_in"):
            raise ValueError(f"prior must be 'standard' or 'fan_in', got {prior!r}")
        self.likelihood = likelihood

        def weight(fan_out: int, fan_in: int) -> PyroSample:
            scale = 1.0 if prior == "standard" else fan_in**-0.5
            return PyroSample(dist.Normal(0.0, scale).expand([fan_out, fan_in]).to_event(2))

        self.fc1 = PyroModule[nn.Linear](d_in, hidden)
        self.fc1.weight = weight(hidden, d_in)
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](hidden, outputs)
        self.fc2.weight = weight(outputs, hidden)
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([outputs]).to_event(1))

    def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """Logits ``[N, K]`` (``[N]`` for the Bernoulli site); observes ``y`` if given."""
        f = self.fc2(torch.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            if self.likelihood == "bernoulli":
                f = f.squeeze(-1)
                pyro.sample("obs", dist.Bernoulli(logits=f), obs=y)
            else:
                pyro.sample("obs", dist.Categorical(logits=f), obs=y)
        return f


def load(name: str, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Standardised ``(x_train, y_train, x_test, y_test)``, a 78/22 split."""
    from sklearn.datasets import load_breast_cancer, load_digits
    from sklearn.model_selection import train_test_split

    x, y = (load_breast_cancer if name == "cancer" else load_digits)(return_X_y=True)
    if name == "parity":
        y = y % 2
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.22, random_state=seed)
    mean, std = x_tr.mean(0), x_tr.std(0)
    std[std == 0] = 1.0
    as_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    return as_x(x_tr), torch.tensor(y_tr), as_x(x_te), torch.tensor(y_te)


def class_probs(model: Classifier, guide: nn.Module, x: Tensor, draws: int) -> Tensor:
    """Posterior predictive class probabilities ``[N, K]`` (mixture over weight draws)."""
    with torch.no_grad():
        f = Predictive(model, guide=guide, num_samples=draws, return_sites=["_RETURN"])(x)
    f = f["_RETURN"]
    if model.likelihood == "bernoulli":
        p = torch.sigmoid(f)
        return torch.stack([1 - p, p], -1).mean(0)
    return torch.softmax(f, -1).mean(0)


def vectorised_probs(guide: Any, x: Tensor, likelihood: str, draws: int) -> Tensor:
    """The posterior predictive ``[N, K]`` of the recipe's classifier from ``draws`` weight draws.

    The same mixture as :func:`class_probs`, drawn in chunks of 1,000 with batched matrix
    products instead of one model run per draw.
    """
    params = {
        site: guide._get_loc_and_scale(site)
        for site in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    }
    total = torch.zeros(())
    with torch.no_grad():
        for start in range(0, draws, 1000):
            n = min(1000, draws - start)
            w = {k: loc + scale * torch.randn(n, *loc.shape) for k, (loc, scale) in params.items()}
            h = torch.relu(x @ w["fc1.weight"].transpose(1, 2) + w["fc1.bias"][:, None])
            f = h @ w["fc2.weight"].transpose(1, 2) + w["fc2.bias"][:, None]
            if likelihood == "bernoulli":
                p = torch.sigmoid(f.squeeze(-1))
                probs = torch.stack([1 - p, p], -1)
            else:
                probs = torch.softmax(f, -1)
            total = total + probs.sum(0)
    return total / draws


def test_probs(args: argparse.Namespace, model: Classifier, guide: nn.Module, x: Tensor) -> Tensor:
    """The test predictive: ``--final-draws`` vectorised draws, else ``--predictive`` runs."""
    if args.final_draws:
        return vectorised_probs(guide, x, args.likelihood, args.final_draws)
    return class_probs(model, guide, x, args.predictive)


def nll_of(probs: Tensor, y: Tensor) -> float:
    """Mean negative log of the true class's predictive probability (clamped at 1e-12)."""
    return -probs.clamp_min(1e-12).log().gather(-1, y[:, None]).mean().item()


@contextlib.contextmanager
def categorical_method(method: str) -> Iterator[None]:
    """Inside: the Pyro front-end's ``Categorical`` sites use ``method`` (analysis only)."""
    if method == "tight":
        yield
        return

    class Method(likelihoods.Categorical):
        def __init__(self, num_classes: int) -> None:
            super().__init__(num_classes, method=method)

    with mock.patch.object(likelihoods, "Categorical", Method):
        yield


def build(args: argparse.Namespace, kind: str, x: Tensor) -> tuple[Classifier, nn.Module, SVI]:
    """The model, guide and SVI of one run (``kind``: ``"dvi"`` or ``"autonormal"``)."""
    outputs = 1 if args.likelihood == "bernoulli" else args.classes
    model = Classifier(x.shape[1], outputs, args.likelihood, prior=args.prior)
    if kind == "dvi":
        guide: nn.Module = DeterministicGuide(model)
        loss: pyro.infer.ELBO = DeterministicELBO()
    else:
        guide, loss = AutoNormal(model), Trace_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": args.lr}), loss)
    svi.elbo = loss  # type: ignore[attr-defined]  # kept for evaluate()
    return model, guide, svi


def evaluate(
    args: argparse.Namespace, model: Classifier, guide: nn.Module, svi: SVI, data: tuple
) -> dict[str, float]:
    """Final reported loss, the true loss of the guide, test accuracy and NLL."""
    x, y, x_te, y_te = data
    elbo = svi.elbo  # type: ignore[attr-defined]  # set in build()
    if isinstance(elbo, DeterministicELBO):  # deterministic: the final loss itself
        reported = elbo.loss(model, guide, x, y)
    else:  # its own estimate, averaged over 50 draws at the final parameters
        reported = sum(elbo.loss(model, guide, x, y) for _ in range(50)) / 50
    with torch.no_grad():
        check = torch.tensor(
            [Trace_ELBO().loss(model, guide, x, y) for _ in range(args.check_draws)]
        )
    probs = test_probs(args, model, guide, x_te)
    return {
        "reported": float(reported),
        "true": check.mean().item(),
        "true_se": (check.std() / math.sqrt(args.check_draws)).item(),
        "acc": (probs.argmax(-1) == y_te).float().mean().item(),
        "nll": nll_of(probs, y_te),
    }


def split_validation(
    x: Tensor, y: Tensor, fraction: float, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_fit, y_fit, x_val, y_val)``: a seeded ``fraction`` of the rows held out."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = round(fraction * len(x))
    val, fit = order[:n_val], order[n_val:]
    return x[fit], y[fit], x[val], y[val]


def traced_score(
    args: argparse.Namespace, kind: str, model: Classifier, guide: nn.Module, data: tuple
) -> Any:
    """A validation score that also records, per evaluation, what a selection rule may use.

    ``args.traces[kind]`` gets one row per evaluation: the validation rows' log predictive
    densities (:func:`lightning_dvi.pyro.predictive_log_density`, the score's own draws) and
    the test NLL and accuracy from ``--trace-draws`` vectorised draws (a forked generator with
    a fixed seed: the training draws are those of a run without the trace). Analysis only:
    the checkpoint sees the validation NLL alone.
    """
    x_val, y_val, x_te, y_te = data
    rows = args.traces.setdefault(kind, [])

    def score() -> float:
        log_p = predictive_log_density(
            model, guide, x_val, y_val, num_samples=args.val_draws, seed=args.seed
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed + 1)
            probs = vectorised_probs(guide, x_te, args.likelihood, args.trace_draws)
        rows.append(
            {
                "val_log_p": [round(v, 6) for v in log_p.tolist()],
                "test_nll": nll_of(probs, y_te),
                "test_acc": (probs.argmax(-1) == y_te).float().mean().item(),
            }
        )
        return -log_p.mean().item()

    return score


def train(
    args: argparse.Namespace,
) -> tuple[tuple, dict[str, tuple[Classifier, nn.Module, SVI]], dict[str, float], dict[str, float]]:
    """Train every guide of ``args.guides`` on its own copy of the model, steps interleaved.

    Returns ``((x, y_obs, x_test, y_test), {kind: (model, guide, svi)}, cpu, wall)`` with the
    CPU and wall seconds of each guide's steps after the first. Under
    ``--protocol validation`` ``x, y_obs`` are the rows trained on (the held-out ones
    removed), every guide ends at its checkpoint's parameters, and ``args.validation`` holds,
    per guide, the checkpoint's history, best step, CPU seconds and the test NLL and accuracy
    at the last step (before the restore).
    """
    x, y, x_te, y_te = load(args.data, args.seed)
    args.classes = int(y.max()) + 1
    y_obs = y.float() if args.likelihood == "bernoulli" else y
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    kinds = args.guides.split(",")
    runs = {kind: build(args, kind, x) for kind in kinds}  # distinct guide names: one store
    checkpoints: dict[str, ValidationCheckpoint] = {}
    args.traces = {}
    if args.protocol == "validation":
        x, y_obs, x_val, y_val = split_validation(x, y_obs, args.val_fraction, args.seed)
        for kind, (model, guide, _) in runs.items():
            score = lambda m=model, g=guide: predictive_nll(  # noqa: E731
                m, g, x_val, y_val, num_samples=args.val_draws, seed=args.seed
            )
            if args.trace_evals:
                score = traced_score(args, kind, model, guide, (x_val, y_val, x_te, y_te))
            checkpoints[kind] = ValidationCheckpoint(score, every=args.val_every, params=guide)
    for _, _, svi in runs.values():
        svi.step(x, y_obs)  # builds the guide (not timed)
    cpu, wall = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0.0)
    val_cpu = dict.fromkeys(kinds, 0.0)
    for step in range(2, args.steps + 1):  # interleaved, so that both see the same machine load
        for kind, (_, _, svi) in runs.items():
            c, w = time.process_time(), time.perf_counter()
            svi.step(x, y_obs)
            cpu[kind] += time.process_time() - c
            wall[kind] += time.perf_counter() - w
            if kind in checkpoints:
                c = time.process_time()
                checkpoints[kind].update(step)
                val_cpu[kind] += time.process_time() - c
    args.validation = {}
    for kind, checkpoint in checkpoints.items():
        model, guide, _ = runs[kind]
        if checkpoint.best_step is None or checkpoint.history[-1][0] != args.steps:
            checkpoint.evaluate(args.steps)  # the last step is always a candidate
        probs = test_probs(args, model, guide, x_te)
        args.validation[kind] = {
            "nll_last": nll_of(probs, y_te),
            "acc_last": (probs.argmax(-1) == y_te).float().mean().item(),
            "best_step": checkpoint.restore(),
            "best_val_nll": checkpoint.best_score,
            "val_history": checkpoint.history,
            "val_cpu_s": val_cpu[kind],
        }
        if kind in args.traces:
            args.validation[kind]["trace"] = args.traces[kind]
    return (x, y_obs, x_te, y_te), runs, cpu, wall


def make_parser() -> argparse.ArgumentParser:
    """The recipe's options (shared with the diagnosis recipes that import it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "cancer", "parity"), default="digits")
    parser.add_argument("--likelihood", choices=("categorical", "bernoulli"), default="categorical")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-draws", type=int, default=20)
    parser.add_argument("--predictive", type=int, default=500)
    parser.add_argument("--guides", default="dvi,autonormal")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (timings)")
    parser.add_argument("--json", default=None, help="append one JSON line per guide here")
    parser.add_argument("--protocol", choices=("fixed", "validation"), default="fixed")
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--val-draws", type=int, default=100)
    parser.add_argument("--final-draws", type=int, default=0, help="test NLL from N draws")
    parser.add_argument(
        "--trace-evals", action="store_true", help="record each evaluation (traced_score)"
    )
    parser.add_argument("--trace-draws", type=int, default=2000)
    parser.add_argument(
        "--categorical-method", choices=("tight", "bound"), default="tight", help="analysis"
    )
    parser.add_argument(
        "--prior",
        choices=("standard", "fan_in"),
        default="standard",
        help="the model's weight prior, the same for both guides (see Classifier)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Train both guides on the same model, data and seed; print one table row each."""
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"{args.data}, {args.likelihood}, {args.prior} prior, {args.steps} steps, seed {args.seed}, "
        f"{args.threads} thread(s), load {os.getloadavg()[0]:.2f}"
    )
    with categorical_method(args.categorical_method):
        report(args, *train(args))
    print(f"load after: {os.getloadavg()[0]:.2f}")


def report(
    args: argparse.Namespace,
    data: tuple,
    runs: dict[str, tuple[Classifier, nn.Module, SVI]],
    cpu: dict[str, float],
    wall: dict[str, float],
) -> None:
    """Print (and with ``--json`` append) one row per guide."""
    x, y_obs, x_te, y_te = data
    print(
        "| guide + loss | reported loss | true loss (Trace_ELBO, s.e.) | true / reported | "
        "test acc | test NLL | wall ms/step | CPU ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, (model, guide, svi) in runs.items():
        r = evaluate(args, model, guide, svi, (x, y_obs, x_te, y_te))
        wall_ms, cpu_ms = (1e3 * t[kind] / (args.steps - 1) for t in (wall, cpu))
        name = {"dvi": "DeterministicGuide + DeterministicELBO"}.get(
            kind, "AutoNormal + Trace_ELBO"
        )
        print(
            f"| {name} | {r['reported']:.1f} | {r['true']:.1f} ({r['true_se']:.1f}) | "
            f"{r['true'] / r['reported']:.3f} | {r['acc']:.3f} | {r['nll']:.3f} | "
            f"{wall_ms:.2f} | {cpu_ms:.2f} |",
            flush=True,
        )
        if kind in args.validation:
            v = args.validation[kind]
            print(
                f"  {kind}: best validation NLL {v['best_val_nll']:.4f} at step {v['best_step']}"
                f" (validation {v['val_cpu_s']:.1f} CPU s); at step {args.steps}: test NLL "
                f"{v['nll_last']:.4f}, acc {v['acc_last']:.3f}",
                flush=True,
            )
        if args.json:
            keys = ("data", "likelihood", "prior", "steps", "lr", "protocol", "val_fraction")
            keys += ("val_every", "val_draws", "final_draws", "predictive", "categorical_method")
            options = {k: getattr(args, k) for k in keys}
            row = {**options, "seed": args.seed, "guide": kind, **r, "cpu_ms": cpu_ms}
            row.update(args.validation.get(kind, {}))
            with open(args.json, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
