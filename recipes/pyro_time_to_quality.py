"""Time to quality for Pyro users: AutoNormal's final test NLL, reached sooner by DVI (issue 39).

The model is the Pyro tutorial classifier of ``recipes/pyro_classifier_swap.py`` (imported from
it: two ``PyroModule[nn.Linear]`` layers, 64 hidden units, ``Normal(0, 1)`` priors, ReLU,
``dist.Categorical(logits=f)``), on the same data and split.

1. **Reference**: ``AutoNormal`` + ``Trace_ELBO``, ``pyro.optim.Adam({"lr": 1e-2})``,
   ``--steps`` full-batch steps (the tutorial setting, and the swap recipe's). Its final test
   NLL (posterior predictive, ``--predictive`` weight draws) is the *target*.
2. **DVI, L-BFGS** (the documented loop): the deterministic objective has no gradient noise, so
   ``torch.optim.LBFGS`` (strong-Wolfe line search) runs on
   ``DeterministicELBO().differentiable_loss`` over the guide's parameters.
3. **DVI, Adam** with a larger step, ``--adam-lr``.

The runs advance in ``--rounds`` interleaved rounds (AutoNormal ``steps / rounds`` steps, then
each DVI run its share), so that all see the same machine load; each DVI run's test NLL is
evaluated after every round. Printed: per run, the CPU and wall seconds of training until the
first evaluation whose test NLL is at most the target, and its NLL and time at the end of its
budget. Training time only: building the guides (their first call) and the evaluations are
not timed. One torch thread. CPU time (``time.process_time``) is the figure to compare on a
shared machine.

``--step-cost ROUNDS`` measures instead one step of each guide (CPU ms, interleaved rounds, after
50 training steps) and splits the deterministic step into the arithmetic of its parts (each
layer's moments, the ``[N, K, K]`` head covariance, the categorical objective, the KL), the Pyro
handling around them, the guide's trace, the site-shape check and SVI's bookkeeping.

Run:  .venv/bin/python recipes/pyro_time_to_quality.py --data digits --steps 1500 --seed 0
      .venv/bin/python recipes/pyro_time_to_quality.py --data digits --step-cost 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling recipe's model and data
from pyro_classifier_swap import Classifier, class_probs, load

from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide


class Clock:
    """Accumulated CPU and wall seconds of the timed blocks."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0

    def timed(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` and add its time."""
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        self.cpu += time.process_time() - c
        self.wall += time.perf_counter() - w
        return out


def test_nll(model: Classifier, guide: nn.Module, x: Tensor, y: Tensor, draws: int) -> float:
    """Posterior-predictive test NLL (the mixture of class probabilities over weight draws)."""
    probs = class_probs(model, guide, x, draws)
    return -probs.clamp_min(1e-12).log().gather(-1, y[:, None]).mean().item()


def lbfgs_loop(
    model: Classifier, guide: DeterministicGuide, x: Tensor, y: Tensor, history: int = 10
) -> Callable[[int], None]:
    """The documented L-BFGS loop on the deterministic objective; returns ``run(iterations)``.

    ``run(k)`` performs ``k`` L-BFGS iterations (each one or more loss evaluations, with the
    strong-Wolfe line search) on the guide's parameters.
    """
    elbo = DeterministicELBO()
    elbo.loss(model, guide, x, y)  # the first call builds the guide's parameters
    optimizer = torch.optim.LBFGS(
        list(guide.parameters()),
        lr=1.0,
        max_iter=1,
        history_size=history,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = elbo.differentiable_loss(model, guide, x, y)
        loss.backward()
        return loss

    def run(iterations: int) -> None:
        optimizer.param_groups[0]["max_iter"] = iterations
        optimizer.param_groups[0]["max_eval"] = iterations * 5 // 4
        optimizer.step(closure)

    return run


def report(name: str, rows: list[tuple[int, float, float, float]], target: float) -> dict:
    """Print one run's evaluations; return when (if) it first reached ``target``."""
    reached = next((r for r in rows if r[3] <= target), None)
    for it, cpu, wall, nll in rows:
        mark = " <- target reached" if reached is not None and it == reached[0] else ""
        print(f"  {name} {it:5d}: CPU {cpu:6.2f} s, wall {wall:6.2f} s, test NLL {nll:.4f}{mark}")
    return {"name": name, "reached": reached, "last": rows[-1]}


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Mean CPU milliseconds of ``fn()`` over ``repeats`` calls."""
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.process_time() - start) / repeats


def step_cost(x: Tensor, y: Tensor, classes: int, warmup: int, repeats: int) -> dict[str, float]:
    """CPU ms of one step of each guide (interleaved), and where the deterministic step goes.

    Both guides train ``warmup`` steps first (the objective's cost depends on the logit
    variances, which grow in training); then ``repeats`` rounds, each timing once, in turn: an
    AutoNormal step, a deterministic step, the deterministic loss (forward, and with its
    backward), the guide's trace (the parameters collected, ``moment_posteriors``), Pyro's
    site-shape check (now run at the first call of a signature only), and the arithmetic of the
    loss on its own: each part called on detached leaves of the values the pass gives it, with
    the library functions the moment pass calls (forward + backward):

    * layer 1's moments (``linear_moments``), the ReLU's (``activation_moments``), layer 2's
      with the ``[N, K, K]`` head covariance (``linear_moments``, diag mode keeps a head's
      covariance), the categorical objective (``Categorical``'s default method, forward alone
      too), the KL of the four weight sites.

    Derived: *Pyro handling* = the loss (forward + backward) less the sum of its arithmetic
    (the poutine traces, the messenger, the moment-tensor dispatch, the site terms and their
    sum), and *SVI bookkeeping* = the step less the loss (the param-capture trace, Pyro's
    per-parameter Adam, zeroing the gradients).

    Returns:
        CPU ms per part, and the loss the parts add up to (``"loss (parts)"``) beside the
        ELBO's (``"loss (ELBO)"``): the parts are the whole loss.
    """
    import pyro.poutine as poutine

    from lightning_dvi import Gaussian
    from lightning_dvi import moments as M
    from lightning_dvi.likelihoods import Categorical
    from lightning_dvi.moments.activations import relu_diag, relu_full
    from lightning_dvi.priors.functional import gaussian_kl_elementwise

    pyro.set_rng_seed(0)
    runs = {}
    for kind, guide_class, loss in (
        ("dvi", DeterministicGuide, DeterministicELBO()),
        ("autonormal", AutoNormal, Trace_ELBO()),
    ):
        model = Classifier(x.shape[1], classes, "categorical")
        guide = type(f"{guide_class.__name__}_step_cost", (guide_class,), {})(model)
        runs[kind] = (model, guide, loss, SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss))
    for _ in range(warmup):
        for *_, svi in runs.values():
            svi.step(x, y)
    model, guide, elbo, _ = runs["dvi"]
    dvi_guide = cast(DeterministicGuide, guide)
    mode = dvi_guide.mode

    # The arithmetic of one pass, each part on detached leaves of its inputs.
    def leaves(g: Gaussian) -> Gaussian:
        mean = g.mean.detach().requires_grad_()
        if g.cov is not None:
            return Gaussian(mean, cov=g.cov.detach().requires_grad_(), validate=False)
        return Gaussian(mean, var=g.var.detach().requires_grad_(), validate=False)

    def posterior(site: str) -> tuple[Tensor, Tensor]:
        loc, scale = (t.detach().requires_grad_() for t in dvi_guide._get_loc_and_scale(site))
        return loc, scale

    def layer(h: Gaussian | Tensor, site: str) -> Gaussian:
        (w, w_scale), (b, b_scale) = posterior(f"{site}.weight"), posterior(f"{site}.bias")
        return M.linear_moments(h, w, w_scale**2, b, b_scale**2, mode=mode)

    likelihood = Categorical(classes)
    with torch.no_grad():
        h1 = layer(x, "fc1")
        h2 = M.activation_moments(h1, relu_full, relu_diag, mode=mode)
        head = layer(h2, "fc2")
        kl = sum(
            gaussian_kl_elementwise(loc, scale**2, torch.zeros(()), torch.ones(())).sum()
            for loc, scale in map(posterior, dvi_guide.weight_sites)
        )  # the recipe's model: Normal(0, 1) priors
        parts_loss = float(kl - likelihood.expected_log_prob(head, y).sum())
    elbo_loss = elbo.loss(model, guide, x, y)  # the same parameters (the timed steps train)
    h1_in, h2_in, head_in = leaves(h1), leaves(h2), leaves(head)

    def kl_sum() -> Tensor:
        return cast(
            Tensor,
            sum(
                gaussian_kl_elementwise(loc, scale**2, torch.zeros(()), torch.ones(())).sum()
                for loc, scale in map(posterior, dvi_guide.weight_sites)
            ),
        )

    def backward(value: Tensor) -> None:
        value.sum().backward()

    def fresh_trace() -> object:
        """A step's model trace with its log-probs (the check finds them memoised)."""
        model_trace, _ = elbo._get_trace(model, guide, (x, y), {})  # type: ignore[attr-defined]
        with pyro.validation_enabled(False):
            model_trace.compute_log_prob()
        return model_trace

    method = likelihood.method
    timed: dict[str, Callable[[], object]] = {
        "dvi step": lambda: runs["dvi"][3].step(x, y),
        "autonormal step": lambda: runs["autonormal"][3].step(x, y),
        "loss forward": lambda: elbo.differentiable_loss(model, guide, x, y),
        "loss forward + backward": lambda: elbo.differentiable_loss(model, guide, x, y).backward(),
        "guide trace (parameters collected)": lambda: poutine.trace(
            dvi_guide.moment_posteriors
        ).get_trace(x, y),
        "layer 1 moments": lambda: backward(layer(x, "fc1").var),
        "ReLU moments": lambda: backward(
            M.activation_moments(h1_in, relu_full, relu_diag, mode=mode).var
        ),
        "layer 2 moments, [N, K, K] head covariance": lambda: backward(
            cast(Tensor, layer(h2_in, "fc2").cov)
        ),
        f"objective ({method}) forward": lambda: likelihood.expected_log_prob(head_in, y),
        f"objective ({method}) forward + backward": lambda: backward(
            likelihood.expected_log_prob(head_in, y)
        ),
        "KL of the weight sites": lambda: kl_sum().backward(),
    }
    spent = dict.fromkeys([*timed, "site-shape check (first call only)"], 0.0)
    for _ in range(repeats):
        for name, fn in timed.items():
            spent[name] += cpu_ms(fn, 1) / repeats
        trace = fresh_trace()  # untimed: the check of a trace the step built
        spent["site-shape check (first call only)"] += (
            cpu_ms(lambda: elbo._check_site_shapes(trace), 1) / repeats  # type: ignore[attr-defined]  # noqa: B023
        )
    for p in list(dvi_guide.parameters()):
        p.grad = None
    arithmetic = [
        "layer 1 moments",
        "ReLU moments",
        "layer 2 moments, [N, K, K] head covariance",
        f"objective ({method}) forward + backward",
        "KL of the weight sites",
    ]
    spent["arithmetic (sum of the parts above)"] = sum(spent[k] for k in arithmetic)
    spent["Pyro handling (loss f+b less arithmetic)"] = (
        spent["loss forward + backward"] - spent["arithmetic (sum of the parts above)"]
    )
    spent["SVI bookkeeping (step less loss f+b)"] = (
        spent["dvi step"] - spent["loss forward + backward"]
    )
    print(
        f"Step cost, CPU ms (after {warmup} steps, {repeats} interleaved rounds; logits "
        f"{tuple(head.mean.shape)}, covariance {tuple(cast(Tensor, head.cov).shape)}; the "
        f"parts' loss {parts_loss:.6g} against the ELBO's {elbo_loss:.6g}):"
    )
    for name, value in spent.items():
        print(f"  {name}: {value:.2f}")
    return {**spent, "loss (parts)": parts_loss, "loss (ELBO)": elbo_loss}


def main(argv: list[str] | None = None) -> dict:
    """Train the runs in interleaved rounds; print the time each takes to the target NLL."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "cancer", "parity"), default="digits")
    parser.add_argument("--steps", type=int, default=1500, help="AutoNormal's Adam steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="AutoNormal's Adam step")
    parser.add_argument("--rounds", type=int, default=15, help="evaluations per run")
    parser.add_argument("--lbfgs-iterations", type=int, default=150)
    parser.add_argument("--adam-lr", type=float, default=0.05)
    parser.add_argument("--adam-steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--predictive", type=int, default=500)
    parser.add_argument("--runs", default="lbfgs,adam")
    parser.add_argument(
        "--step-cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only measure the step cost (interleaved rounds) and where it goes",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"{args.data}, seed {args.seed}, 1 thread, load {os.getloadavg()[0]:.2f}, "
        f"torch {torch.__version__}, pyro {pyro.__version__}"
    )
    x, y, x_te, y_te = load(args.data, args.seed)
    classes = int(y.max()) + 1
    pyro.clear_param_store()
    if args.step_cost:
        return step_cost(x, y, classes, warmup=50, repeats=args.step_cost)

    def fresh(kind: str) -> tuple[Classifier, nn.Module]:
        """The model and a guide whose parameters have names of their own in the param store.

        A PyroModule guide names its parameters after its class, so two DeterministicGuides in
        one store would share them: each run's guide gets the prefix ``<class>_<run>``
        (DeterministicGuide's ``name``; for AutoNormal, which has none, a subclass so named).
        """
        pyro.set_rng_seed(args.seed)
        model = Classifier(x.shape[1], classes, "categorical")
        if kind == "autonormal":
            return model, type(f"AutoNormal_{kind}", (AutoNormal,), {})(model)
        return model, DeterministicGuide(model, name=f"DeterministicGuide_{kind}")

    # Each run: (model, guide, advance(k), iterations per round). The guides are built before
    # timing starts (their first call), then the runs advance in interleaved rounds, so that
    # all see the same machine load; the evaluations between rounds are not timed.
    runs: dict[str, tuple[Classifier, nn.Module, Callable[[int], None], int]] = {}
    model, guide = fresh("autonormal")
    reference = SVI(model, guide, pyro.optim.Adam({"lr": args.lr}), Trace_ELBO())
    reference.step(x, y)

    def steps(svi: SVI) -> Callable[[int], None]:
        def advance(k: int) -> None:
            for _ in range(k):
                svi.step(x, y)

        return advance

    runs["autonormal"] = (model, guide, steps(reference), args.steps // args.rounds)
    if "lbfgs" in args.runs.split(","):
        model, guide = fresh("lbfgs")
        runs["lbfgs"] = (model, guide, lbfgs_loop(model, guide, x, y),
                         args.lbfgs_iterations // args.rounds)  # fmt: skip
    if "adam" in args.runs.split(","):
        model, guide = fresh("adam")
        svi = SVI(model, guide, pyro.optim.Adam({"lr": args.adam_lr}), DeterministicELBO())
        svi.step(x, y)
        runs["adam"] = (model, guide, steps(svi), args.adam_steps // args.rounds)
    clocks = {key: Clock() for key in runs}
    rows: dict[str, list[tuple[int, float, float, float]]] = {key: [] for key in runs}
    for r in range(1, args.rounds + 1):
        for key, (model, guide, advance, per_round) in runs.items():
            clocks[key].timed(lambda: advance(per_round))  # noqa: B023  (called at once)
            if key != "autonormal" or r == args.rounds:
                nll = test_nll(model, guide, x_te, y_te, args.predictive)
                rows[key].append((r * per_round, clocks[key].cpu, clocks[key].wall, nll))
    done, cpu, wall, target = rows["autonormal"][-1]
    print(
        f"AutoNormal + Trace_ELBO, Adam({args.lr}), {done} steps: CPU {cpu:.2f} s "
        f"({1e3 * cpu / done:.2f} ms/step), wall {wall:.2f} s, test NLL {target:.4f} (the target)"
    )
    results: dict = {"autonormal": {"cpu": cpu, "wall": wall, "nll": target, "steps": done}}
    names = {
        "lbfgs": "L-BFGS (strong Wolfe, history 10), iteration",
        "adam": f"Adam({args.adam_lr}), step",
    }
    for key in ("lbfgs", "adam"):
        if key in runs:
            print(f"DeterministicGuide + DeterministicELBO, {names[key]}:")
            results[key] = report(names[key].rsplit(", ", 1)[-1], rows[key], target)
    print(
        "| run | to AutoNormal's final test NLL: CPU s (x AutoNormal) | wall s (x) | iterations |"
    )
    print("|---|---|---|---|")
    print(f"| AutoNormal, Adam({args.lr}) | {cpu:.2f} (1.00) | {wall:.2f} (1.00) | {done} |")
    for key in ("lbfgs", "adam"):
        if key not in results:
            continue
        reached = results[key]["reached"]
        if reached is None:
            print(f"| {key} | not reached (final NLL {results[key]['last'][3]:.4f}) | | |")
            continue
        it, c, w, _ = reached
        print(f"| {key} | {c:.2f} ({c / cpu:.2f}) | {w:.2f} ({w / wall:.2f}) | {it} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return results


if __name__ == "__main__":
    main()
