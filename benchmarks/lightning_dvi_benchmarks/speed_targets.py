"""The speed benchmark's ``targets`` section: every row of issue 28's table (recipes/speed_benchmark.py).

Step ratios of dDVI, DVI, MCVI and Pyro against each other and of every smooth activation
against ReLU, with and without flush-to-zero, measured as interleaved cells
(:func:`lightning_dvi_benchmarks.timing.interleaved`: round-robin in one process, ratios the
median of per-round ratios), the peak RSS of a full-mode step per activation (each in a child
process, ``python -m lightning_dvi_benchmarks.speed_targets NAME``), and the subnormal values
one dDVI step of a tail-heavy network produces. CPU only.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any, cast

import torch

from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import BayesLinear, BayesModule, Sequential, mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes

from . import timing as T
from .speed import IN_FEATURES, NUM_DATA, make_step

__all__ = [
    "ACTIVATIONS",
    "activation",
    "activation_step",
    "bench_targets",
    "flush_denormal",
    "report_targets",
    "rss_child",
    "tail_step",
]

ACTIVATIONS = (
    "ReLU",
    "GELU",
    "GELU tanh",
    "Sigmoid",
    "Tanh",
    "SiLU",
    "LeakyReLU",
    "ELU",
    "Softplus",
)


def activation(name: str) -> BayesModule:
    """A declared activation by its row label in :data:`ACTIVATIONS`."""
    from lightning_dvi import nn as dnn

    return dnn.GELU("tanh") if name == "GELU tanh" else cast(BayesModule, getattr(dnn, name)())


def activation_step(name: str, batch: int = 256) -> Callable[[], None]:
    """The dDVI step of ``8-64-64-1`` with ``name``, homoscedastic Gaussian likelihood, EB prior."""
    from lightning_dvi.likelihoods import HomoscedasticGaussian

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randn(batch, generator=gen)
    torch.manual_seed(0)
    net = Sequential(BayesLinear(8, 64), activation(name), BayesLinear(64, 64), activation(name),
                     BayesLinear(64, 1))  # fmt: skip
    lik, prior = HomoscedasticGaussian(), EmpiricalBayes()

    def step() -> None:
        net.zero_grad(set_to_none=True)
        elbo(net, lik, prior, x, y, NUM_DATA, mode="diag").loss.backward()

    return step


class flush_denormal:  # noqa: N801 - used like torch's context managers
    """``torch.set_flush_denormal(True)`` inside the block only (restored on exit)."""

    def __enter__(self) -> bool:
        probe = torch.tensor([1e-39]) * 1.0  # a subnormal survives unless flushing is on
        self.before = bool(probe.item() == 0.0)
        return bool(torch.set_flush_denormal(True))

    def __exit__(self, *exc: object) -> None:
        torch.set_flush_denormal(self.before)


def tail_step(batch: int = 256) -> Callable[[], None]:
    """The issue's stress case: the dDVI step of a tail-heavy ``8-128-128-2`` net.

    Biases spread the hidden pre-activations' mean/std ratios over [-40, 0] (trained nets
    have units deep in the tail).
    """
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randn(batch, generator=gen)
    torch.manual_seed(0)
    net, lik, prior = mlp(IN_FEATURES, [128, 128], 2), HeteroscedasticGaussian(), EmpiricalBayes()
    with torch.no_grad():
        h: Any = x
        for layer in net:
            out = layer(h, mode="diag")
            if isinstance(layer, BayesLinear) and layer.weight_loc.shape[0] == 128:
                shift = torch.linspace(-40, 0, 128) * out.var.sqrt().mean(0) - out.mean.mean(0)
                layer.bias_loc += shift
                out = layer(h, mode="diag")
            h = out

    def step() -> None:
        net.zero_grad(set_to_none=True)
        elbo(net, lik, prior, x, y, NUM_DATA, mode="diag").loss.backward()

    return step


def rss_child(name: str) -> None:
    """Print the peak-RSS growth (MB) of one full-mode step of ``8-512-512-2``, batch 64."""
    import resource

    torch.manual_seed(0)
    x, y = torch.randn(64, IN_FEATURES), torch.randn(64)
    net = Sequential(BayesLinear(8, 512), activation(name), BayesLinear(512, 512),
                     activation(name), BayesLinear(512, 2))  # fmt: skip
    lik, prior = HeteroscedasticGaussian(), EmpiricalBayes()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    elbo(net, lik, prior, x, y, NUM_DATA, mode="full").loss.backward()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)


def bench_targets(rounds: int, quick: bool = False) -> dict[str, Any]:
    """Every row of issue 28's table: step ratios with and without flush-to-zero, interleaved."""
    sizes = [(50, 32)] if quick else [(50, 32), (50, 512), (128, 256)]
    cells: dict[str, Callable[[], None]] = {}
    for width, batch in sizes:
        for method in ("plain MLP", "dDVI"):
            step = make_step(method, width, batch)
            cells[f"{method} {width}/{batch}"] = cells[f"{method} {width}/{batch} FTZ"] = step
    cells["DVI 50/32"] = make_step("DVI", 50, 32)
    cells["MCVI S=10 50/32"] = make_step("MCVI S=10", 50, 32)
    cells["dDVI 50/512 "] = make_step("dDVI", 50, 512)  # the Pyro row's own denominator
    cells["Pyro AutoNormal 50/512"] = make_step("Pyro AutoNormal", 50, 512)
    cells["dDVI tail 128/256"] = cells["dDVI tail 128/256 FTZ"] = tail_step()
    names = ACTIVATIONS[:3] if quick else ACTIVATIONS
    for name in names:
        cells[f"act {name}"] = cells[f"act {name} FTZ"] = activation_step(name)
    switches = {label: flush_denormal for label in cells if label.endswith(" FTZ")}
    samples = T.interleaved(cells, rounds, around=switches)
    out: dict[str, Any] = {"median ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()}}
    rows = []
    for width, batch in sizes:
        for ftz in ("", " FTZ"):
            rows.append({"case": f"dDVI / plain MLP, width {width}, batch {batch}{ftz}",
                         "ratio": T.ratio(samples, f"dDVI {width}/{batch}{ftz}",
                                        f"plain MLP {width}/{batch}{ftz}"), "target": "<= 3"})  # fmt: skip
    rows.append({"case": "Pyro AutoNormal / dDVI, width 50, batch 512",
                 "ratio": T.ratio(samples, "Pyro AutoNormal 50/512", "dDVI 50/512 "),
                 "target": ">= 3"})  # fmt: skip
    rows.append({"case": "tail-heavy dDVI 8-128-128-2, batch 256: FTZ / no FTZ",
                 "ratio": T.ratio(samples, "dDVI tail 128/256 FTZ", "dDVI tail 128/256"),
                 "target": "~1"})  # fmt: skip
    rows.append({"case": "DVI / MCVI S=10, width 50, batch 32",
                 "ratio": T.ratio(samples, "DVI 50/32", "MCVI S=10 50/32"), "target": "<= 1"})  # fmt: skip
    for name in names[1:]:
        for ftz in ("", " FTZ"):
            rows.append({"case": f"diag 8-64-64-1, batch 256: {name} / ReLU{ftz}",
                         "ratio": T.ratio(samples, f"act {name}{ftz}", f"act ReLU{ftz}"),
                         "target": "<= 3"})  # fmt: skip
    if not quick:
        for name in (
            "ReLU",
            "GELU",
            "Tanh",
            *[n for n in names if n not in ("ReLU", "GELU", "Tanh")],
        ):
            run = subprocess.run([sys.executable, "-m", __name__, name], check=True,
                                 capture_output=True, text=True)  # fmt: skip
            out[f"peak RSS {name}"] = float(run.stdout.split()[-1])
        relu = out["peak RSS ReLU"]
        for name in names[1:]:
            rows.append({"case": f"full 8-512-512-2, batch 64, peak RSS: {name} vs ReLU",
                         "ratio": out[f"peak RSS {name}"] / relu, "target": "<= 1.10"})  # fmt: skip
    out["subnormals per tail step"] = T.count_subnormals(tail_step())
    out["rows"] = rows
    return out


def report_targets(targets: dict[str, Any]) -> str:
    """The section's Markdown report."""
    return "\n".join([
        f"\n## Issue 28 targets ({len(targets['rows'])} rows, interleaved, 1 thread)\n",
        T.markdown_table(targets["rows"], ["case", "ratio", "target"], "{:.2f}"),
        "\nMedian ms per step: "
        + ", ".join(f"{k}: {v:.3f}" for k, v in targets["median ms"].items()),
        "Subnormal values per dDVI step of the tail-heavy 8-128-128-2 net: "
        f"{targets['subnormals per tail step']}",
    ])  # fmt: skip


if __name__ == "__main__":  # a child process of bench_targets: one peak-RSS measurement
    torch.set_num_threads(1)
    rss_child(sys.argv[1])
