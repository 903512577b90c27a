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
50 training steps) and splits the deterministic step into the guide's trace, the loss, its
backward and the categorical objective alone.

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
    variances, which grow in training); then ``repeats`` rounds of one step each, interleaved.
    The parts of the deterministic step: the guide's trace, the loss (forward), the loss with
    its backward, and the categorical objective alone (forward, and forward + backward) on the
    head's moments captured from that pass.
    """
    import pyro.poutine as poutine

    from lightning_dvi import Gaussian
    from lightning_dvi.likelihoods import Categorical

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
    spent = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for kind, (*_, svi) in runs.items():
            spent[kind] += cpu_ms(lambda: svi.step(x, y), 1) / repeats  # noqa: B023
    model, guide, elbo, _ = runs["dvi"]
    parts = {"dvi step": spent["dvi"], "autonormal step": spent["autonormal"]}
    parts["guide trace"] = cpu_ms(
        lambda: poutine.trace(guide.moment_posteriors).get_trace(x, y), repeats
    )
    parts["loss forward"] = cpu_ms(lambda: elbo.differentiable_loss(model, guide, x, y), repeats)
    parts["loss forward + backward"] = cpu_ms(
        lambda: elbo.differentiable_loss(model, guide, x, y).backward(), repeats
    )
    captured = {}
    original = Categorical.expected_log_prob

    def capture(self: Categorical, out: object, value: Tensor, mc_samples: int | None = None):
        captured["out"], captured["method"] = out, self.method
        return original(self, out, value, mc_samples)

    Categorical.expected_log_prob = capture  # type: ignore[method-assign]
    try:
        elbo.loss(model, guide, x, y)
    finally:
        Categorical.expected_log_prob = original  # type: ignore[method-assign]
    out, method = captured["out"], captured["method"]
    mean = out.mean.detach().requires_grad_()  # type: ignore[attr-defined]
    cov = Categorical._cov(out).detach().requires_grad_()  # type: ignore[arg-type]
    head = Gaussian(mean, cov=cov) if cov.dim() > mean.dim() else Gaussian(mean, var=cov)
    likelihood = Categorical(classes, method=method)
    parts[f"objective ({method}) forward"] = cpu_ms(
        lambda: likelihood.expected_log_prob(head, y), repeats
    )
    parts[f"objective ({method}) forward + backward"] = cpu_ms(
        lambda: likelihood.expected_log_prob(head, y).sum().backward(), repeats
    )
    print(
        f"Step cost, CPU ms (after {warmup} steps, {repeats} interleaved rounds; logits "
        f"{tuple(mean.shape)}, covariance {tuple(cov.shape)}):"
    )
    for name, value in parts.items():
        print(f"  {name}: {value:.2f}")
    return parts


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
