"""Moment propagation against Monte Carlo over weights (paper Fig. 3 and Fig. 6).

For each architecture of the paper's fidelity experiments, propagate a few inputs in ``full``
(DVI) and ``diag`` (dDVI) mode and compare with 20,000 whole-weight draws (``mode="sample"``):

* 1-128-128-2 ReLU net (Fig. 3), 5-hidden-layer nets of width 5, 25, 125 (Fig. 6a-c) and a
  5-hidden-layer width-25 residual net (Fig. 6d);
* two posterior widths: the library's default initialisation, and a "wide" posterior whose
  weight std equals ``1/sqrt(fan_in)`` (much noisier than any trained net; a stress test).

Errors are in units of the Monte Carlo standard deviation (mean), relative (std), and absolute
(output correlation, full mode). Usage::

    python recipes/moment_fidelity.py [--samples 20000] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.nn import bayes_layers, mlp

ARCHITECTURES = {
    "1-128-128-2 relu": {"hidden": [128, 128], "residual": False},
    "5x5 relu": {"hidden": [5] * 5, "residual": False},
    "5x25 relu": {"hidden": [25] * 5, "residual": False},
    "5x125 relu": {"hidden": [125] * 5, "residual": False},
    "5x25 residual": {"hidden": [25] * 5, "residual": True},
}


def widen_posterior(net: torch.nn.Module) -> None:
    """Set every weight's posterior std to 1/sqrt(fan_in) (and biases to a tenth of it)."""
    for layer in bayes_layers(net):
        s = 1.0 / math.sqrt(layer.in_features)
        with torch.no_grad():
            layer.weight_raw_scale.fill_(layer._raw(s))
            if layer.bias_raw_scale is not None:
                layer.bias_raw_scale.fill_(layer._raw(s / 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000, help="Monte Carlo weight draws")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    x = torch.tensor([[-0.45], [0.0], [0.25], [0.45]])  # includes the paper's x = 0.25
    print(
        f"Monte Carlo reference: {args.samples} whole-weight draws, inputs {x.flatten().tolist()}"
    )
    print()
    print("| architecture | posterior | mode | mean err (MC sd) | sd rel err | corr err |")
    print("|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name, spec in ARCHITECTURES.items():
        for posterior in ("default init", "wide"):
            torch.manual_seed(args.seed)
            net = mlp(1, spec["hidden"], 2, residual=spec["residual"])
            if posterior == "wide":
                widen_posterior(net)
            for mode in ("full", "diag"):
                torch.manual_seed(args.seed + 1)
                res = compare_with_monte_carlo(net, x, mode=mode, num_samples=args.samples)
                corr = "-" if math.isnan(res.corr_error) else f"{res.corr_error:.3f}"
                print(
                    f"| {name} | {posterior} | {mode} | {res.mean_error:.3f} | "
                    f"{res.std_rel_error:.3f} | {corr} |"
                )
    print()
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
