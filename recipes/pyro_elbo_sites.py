"""The ELBO of the Pyro tutorial classifier, site by site: deterministic against Monte Carlo.

Issue 41, item 3. Trains the two guides of ``recipes/pyro_classifier_swap.py`` exactly as that
recipe does (same options, same interleaved steps, imported from it), then, at the trained
parameters of **each** guide (AutoNormal's locs and scales are copied into a second
DeterministicGuide, so the deterministic objective can be evaluated at AutoNormal's solution too),
prints per site:

* weight sites: the analytic ``-KL(q || p)`` of the moment pass against the Monte Carlo mean of
  ``log p(w) - log q(w)`` over ``--draws`` weight draws (with its standard error);
* the observed site: the moment pass's expected log-likelihood (``diag``, the guide's mode, and
  ``full``), the Monte Carlo over logits drawn from the moment pass's own Gaussian (separates
  the bound's looseness from the moment pass's Gaussian approximation), and the Monte Carlo over
  weight draws, the true ``E_q log p(y | f(w))`` (with its standard error);
* the total ELBO both ways, and the test NLL of the posterior predictive.

Run:  .venv/bin/python recipes/pyro_elbo_sites.py --data parity --likelihood categorical
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling recipe's model and data
from pyro_classifier_swap import Classifier, class_probs, make_parser, train

from lightning_dvi.propagation import moment_propagation
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide


def moment_pass(model: Classifier, guide: DeterministicGuide, x: Tensor, y: Tensor, mode: str):
    """``({site: ELBO term}, logits MomentTensor)`` of one moment pass in ``mode``."""
    saved = guide.mode
    guide.mode = moment_propagation(mode)
    try:
        with torch.no_grad():
            trace, _ = DeterministicELBO()._get_trace(model, guide, (x, y), {})
    finally:
        guide.mode = saved
    trace.compute_log_prob()
    terms = {
        name: float(site["log_prob_sum"])
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
    }
    return terms, trace.nodes["_RETURN"]["value"]


def gaussian_logits_mc(f: Any, y: Tensor, likelihood: str, draws: int) -> tuple[float, float]:
    """Monte Carlo ``sum_n E log p(y_n | a_n)``, ``a_n`` from the moment pass's Gaussian."""
    g = f.moments()
    gen = torch.Generator().manual_seed(1)
    totals = []
    for _ in range(draws):
        if likelihood == "bernoulli":
            a = g.mean + g.var.sqrt() * torch.randn(g.mean.shape, generator=gen)
            a = a.squeeze(-1) if a.dim() > y.dim() else a
            ll = y * a - torch.nn.functional.softplus(a)
        else:
            cov = g.cov if g.cov is not None else torch.diag_embed(g.var)
            chol = torch.linalg.cholesky(cov + 1e-9 * torch.eye(cov.shape[-1]))
            eps = torch.randn(g.mean.shape, generator=gen)
            a = g.mean + (chol @ eps.unsqueeze(-1)).squeeze(-1)
            ll = torch.log_softmax(a, -1).gather(-1, y[:, None]).squeeze(-1)
        totals.append(float(ll.sum()))
    t = torch.tensor(totals, dtype=torch.float64)
    return t.mean().item(), (t.std() / math.sqrt(draws)).item()


def weight_mc(
    model: Classifier, guide: DeterministicGuide, x: Tensor, y: Tensor, draws: int
) -> dict[str, tuple[float, float]]:
    """Per site, Monte Carlo ``log p - log q`` (weights) or ``log p(y|f(w))`` (obs), with s.e.

    Key ``"ELBO"``: their sum, per draw (a single-draw ``Trace_ELBO``), with its s.e.
    """
    values: dict[str, list[float]] = {"ELBO": []}
    with torch.no_grad():
        for _ in range(draws):
            total = 0.0
            g_tr = poutine.trace(guide).get_trace(x, y)
            m_tr = poutine.trace(poutine.replay(model, trace=g_tr)).get_trace(x, y)
            m_tr.compute_log_prob()
            g_tr.compute_log_prob()
            for name, site in m_tr.nodes.items():
                if site["type"] != "sample":
                    continue
                v = float(site["log_prob_sum"])
                if name in g_tr.nodes:
                    v -= float(g_tr.nodes[name]["log_prob_sum"])
                values.setdefault(name, []).append(v)
                total += v
            values["ELBO"].append(total)
    out = {}
    for name, vs in values.items():
        t = torch.tensor(vs, dtype=torch.float64)
        out[name] = (t.mean().item(), (t.std() / math.sqrt(draws)).item())
    return out


