"""Test NLL along training of one guide on the Pyro tutorial classifier (issue 41, item 3).

Why does the deterministic guide end with a worse test NLL than AutoNormal on some sets? This
recipe trains **one** guide on the model and data of ``recipes/pyro_classifier_swap.py``
(imported from it) and prints the loss, test NLL and accuracy of the posterior predictive every
``--every`` steps, so that runs with other step sizes, step counts, initial scales or initial
means can be compared with the swap recipe's two runs.

Options: ``--kind dvi|autonormal``, ``--lr`` (Adam), ``--steps``, ``--init-scale`` (the guide's
``init_scale``; default: the guide's own), ``--init-means`` (``default``: the guide's own
``init_loc_fn``; ``normal:S``: weight matrices from N(0, S²), everything else as
:func:`lightning_dvi.pyro.init_to_he`, i.e. AutoNormal-like small random means),
``--init-seed`` (the random draws, initial means included, on the split of ``--seed``),
``--swap-draw`` (``dvi`` only: draw the initial means as ``pyro_classifier_swap.py`` does,
after a second model is built, so that the trajectory is the swap run's deterministic one),
``--json PATH`` (append the options and the last evaluation as one JSON line). Each evaluation
also records, per weight site, the mean posterior scale and the largest absolute posterior
mean (``scales``). At the end it prints the final ELBO (the deterministic one for ``dvi``, a
100-draw ``Trace_ELBO`` mean else) and the ``--worst`` largest per-point test NLLs with their
share of the total (``worst``, ``worst_share``). ``--repeat-evals R`` evaluates the final test NLL
``R`` more times with ``--predictive`` draws each (``nll_repeats``: the spread of one
evaluation), ``--final-draws N`` once more with ``N`` draws, vectorised (``nll_final_draws``:
the estimate's bias; the log of a Monte Carlo mean of small probabilities reads high).

Run:  .venv/bin/python recipes/pyro_parity_trajectory.py --kind autonormal --lr 0.03 --every 500

(breast cancer, one Bernoulli logit, by default). The deterministic guide's training draws no
random numbers, so its losses do not depend on ``--every``; AutoNormal's do (each evaluation
draws weights from the same generator).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling recipe's model and data
from pyro_classifier_swap import Classifier, class_probs, load, vectorised_probs

from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, init_to_he


def normal_weight_means(std: float) -> Any:
    """An ``init_loc_fn``: weight matrices from N(0, std²), other sites as ``init_to_he``."""

    def init(site: dict) -> Tensor:
        value = init_to_he(site)
        if value.dim() >= 2 and site["fn"].event_dim >= 2:
            value = torch.randn_like(value) * std
        return value

    return init


def site_scales(guide: Any) -> dict[str, list[float]]:
    """Per weight site: ``[mean posterior scale, largest absolute posterior mean]``."""
    out = {}
    for site in ("fc1.weight", "fc2.weight"):
        loc, scale = guide._get_loc_and_scale(site)
        out[site] = [round(scale.mean().item(), 4), round(loc.abs().max().item(), 3)]
    return out


def test_nll(probs: Tensor, y: Tensor) -> float:
    """Mean negative log of the true class's predictive probability (clamped at 1e-12)."""
    return -probs.clamp_min(1e-12).log().gather(-1, y[:, None]).mean().item()


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train one guide; print (and return) the loss, test NLL and accuracy every few steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "cancer", "parity"), default="cancer")
    parser.add_argument("--likelihood", choices=("categorical", "bernoulli"), default="bernoulli")
    parser.add_argument("--kind", choices=("dvi", "autonormal"), default="dvi")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--init-scale", type=float, default=None)
    parser.add_argument("--init-means", default="default", help="default or normal:STD")
    parser.add_argument("--seed", type=int, default=0, help="the split (and the draws)")
    parser.add_argument(
        "--init-seed", type=int, default=None, help="the draws (initial means, AutoNormal's)"
    )
    parser.add_argument("--json", default=None, help="append the last row as a JSON line here")
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--predictive", type=int, default=300)
    parser.add_argument("--swap-draw", action="store_true", help="the swap recipe's initial draw")
    parser.add_argument("--worst", type=int, default=3, help="report the K worst test points")
    parser.add_argument("--repeat-evals", type=int, default=0, help="re-evaluate the end R times")
    parser.add_argument("--final-draws", type=int, default=0, help="end NLL from N draws")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y, x_te, y_te = load(args.data, args.seed)
    classes = int(y.max()) + 1
    y_obs = y.float() if args.likelihood == "bernoulli" else y
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed if args.init_seed is None else args.init_seed)
    model = Classifier(
        x.shape[1], 1 if args.likelihood == "bernoulli" else classes, args.likelihood
    )
    options: dict[str, Any] = {}
    if args.init_scale is not None:
        options["init_scale"] = args.init_scale
    if args.init_means.startswith("normal:"):
        options["init_loc_fn"] = normal_weight_means(float(args.init_means.split(":")[1]))
    if args.kind == "dvi":
        guide: Any = DeterministicGuide(model, **options)
        loss: pyro.infer.ELBO = DeterministicELBO()
        if args.swap_draw:  # the swap recipe builds AutoNormal's model before the first step
            Classifier(
                x.shape[1], 1 if args.likelihood == "bernoulli" else classes, args.likelihood
            )
    else:
        guide, loss = AutoNormal(model, **options), Trace_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": args.lr}), loss)
    cpu, rows = 0.0, []
    print(f"{args.data}, {args.likelihood}, {args.kind}, {vars(args)}")
    for step in range(1, args.steps + 1):
        start = time.process_time()
        value = svi.step(x, y_obs)
        cpu += time.process_time() - start
        if step % args.every == 0 or step == args.steps:
            probs = class_probs(model, guide, x_te, args.predictive)
            per_point = -probs.clamp_min(1e-12).log().gather(-1, y_te[:, None]).squeeze(-1)
            nll = per_point.mean().item()
            acc = (probs.argmax(-1) == y_te).float().mean().item()
            worst = per_point.sort(descending=True).values[: args.worst]
            rows.append(
                {
                    "step": step,
                    "loss": value,
                    "nll": nll,
                    "acc": acc,
                    "cpu": cpu,
                    "scales": site_scales(guide),
                    "worst": worst.tolist(),
                    "worst_share": (worst.sum() / per_point.sum()).item(),
                }
            )
            print(
                f"step {step}: loss {value:.1f}, test NLL {nll:.4f}, acc {acc:.3f}, "
                f"CPU {cpu:.1f} s, worst {args.worst} points {rows[-1]['worst_share']:.0%} of it, "
                f"scales {rows[-1]['scales']}",
                flush=True,
            )
    with torch.no_grad():  # the final ELBO: exact for dvi, a 100-draw Trace_ELBO mean else
        if args.kind == "dvi":
            rows[-1]["final_elbo"] = -DeterministicELBO().loss(model, guide, x, y_obs)
        else:
            draws = [Trace_ELBO().loss(model, guide, x, y_obs) for _ in range(100)]
            rows[-1]["final_elbo"] = -sum(draws) / len(draws)
    print(f"final ELBO {rows[-1]['final_elbo']:.1f}")
    if args.repeat_evals:
        repeats = [
            test_nll(class_probs(model, guide, x_te, args.predictive), y_te)
            for _ in range(args.repeat_evals)
        ]
        rows[-1]["nll_repeats"] = repeats
        spread = torch.tensor(repeats)
        print(
            f"{args.repeat_evals} evaluations of {args.predictive} draws: mean "
            f"{spread.mean():.4f}, sd {spread.std():.4f}, {spread.min():.4f}-{spread.max():.4f}"
        )
    if args.final_draws:
        rows[-1]["nll_final_draws"] = test_nll(
            vectorised_probs(guide, x_te, args.likelihood, args.final_draws), y_te
        )
        print(f"test NLL from {args.final_draws} draws: {rows[-1]['nll_final_draws']:.4f}")
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps({**vars(args), **rows[-1]}) + "\n")
    return rows


if __name__ == "__main__":
    main()
