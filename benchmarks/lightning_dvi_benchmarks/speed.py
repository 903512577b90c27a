"""The speed benchmark's models and its ``steps`` and ``layer`` sections (recipes/speed_benchmark.py).

A *step* is ``zero_grad`` + forward + loss + ``backward`` (no optimiser update, for every method
alike) of the UCI architecture ``8 -> width -> 2``: a plain torch MLP, dDVI, DVI, MCVI with
S = 1/10/100 weight draws, local reparameterisation, and Pyro's ``AutoNormal`` (through
:func:`pyro_step`). The ``layer`` section times one ``BayesLinear(d, d) + ReLU`` forward for a
batch of 10 and finds where DVI and MCVI cost the same (:func:`crossovers`).

Times come from :mod:`lightning_dvi_benchmarks.timing` on :data:`DEVICE` (set by the recipe's
``--device``): CPU-time medians on a CPU, synchronised wall time on CUDA. The ``frontends``,
``compile`` and ``net`` sections are in :mod:`lightning_dvi_benchmarks.speed_net`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dvi import Gaussian
from lightning_dvi.gaussian import Mode, validate_mode
from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import BayesLinear, ReLU, Sequential, mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes
from lightning_dvi.propagation import Propagation, propagation

from . import timing as T

__all__ = [
    "COMPILED_STEP_METHODS",
    "DEVICE",
    "IN_FEATURES",
    "NUM_DATA",
    "STEP_METHODS",
    "bench_layer",
    "bench_steps",
    "count_cuda_kernels",
    "count_dispatch",
    "count_ops",
    "crossovers",
    "describe_crossover",
    "dvi_step",
    "heteroscedastic_nll",
    "layer_input",
    "layer_kinds",
    "make_step",
    "op_labels",
    "op_rows",
    "peak_memory_mib",
    "plain_step",
    "pyro_bnn",
    "pyro_step",
    "step_ratios",
    "table",
    "time_call",
]

IN_FEATURES = 8
NUM_DATA = 8611  # UCI power after the 90 % split: only scales the KL term
STEP_METHODS: tuple[tuple[str, str | None, int | None], ...] = (
    ("plain MLP", None, None),
    ("dDVI", "diag", None),
    ("DVI", "full", None),
    ("MCVI S=1", "sample", 1),
    ("MCVI S=10", "sample", 10),
    ("MCVI S=100", "sample", 100),
    ("local reparam", "local", 1),
    ("Pyro AutoNormal", "pyro", None),
)

COMPILED_STEP_METHODS: tuple[tuple[str, str, None], ...] = (
    ("dDVI compiled step", "diag", None),
    ("DVI compiled step", "full", None),
)
"""The same ELBO steps as one compiled graph (``lightning_dvi.compile.CompiledStep``, inductor):
what the Lightning modules' ``compile=True`` runs. Built by :func:`make_step`, which compiles
(or loads from inductor's cache) before returning; the ``cost`` section's ``--compiled on``."""

DEVICE = torch.device("cpu")
"""Where the benchmarks run (the recipe's ``--device``)."""


def time_call(fn: Callable[[], Any], repeats: int = 15, warmup: int = 3) -> float:
    """:func:`lightning_dvi_benchmarks.timing.time_call` on :data:`DEVICE`."""
    return T.time_call(fn, repeats, warmup, device=DEVICE)


def peak_memory_mib(fn: Callable[[], Any]) -> float:
    """:func:`lightning_dvi_benchmarks.timing.peak_memory_mib` on :data:`DEVICE`."""
    return T.peak_memory_mib(fn, device=DEVICE)


def count_dispatch(fn: Callable[[], Any], cuda_kernels: bool | None = None) -> dict[str, int]:
    """:func:`~lightning_dvi_benchmarks.timing.count_dispatch`; CUDA kernels on a CUDA device."""
    return T.count_dispatch(fn, DEVICE.type == "cuda" if cuda_kernels is None else cuda_kernels)


count_ops = T.count_ops
count_cuda_kernels = T.count_cuda_kernels
table = T.markdown_table


# ------------------------------------------------------------------------------ models
def heteroscedastic_nll(out: Tensor, y: Tensor) -> Tensor:
    """Mean Gaussian NLL with predicted log-variance, the plain network's loss."""
    m, log_var = out[..., 0], out[..., 1]
    return 0.5 * (math.log(2 * math.pi) + log_var + (y - m).square() * torch.exp(-log_var)).mean()


def plain_step(width: int, x: Tensor, y: Tensor) -> Callable[[], None]:
    """A ``torch.nn`` MLP of the same shape, heteroscedastic Gaussian NLL."""
    net = nn.Sequential(nn.Linear(IN_FEATURES, width), nn.ReLU(), nn.Linear(width, 2))
    net.to(x.device)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        heteroscedastic_nll(net(x), y).backward()

    return step


def _dvi_parts(width: int, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """The steps' ``8 -> width -> 2`` BNN on ``device``, heteroscedastic, empirical-Bayes prior."""
    net = mlp(IN_FEATURES, [width], 2).to(device)
    return net, HeteroscedasticGaussian(), EmpiricalBayes()


def dvi_step(
    width: int, x: Tensor, y: Tensor, mode: Mode, samples: int | None
) -> Callable[[], None]:
    """One ELBO step of the library's own code path (``lightning_dvi.objective.elbo``)."""
    net, lik, prior = _dvi_parts(width, x.device)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        elbo(net, lik, prior, x, y, NUM_DATA, mode=mode, num_samples=samples).loss.backward()

    return step


def pyro_bnn(width: int, moments: bool = False) -> nn.Module:
    """Tutorial-style ``PyroModule`` BNN ``8 -> width -> 2``, N(0, 1) priors, heteroscedastic.

    ``moments=True`` observes through ``lightning_dvi.pyro.HeteroscedasticGaussian`` (the same
    likelihood, which a DeterministicGuide can take moments of) instead of ``dist.Normal``.
    """
    import pyro
    import pyro.distributions as dist
    from pyro.nn import PyroModule, PyroSample

    pyro_module: Any = PyroModule  # PyroModule[cls] is a runtime class factory mypy cannot type

    class BNN(PyroModule):
        def __init__(self) -> None:
            super().__init__()
            sizes = [(IN_FEATURES, width), (width, 2)]
            self.layers = pyro_module[nn.ModuleList](
                [pyro_module[nn.Linear](i, o) for i, o in sizes]
            )
            for layer, (i, o) in zip(self.layers, sizes, strict=True):
                layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
                layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))

        def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
            out: Tensor = self.layers[1](torch.relu(self.layers[0](x)))
            with pyro.plate("data", NUM_DATA, subsample=torch.arange(x.shape[0])):
                if moments:
                    from lightning_dvi.pyro import HeteroscedasticGaussian as Obs

                    pyro.sample("obs", Obs(out), obs=y)
                else:
                    pyro.sample("obs", dist.Normal(out[:, 0], (0.5 * out[:, 1]).exp()), obs=y)
            return out

    return BNN()


def pyro_step(width: int, x: Tensor, y: Tensor) -> Callable[[], None]:
    """Pyro ``AutoNormal`` guide + ``Trace_ELBO`` (one particle), forward + backward."""
    import pyro
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    pyro.clear_param_store()
    model = pyro_bnn(width)
    guide = AutoNormal(model)
    guide(x, y)  # creates the parameters
    loss_fn = Trace_ELBO()

    def step() -> None:
        guide.zero_grad(set_to_none=True)
        loss_fn.differentiable_loss(model, guide, x, y).backward()

    return step


def compiled_dvi_step(width: int, x: Tensor, y: Tensor, mode: Mode) -> Callable[[], None]:
    """:func:`dvi_step` with the step compiled as one graph; compiles before returning."""
    from lightning_dvi.compile import compile_step

    net, lik, prior = _dvi_parts(width, x.device)
    compiled = compile_step(net, lik, prior, mode=mode)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        compiled(x, y, NUM_DATA).loss.backward()

    step()
    return step


def make_step(method: str, width: int, batch: int, seed: int = 0) -> Callable[[], None]:
    """The step callable for one row of :data:`STEP_METHODS` or :data:`COMPILED_STEP_METHODS`."""
    _, mode, samples = next(m for m in STEP_METHODS + COMPILED_STEP_METHODS if m[0] == method)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randn(batch, generator=gen)
    x, y = x.to(DEVICE), y.to(DEVICE)
    if mode is None:
        return plain_step(width, x, y)
    if mode == "pyro":
        return pyro_step(width, x, y)
    if any(method == m[0] for m in COMPILED_STEP_METHODS):
        return compiled_dvi_step(width, x, y, validate_mode(mode))
    return dvi_step(width, x, y, validate_mode(mode), samples)


def bench_steps(
    widths: Sequence[int],
    batches: Sequence[int],
    repeats: int,
    methods: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Median ms per training step for every method, width and batch size."""
    rows = []
    for width in widths:
        for batch in batches:
            row: dict[str, Any] = {"width": width, "batch": batch, "ops": {}}
            for name, mode, _ in STEP_METHODS:
                if mode == "pyro" and DEVICE.type != "cpu":
                    continue  # the tutorial Pyro model is built on the CPU
                if methods is None or name in methods:
                    step = make_step(name, width, batch)
                    row[name] = 1e3 * time_call(step, repeats)
                    row["ops"][name] = count_ops(step)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------- Fig. 4 layer
def layer_input(kind: str, d: int, batch: int = 10, samples: int = 1) -> Any:
    """Input of the Fig. 4 layer: a full/diag Gaussian or MCVI samples ``[S, batch, d]``."""
    gen = torch.Generator().manual_seed(d)
    mean = torch.randn(batch, d, generator=gen).to(DEVICE)
    if kind == "diag":
        return Gaussian(mean, var=(torch.rand(batch, d, generator=gen) + 0.1).to(DEVICE))
    if kind == "full":
        a = torch.randn(d, d, generator=gen) / math.sqrt(d)
        cov = (a @ a.T + 0.1 * torch.eye(d)).expand(batch, d, d).contiguous()
        return Gaussian(mean, cov=cov.to(DEVICE))
    return torch.randn(samples, batch, d, generator=gen).to(DEVICE)


def layer_kinds(quick: bool) -> list[tuple[str, Mode, int]]:
    """``(label, mode, S)`` of the Fig. 4 columns."""
    mcvi: list[tuple[str, Mode, int]] = [
        (f"MCVI S={s}", "sample", s) for s in ((1, 10) if quick else (1, 10, 100))
    ]
    return [("DVI", "full", 1), ("dDVI", "diag", 1), *mcvi]


def bench_layer(dims: Sequence[int], repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """Forward time (ms) of ``BayesLinear(d, d) + ReLU`` on a batch of 10, and DVI peak MiB."""
    rows = []
    for d in dims:
        torch.manual_seed(0)
        layer = Sequential(BayesLinear(d, d), ReLU()).to(DEVICE)
        row: dict[str, Any] = {"d": d}
        for label, mode, s in layer_kinds(quick):
            x = layer_input(mode, d, samples=s)

            how = propagation(mode)

            def fwd(x: Any = x, how: Propagation = how, layer: Sequential = layer) -> Any:
                with torch.no_grad():
                    return layer.propagate(x, how)

            reps = repeats if d <= 256 else max(3, repeats // 3)
            row[label] = 1e3 * time_call(fwd, reps, warmup=1)
            if mode == "full":
                row["DVI peak MiB"] = peak_memory_mib(fwd)
        rows.append(row)
    return rows


def crossovers(rows: list[dict[str, Any]], label: str) -> list[float]:
    """Widths where DVI's time crosses ``label``'s (either way), interpolated in log-log."""
    ratios = [(r["d"], r["DVI"] / r[label]) for r in rows if label in r]
    out = []
    for (d0, r0), (d1, r1) in itertools.pairwise(ratios):
        if (r0 - 1) * (r1 - 1) < 0:
            t = math.log(1 / r0) / math.log(r1 / r0)
            out.append(math.exp(math.log(d0) + t * math.log(d1 / d0)))
    return out


def describe_crossover(rows: list[dict[str, Any]], label: str) -> str:
    """E.g. ``"DVI cheaper for d in (45, 1024]"`` or ``"DVI dearer at every d"``."""
    ratios = [(r["d"], r["DVI"] / r[label]) for r in rows if label in r]
    cheaper = [d for d, r in ratios if r < 1]
    if not cheaper:
        return "DVI dearer at every d"
    if len(cheaper) == len(ratios):
        return "DVI cheaper at every d"
    edges = [f"{x:.0f}" for x in crossovers(rows, label)]
    lo = "(" + edges.pop(0) if ratios[0][1] >= 1 else f"[{ratios[0][0]}"
    hi = edges.pop(0) + ")" if ratios[-1][1] >= 1 and edges else f"{ratios[-1][0]}]"
    return f"DVI cheaper for d in {lo}, {hi}"


# ----------------------------------------------------------------------------- frontends


def op_labels(rows: list[dict[str, Any]]) -> list[str]:
    """The cell labels that carry op counts, in column order."""
    labels: list[str] = []
    for row in rows:
        labels += [k[: -len(" ops")] for k in row if k.endswith(" ops") and k[:-4] not in labels]
    return labels


def op_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"d": d, label: "ops / non-view / reads [/ kernels]"}`` rows for :func:`table`."""
    out = []
    for row in rows:
        cells: dict[str, Any] = {"d": row["d"]}
        for label in op_labels([row]):
            cells[label] = " / ".join(str(v) for v in row[label + " ops"].values())
        out.append(cells)
    return out


def step_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The target ratios of the ``steps`` section, per width and batch."""
    out = []
    for r in rows:
        out.append({
            "width": r["width"], "batch": r["batch"],
            "dDVI / plain": r["dDVI"] / r["plain MLP"],
            "DVI / plain": r["DVI"] / r["plain MLP"],
            "DVI / MCVI S=10": r["DVI"] / r["MCVI S=10"],
            "Pyro / dDVI": r["Pyro AutoNormal"] / r["dDVI"],
        })  # fmt: skip
    return out