def as_deterministic(model: Classifier, guide: Any, x: Tensor, y: Tensor) -> DeterministicGuide:
    """A DeterministicGuide (own param-store prefix) holding ``guide``'s locs and scales."""
    if isinstance(guide, DeterministicGuide):
        return guide
    copy = DeterministicGuide(model, name="copy_of_" + guide._pyro_name)
    moment_pass(model, copy, x, y, "diag")  # registers its parameters and their constraints
    store = pyro.get_param_store()
    with torch.no_grad():
        for name in copy.weight_sites:
            loc, scale = guide._get_loc_and_scale(name)
            store[f"{copy._pyro_name}.locs.{name}"] = loc.detach().clone()
            store[f"{copy._pyro_name}.scales.{name}"] = scale.detach().clone()
    with torch.no_grad():  # the copy holds the guide's values (to the constraint's rounding)
        for name, q in copy.moment_posteriors(x, y).items():
            loc, scale = guide._get_loc_and_scale(name)
            assert torch.allclose(q.dvi_mean, loc) and torch.allclose(q.dvi_var, scale**2), name
    return copy


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train as the swap recipe does; print (and return) the ELBO terms of each trained guide."""
    parser = make_parser()
    parser.add_argument("--draws", type=int, default=200, help="Monte Carlo weight draws")
    parser.add_argument("--logit-draws", type=int, default=2000, help="Gaussian-logit draws")
    parser.add_argument(
        "--continue-steps",
        type=int,
        default=0,
        help="then train the copy of AutoNormal's solution with DeterministicELBO this long",
    )
    parser.add_argument("--every", type=int, default=250, help="evaluations while continuing")
    args: argparse.Namespace = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data, runs, _, _ = train(args)
    x, y, x_te, y_te = data
    print(f"{args.data}, {args.likelihood}, {args.steps} steps, seed {args.seed}")
    copies, results = {}, {}
    for kind, (model, guide, _) in runs.items():
        probs = class_probs(model, guide, x_te, args.predictive)
        nll = -probs.clamp_min(1e-12).log().gather(-1, y_te[:, None]).mean().item()
        det = copies[kind] = as_deterministic(model, guide, x, y)
        rows = site_terms(model, det, x, y, args)
        results[kind] = {"nll": nll, "sites": rows}
        print(f"\n{kind}: test NLL {nll:.4f}")
        print(
            "| site | moment pass (diag) | (full) | MC, Gaussian logits (s.e.) | MC, weights (s.e.) |"
        )
        print("|---|---|---|---|---|")
        for name, r in rows.items():
            gl = f"{r['logit_mc']:.1f} ({r['logit_mc_se']:.1f})" if "logit_mc" in r else ""
            print(
                f"| {name} | {r['diag']:.1f} | {r['full']:.1f} | {gl} | "
                f"{r['mc']:.1f} ({r['mc_se']:.1f}) |"
            )
        with torch.no_grad():
            scales = {n: float(det._get_loc_and_scale(n)[1].mean()) for n in det.weight_sites}
        print("mean posterior scale per site:", {k: round(v, 3) for k, v in scales.items()})
        with torch.no_grad():
            unit_scale = det._get_loc_and_scale("fc1.weight")[1].mean(-1)
        point = -probs.clamp_min(1e-12).log().gather(-1, y_te[:, None]).squeeze(-1)
        top = point.sort(descending=True).values[:8]
        print(
            f"hidden units with mean fc1 posterior scale < 0.5: {int((unit_scale < 0.5).sum())}"
            f"/{unit_scale.numel()}; largest test-point NLLs {[round(v, 2) for v in top.tolist()]}"
            f" (sum {float(top.sum()):.1f} of {float(point.sum()):.1f})"
        )
    if args.continue_steps and "autonormal" in runs:
        model, det = runs["autonormal"][0], copies["autonormal"]
        results["continued"] = continue_training(args, model, det, data)
    return results


def site_terms(
    model: Classifier, det: DeterministicGuide, x: Tensor, y: Tensor, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """The ELBO terms of ``det``'s parameters, per site and in total (``"ELBO"``).

    Each: the moment pass in diag and full mode, Monte Carlo over ``args.draws`` weight draws;
    at the observed site also over ``args.logit_draws`` draws of the moment pass's logits.
    """
    diag, f = moment_pass(model, det, x, y, "diag")
    full, _ = moment_pass(model, det, x, y, "full")
    diag["ELBO"], full["ELBO"] = sum(diag.values()), sum(full.values())
    mc = weight_mc(model, det, x, y, args.draws)
    rows = {n: {"diag": diag[n], "full": full[n], "mc": mc[n][0], "mc_se": mc[n][1]} for n in diag}
    rows["obs"]["logit_mc"], rows["obs"]["logit_mc_se"] = gaussian_logits_mc(
        f, y, args.likelihood, args.logit_draws
    )
    return rows


def continue_training(
    args: argparse.Namespace, model: Classifier, det: DeterministicGuide, data: tuple
) -> list[dict[str, float]]:
    """Train the deterministic copy of AutoNormal's solution on the deterministic ELBO.

    Starts where AutoNormal stopped; prints the (deterministic) ELBO and the test NLL every
    ``--every`` steps: whether climbing the same ELBO from AutoNormal's point worsens the NLL.
    """
    x, y, x_te, y_te = data
    elbo = DeterministicELBO()
    svi = pyro.infer.SVI(model, det, pyro.optim.Adam({"lr": args.lr}), elbo)
    print(f"\nAutoNormal's solution, trained on with DeterministicELBO, Adam({args.lr}):")
    print("| steps on | ELBO | test NLL | test acc |")
    print("|---|---|---|---|")
    rows = []
    for step in range(args.continue_steps + 1):
        if step % args.every == 0:
            probs = class_probs(model, det, x_te, args.predictive)
            nll = -probs.clamp_min(1e-12).log().gather(-1, y_te[:, None]).mean().item()
            acc = (probs.argmax(-1) == y_te).float().mean().item()
            value = -elbo.loss(model, det, x, y)
            rows.append({"step": step, "elbo": value, "nll": nll, "acc": acc})
            print(f"| {step} | {value:.1f} | {nll:.4f} | {acc:.3f} |")
        if step < args.continue_steps:
            svi.step(x, y)
    return rows


if __name__ == "__main__":
    main()
