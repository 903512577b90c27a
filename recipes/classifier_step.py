"""A DVIClassifier-shaped training step on digits: eager against compiled as one graph.

The network, likelihood and prior of ``DVIClassifier()``'s defaults (``64 -> 128 -> 128 -> 10``,
``mode="diag"``, ``Categorical(method="tight")``, the ``N(0, 0.1)`` prior) on the first
``--batch`` rows of scikit-learn's digits (pixels / 16). ``--warmup`` eager Adam steps first,
so that the head's logits spread as in training; then the step is recorded and compiled
(``lightning_dvi.compile.CompiledStep``, what ``compile=True`` runs), and ``--rounds``
interleaved rounds (``lightning_dvi_benchmarks.timing.interleaved``) time one eager and one
compiled step (value and gradient, CPU time, one thread). Prints the compile's CPU seconds and the median ms per step of each.

Run:  python recipes/classifier_step.py [--batch 128] [--warmup 300] [--rounds 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sklearn.datasets import load_digits

from lightning_dvi.compile import CompiledStep
from lightning_dvi.likelihoods import Categorical
from lightning_dvi.nn import mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import GaussianPrior
from lightning_dvi_benchmarks.timing import interleaved


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print and return the compile's CPU seconds and the median CPU ms of each step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--backend", default=None, help="a torch.compile backend (tests)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images[: args.batch] / 16.0, dtype=torch.float32)
    y = torch.tensor(labels[: args.batch])
    num_data = len(labels)
    net = mlp(64, [128, 128], 10)
    likelihood, prior = Categorical(10), GaussianPrior(0.1)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)

    def eager() -> None:
        optimizer.zero_grad()
        elbo(net, likelihood, prior, x, y, num_data, "diag").loss.backward()

    for _ in range(args.warmup):
        eager()
        optimizer.step()
    options = {} if args.backend is None else {"backend": args.backend}
    step = CompiledStep(net, likelihood, prior, "diag", **options)

    def compiled() -> None:
        optimizer.zero_grad()
        step(x, y, num_data).loss.backward()

    start = time.process_time()
    compiled()  # records and compiles
    out = {"compile_s": time.process_time() - start}
    times = interleaved({"eager": eager, "compiled": compiled}, args.rounds)
    out.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()})
    print(
        f"batch {args.batch}: compile {out['compile_s']:.1f} CPU s; CPU ms per step: eager "
        f"{out['eager_ms']:.2f}, compiled {out['compiled_ms']:.2f}"
    )
    return out


if __name__ == "__main__":
    main()
