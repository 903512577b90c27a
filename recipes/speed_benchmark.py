"""Speed: training steps, the paper's Fig. 4 layer scaling, front-end overhead, torch.compile.

Steps of a plain MLP, dDVI, DVI, MCVI, local reparameterisation and Pyro AutoNormal.
One process, ``torch.set_num_threads(1)``; every number is the median CPU time over
``--repeats`` samples after warm-up calls. A *step* is ``zero_grad`` + forward + loss +
``backward`` (no optimiser update, for every method alike). Sections (``--sections``):
``steps`` (UCI architecture ``8 -> width -> 2``, widths 50/128, batches 32/512), ``targets``
(every row of issue 28's table, cells interleaved round-robin in this process, with and
without flush-to-zero, plus the subnormal values one tail-heavy dDVI step produces), ``layer``
(a batch of 10 through ``BayesLinear(d, d) + ReLU``, forward only, d = 16..1024, with DVI's
peak memory and where DVI and MCVI cost the same), ``frontends`` (``DVIRegressor`` epoch on UCI
power vs a bare loop, needs ``--data-dir``; ``DeterministicGuide`` step vs the bare dDVI
step), ``compile``, and ``net`` (the GPU table of docs/benchmarks.md: a 3-layer net
``BayesLinear(d, d)-ReLU-BayesLinear(d, d)-ReLU-BayesLinear(d, 2)``, batch 128, forward +
backward of ``sum(mean) + sum(cov)``, d = 128..2048, every method eager and compiled, with
peak memory). ``--device cuda`` runs ``steps``, ``layer`` and ``net`` on the GPU: times are
then wall-clock medians between ``torch.cuda.synchronize()`` calls and peak memory is
``torch.cuda.max_memory_allocated``. Results and the machine are in docs/benchmarks.md.

Run:  python recipes/speed_benchmark.py [--quick] [--device cuda] [--json out.json]
          [--sections steps,layer,frontends,compile,net] [--widths 128,512] [--data-dir DIR]
          [--count-ops]   (net section: aten ops / non-view ops / host reads per step)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import BayesLinear, ReLU, Sequential, mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes

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


# ------------------------------------------------------------------------------ timing
DEVICE = torch.device("cpu")
"""Where the benchmarks run (``--device``)."""


def _clock() -> float:
    """Process CPU time on a CPU; wall time after a device synchronisation on CUDA."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
        return time.perf_counter()
    return time.process_time()


def time_call(fn: Callable[[], Any], repeats: int = 15, warmup: int = 3) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` samples, after ``warmup`` calls.

    On a CPU the CPU time of this process (``time.process_time``), not wall time: with one
    thread it is the same on an idle machine, and it does not count the time other processes
    hold the core on a shared one. On CUDA wall time between ``torch.cuda.synchronize()``
    calls (kernels run asynchronously). Each sample runs the call enough times to last about
    5 ms.
    """
    for _ in range(warmup):
        fn()
    start = _clock()
    fn()
    inner = max(1, min(200, int(5e-3 / max(_clock() - start, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = _clock()
        for _ in range(inner):
            fn()
        samples.append((_clock() - start) / inner)
    return statistics.median(samples)


def count_ops(fn: Callable[[], Any]) -> int:
    """Aten ops dispatched by one call of ``fn`` (after one warm-up call), backward included.

    At these sizes a step costs ~2.5-3 us per op whatever the op does, so the count explains the
    times and, unlike them, does not depend on the machine's load.
    """
    return count_dispatch(fn, cuda_kernels=False)["aten ops"]


_HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select"})


def count_dispatch(fn: Callable[[], Any], cuda_kernels: bool | None = None) -> dict[str, int]:
    """What one call of ``fn`` (after one warm-up call, backward included) dispatches.

    * ``aten ops``: every aten op (a ``TorchDispatchMode``), views included;
    * ``non-view ops``: those that are not views (``t``, ``view``, ``expand``, ``detach``...):
      on a GPU each is one or more kernel launches in eager mode, so this is the launch count
      the issue's "kernel launches per step" refers to;
    * ``host reads``: ops whose result the host must wait for (``item``/``nonzero``): one
      device synchronisation each on a GPU;
    * ``cuda kernels`` (``cuda_kernels``, default: on when the benchmark device is CUDA): the
      CUDA kernels ``torch.profiler`` records, which also counts fused (compiled) kernels.

    Under ``torch.compile`` only ``cuda kernels`` is meaningful (the dispatch mode sees the
    compiled region's few extern calls, not its fused kernels), so compiled cells count that.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"aten ops": 0, "non-view ops": 0, "host reads": 0}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            counts["aten ops"] += 1
            counts["non-view ops"] += not func.is_view
            counts["host reads"] += func._schema.name.split("::")[-1] in _HOST_READS
            return func(*args, **(kwargs or {}))

    fn()
    with Counter():
        fn()
    if cuda_kernels if cuda_kernels is not None else DEVICE.type == "cuda":
        counts["cuda kernels"] = count_cuda_kernels(fn)
    return counts


def count_cuda_kernels(fn: Callable[[], Any]) -> int:
    """CUDA kernels ``torch.profiler`` records during one call of ``fn`` (-1 if none can be)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return -1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for e in prof.events() if e.device_type == cuda)


def peak_memory_mib(fn: Callable[[], Any]) -> float:
    """Peak bytes held by torch allocations during one call of ``fn``, in MiB.

    Replays, in time order, the bytes each profiled op allocated net of what it freed
    (``self_cpu_memory_usage``, recorded with ``profile_memory=True``; frees outside ops are
    ``[memory]`` events). tracemalloc does not see torch's allocator. Tensors that exist before
    the call are not counted; the result is what the call adds at its peak. On CUDA:
    ``torch.cuda.max_memory_allocated`` during the call minus what was allocated before.
    """
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        fn()
        torch.cuda.synchronize(DEVICE)
        return (torch.cuda.max_memory_allocated(DEVICE) - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak / 2**20


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


def dvi_step(
    width: int, x: Tensor, y: Tensor, mode: str, samples: int | None
) -> Callable[[], None]:
    """One ELBO step of the library's own code path (``lightning_dvi.objective.elbo``)."""
    net, lik, prior = mlp(IN_FEATURES, [width], 2), HeteroscedasticGaussian(), EmpiricalBayes()
    net.to(x.device)

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

    class BNN(PyroModule):
        def __init__(self) -> None:
            super().__init__()
            sizes = [(IN_FEATURES, width), (width, 2)]
            self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](i, o) for i, o in sizes])
            for layer, (i, o) in zip(self.layers, sizes, strict=True):
                layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
                layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))

        def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
            out = self.layers[1](torch.relu(self.layers[0](x)))
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


def make_step(method: str, width: int, batch: int, seed: int = 0) -> Callable[[], None]:
    """The step callable for one row of :data:`STEP_METHODS`."""
    _, mode, samples = next(m for m in STEP_METHODS if m[0] == method)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randn(batch, generator=gen)
    x, y = x.to(DEVICE), y.to(DEVICE)
    if mode is None:
        return plain_step(width, x, y)
    if mode == "pyro":
        return pyro_step(width, x, y)
    return dvi_step(width, x, y, mode, samples)


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


def layer_kinds(quick: bool) -> list[tuple[str, str, int]]:
    """``(label, mode, S)`` of the Fig. 4 columns."""
    mcvi = [(f"MCVI S={s}", "sample", s) for s in ((1, 10) if quick else (1, 10, 100))]
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

            def fwd(x: Any = x, mode: str = mode, layer: Sequential = layer) -> Any:
                with torch.no_grad():
                    return layer.propagate(x, mode)

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
def bench_pyro_guide(width: int, batch: int, repeats: int) -> dict[str, Any]:
    """``DeterministicGuide`` + ``DeterministicELBO`` step against the bare dDVI step (ms)."""
    from lightning_dvi.priors import GaussianPrior

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randn(batch, generator=gen)
    net, lik, prior = mlp(IN_FEATURES, [width], 2), HeteroscedasticGaussian(), GaussianPrior(1.0)

    def bare() -> None:
        net.zero_grad(set_to_none=True)
        elbo(net, lik, prior, x, y, NUM_DATA, mode="diag").loss.backward()

    row: dict[str, Any] = {
        "width": width,
        "batch": batch,
        "bare dDVI": 1e3 * time_call(bare, repeats),
    }
    try:
        import pyro

        from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide
    except ImportError as err:  # the Pyro front-end is optional
        row["missing"] = f"lightning_dvi.pyro: {err}"
        return row
    pyro.clear_param_store()
    model = pyro_bnn(width, moments=True)
    guide = DeterministicGuide(model, mode="diag")
    loss_fn = DeterministicELBO()
    loss_fn.differentiable_loss(model, guide, x, y)  # creates the parameters

    def det() -> None:
        guide.zero_grad(set_to_none=True)
        loss_fn.differentiable_loss(model, guide, x, y).backward()

    row["DeterministicGuide"] = 1e3 * time_call(det, repeats)
    return row


def bench_lightning(data_dir: str, width: int, batch: int, epochs: int) -> dict[str, Any]:
    """CPU seconds per epoch of ``DVIRegressor`` under a Lightning ``Trainer`` vs a bare loop.

    The bare loop is the same math: ``mlp`` + heteroscedastic likelihood + in-graph empirical
    Bayes, full mode, Adam, the same ``DataLoader``; both medians skip a warm-up epoch.
    """
    from lightning_dvi.data import UCIDataModule

    dm = UCIDataModule(data_dir=data_dir, dataset="power", batch_size=batch)
    dm.setup("fit")
    n = dm.num_train
    row: dict[str, Any] = {"rows": n, "batch": batch, "width": width}
    torch.manual_seed(0)
    net, lik, prior = mlp(dm.in_features, [width], 2), HeteroscedasticGaussian(), EmpiricalBayes()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    times = []
    for _ in range(epochs + 1):
        start = time.process_time()
        for xb, yb in dm.train_dataloader():
            opt.zero_grad(set_to_none=True)
            elbo(net, lik, prior, xb, yb, n, mode="full").loss.backward()
            opt.step()
        times.append(time.process_time() - start)
    row["bare loop s"] = statistics.median(times[1:])  # the first one warms up
    try:
        from lightning.pytorch import Callback, Trainer

        from lightning_dvi.lightning import DVIRegressor
    except ImportError as err:
        row["missing"] = f"lightning_dvi.lightning: {err}"
        return row

    class EpochTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_epoch_start(self, *_: Any) -> None:
            self.start = time.process_time()

        def on_train_epoch_end(self, *_: Any) -> None:
            self.times.append(time.process_time() - self.start)

    timer = EpochTimer()
    model = DVIRegressor(in_features=dm.in_features, hidden=[width], mode="full", num_data=n)
    trainer = Trainer(
        max_epochs=epochs + 1, accelerator="cpu", devices=1, logger=False, callbacks=[timer],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    row["fit total s"] = time.perf_counter() - start
    row["Lightning epoch s"] = statistics.median(timer.times[1:])  # the first one warms up
    return row


def bench_compile(repeats: int) -> list[dict[str, Any]]:
    """``torch.compile`` (inductor) against eager: compile s, fwd+bwd ms.

    The moment kernels alone, and the whole dDVI loss (:func:`bench_compiled_step`). Not an
    option of the library: measured here to document it (see docs/benchmarks.md).
    """
    from lightning_dvi.moments import relu_diag, relu_full

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(32, 50, 50, generator=gen)
    cov = (a @ a.transpose(-1, -2) / 50 + 0.1 * torch.eye(50)).requires_grad_()
    cases = [
        ("relu_diag [512, 50]", relu_diag, (torch.randn(512, 50), torch.rand(512, 50) + 0.1)),
        ("relu_full [32, 50, 50]", relu_full, (torch.randn(32, 50), cov.detach())),
    ]
    rows = []
    for name, fn, inputs in cases:
        leaves = [t.clone().requires_grad_() for t in inputs]

        def step(f: Callable[..., Any] = fn, leaves: list[Tensor] = leaves) -> None:
            sum(o.sum() for o in f(*leaves)).backward()

        row: dict[str, Any] = {"kernel": name, "eager ms": 1e3 * time_call(step, repeats)}
        try:
            torch._dynamo.reset()
            torch._inductor.config.fx_graph_cache = False  # cold compile, not a cache hit
            compiled = torch.compile(fn)
            start = time.perf_counter()
            step(compiled)
            row["compile s"] = time.perf_counter() - start
            row["compiled ms"] = 1e3 * time_call(lambda f=compiled: step(f), repeats)
        except Exception as err:  # no C++ toolchain, unsupported op, ...
            row["compiled ms"] = f"failed: {type(err).__name__}"
        rows.append(row)
    rows.append(bench_compiled_step(repeats))
    return rows


def bench_compiled_step(repeats: int, width: int = 50, batch: int = 32) -> dict[str, Any]:
    """``torch.compile`` (inductor) of the whole dDVI loss (``elbo``), forward + backward.

    ``check_finite=False`` and the input checks stay in eager code (Dynamo graph-breaks at their
    host reads), so the compiled graphs are the network, likelihood and KL.
    """
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randn(batch, generator=gen)
    net, lik, prior = mlp(IN_FEATURES, [width], 2), HeteroscedasticGaussian(), EmpiricalBayes()

    def loss_fn(x: Tensor, y: Tensor) -> Tensor:
        return elbo(net, lik, prior, x, y, NUM_DATA, mode="diag", check_finite=False).loss

    def step(f: Callable[[Tensor, Tensor], Tensor] = loss_fn) -> None:
        net.zero_grad(set_to_none=True)
        f(x, y).backward()

    row: dict[str, Any] = {
        "kernel": f"dDVI step (elbo) width {width}, batch {batch}",
        "eager ms": 1e3 * time_call(step, repeats),
    }
    try:
        torch._dynamo.reset()
        torch._inductor.config.fx_graph_cache = False
        compiled = torch.compile(loss_fn)
        start = time.perf_counter()
        step(compiled)
        row["compile s"] = time.perf_counter() - start
        row["compiled ms"] = 1e3 * time_call(lambda: step(compiled), repeats)
    except Exception as err:  # no C++ toolchain, unsupported op, ...
        row["compiled ms"] = f"failed: {type(err).__name__}"
    return row


# ----------------------------------------------------------------------- GPU-size network
NET_METHODS: tuple[tuple[str, str | None, int | None], ...] = (
    ("plain MLP", None, None),
    ("DVI", "full", None),
    ("dDVI", "diag", None),
    ("MCVI S=1", "sample", 1),
    ("MCVI S=10", "sample", 10),
    ("MCVI S=100", "sample", 100),
    ("MCVI S=300", "sample", 300),
    ("local reparam", "local", 1),
)


def net_step(
    method: str, d: int, batch: int = 128, compile_opts: dict[str, Any] | None = None
) -> Callable[[], None]:
    """Forward + backward of ``sum(mean) + sum(cov)`` (or of the samples) through the 3-layer net.

    ``BayesLinear(d, d)-ReLU-BayesLinear(d, d)-ReLU-BayesLinear(d, 2)`` (or its ``torch.nn``
    twin for the plain MLP), deterministic input ``[batch, d]``; ``compile_opts`` compiles the
    network (``lightning_dvi.compile.compile_network``; ``torch.compile`` for the plain MLP).
    """
    from lightning_dvi.compile import compile_network

    _, mode, samples = next(m for m in NET_METHODS if m[0] == method)
    torch.manual_seed(0)
    x = torch.randn(batch, d, device=DEVICE)
    if mode is None:
        plain = nn.Sequential(
            nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2)
        ).to(DEVICE)
        fwd = plain if compile_opts is None else torch.compile(plain, **compile_opts)

        def plain_step() -> None:
            plain.zero_grad(set_to_none=True)
            fwd(x).sum().backward()

        return plain_step
    net = Sequential(BayesLinear(d, d), ReLU(), BayesLinear(d, d), ReLU(), BayesLinear(d, 2))
    net.to(DEVICE)
    kwargs: dict[str, Any] = {"mode": mode}
    if samples is not None:
        kwargs["num_samples"] = samples
    forward = net if compile_opts is None else compile_network(net, **compile_opts)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        out = forward(x, **kwargs)
        if isinstance(out, Gaussian):
            spread = out.cov if out.is_full else out.var
            loss = out.mean.sum() + spread.sum()  # type: ignore[union-attr]
        else:
            loss = out.sum()
        loss.backward()

    return step


def bench_net(
    widths: Sequence[int],
    repeats: int,
    compile_opts: dict[str, Any] | None = None,
    batch: int = 128,
    max_cell_s: float = 60.0,
    methods: Sequence[str] | None = None,
    count: bool = False,
) -> list[dict[str, Any]]:
    """Time per step (ms), peak MiB and compile s of every :data:`NET_METHODS` row per width.

    A method whose first call at some width takes longer than ``max_cell_s`` is skipped at the
    larger widths ("skipped"); a failing cell (e.g. out of memory) records the error's name.
    ``count``: also :func:`count_dispatch` per eager cell (``"<label> ops"``, a dict), and the
    profiled CUDA kernels per compiled cell on a GPU.
    """
    rows: list[dict[str, Any]] = []
    slow: set[str] = set()
    variants = [("", None)] + ([(" compiled", compile_opts)] if compile_opts is not None else [])
    for d in widths:
        row: dict[str, Any] = {"d": d, "batch": batch}
        for name, _, _ in NET_METHODS:
            if methods is not None and name not in methods:
                continue
            for suffix, opts in variants:
                label = name + suffix
                if label in slow:
                    row[label] = "skipped"
                    continue
                try:
                    if DEVICE.type == "cuda":
                        torch.cuda.empty_cache()
                    step = net_step(name, d, batch, opts)
                    start = time.perf_counter()
                    step()  # first call: compilation, lazy initialisation
                    first = time.perf_counter() - start
                    if opts is not None:
                        row[label + " compile s"] = first
                    row[label + " peak MiB"] = peak_memory_mib(step)
                    if count and opts is None:
                        row[label + " ops"] = count_dispatch(step)
                    elif count and DEVICE.type == "cuda":
                        row[label + " ops"] = {"cuda kernels": count_cuda_kernels(step)}
                    reps = repeats if first < 1.0 else max(2, repeats // 5)
                    row[label] = 1e3 * time_call(step, reps, warmup=1)
                    if first > max_cell_s:
                        slow.add(label)
                except Exception as err:  # out of memory, no compiler, ...
                    row[label] = f"failed: {type(err).__name__}"
                    slow.add(label)
                finally:
                    step = None  # type: ignore[assignment]
        rows.append(row)
    return rows


# ----------------------------------------------------------------- issue-28 target table
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


def activation(name: str) -> nn.Module:
    """A declared activation by its row label in :data:`ACTIVATIONS`."""
    from lightning_dvi import nn as dnn

    return dnn.GELU("tanh") if name == "GELU tanh" else getattr(dnn, name)()


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


def interleaved(cells: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds per call of every cell, one sample per cell per round, round-robin.

    Alternating the cells in one process exposes them to the same machine load; a label
    ending in ``" FTZ"`` runs its sample with :class:`flush_denormal` on.
    """
    samples: dict[str, list[float]] = {k: [] for k in cells}
    for fn in cells.values():
        fn()  # warm-up
    for _ in range(rounds):
        for label, fn in cells.items():
            if label.endswith(" FTZ"):
                with flush_denormal():
                    samples[label].append(time_call(fn, 1, warmup=0))
            else:
                samples[label].append(time_call(fn, 1, warmup=0))
    return samples


def ratio(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of the per-round ratio ``num / den`` (load cancels within a round)."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den], strict=True))


def count_subnormals(fn: Callable[[], Any]) -> int:
    """Subnormal values in the outputs of every aten op of one call (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    total = 0

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal total
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor) and t.is_floating_point():
                    total += int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum())
            return out

    fn()
    with Counter():
        fn()
    return total


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
    import subprocess

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
    samples = interleaved(cells, rounds)
    out: dict[str, Any] = {"median ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()}}
    rows = []
    for width, batch in sizes:
        for ftz in ("", " FTZ"):
            rows.append({"case": f"dDVI / plain MLP, width {width}, batch {batch}{ftz}",
                         "ratio": ratio(samples, f"dDVI {width}/{batch}{ftz}",
                                        f"plain MLP {width}/{batch}{ftz}"), "target": "<= 3"})  # fmt: skip
    rows.append({"case": "Pyro AutoNormal / dDVI, width 50, batch 512",
                 "ratio": ratio(samples, "Pyro AutoNormal 50/512", "dDVI 50/512 "),
                 "target": ">= 3"})  # fmt: skip
    rows.append({"case": "tail-heavy dDVI 8-128-128-2, batch 256: FTZ / no FTZ",
                 "ratio": ratio(samples, "dDVI tail 128/256 FTZ", "dDVI tail 128/256"),
                 "target": "~1"})  # fmt: skip
    rows.append({"case": "DVI / MCVI S=10, width 50, batch 32",
                 "ratio": ratio(samples, "DVI 50/32", "MCVI S=10 50/32"), "target": "<= 1"})  # fmt: skip
    for name in names[1:]:
        for ftz in ("", " FTZ"):
            rows.append({"case": f"diag 8-64-64-1, batch 256: {name} / ReLU{ftz}",
                         "ratio": ratio(samples, f"act {name}{ftz}", f"act ReLU{ftz}"),
                         "target": "<= 3"})  # fmt: skip
    if not quick:
        for name in (
            "ReLU",
            "GELU",
            "Tanh",
            *[n for n in names if n not in ("ReLU", "GELU", "Tanh")],
        ):
            run = subprocess.run([sys.executable, __file__, "--rss-child", name], check=True,
                                 capture_output=True, text=True)  # fmt: skip
            out[f"peak RSS {name}"] = float(run.stdout.split()[-1])
        relu = out["peak RSS ReLU"]
        for name in names[1:]:
            rows.append({"case": f"full 8-512-512-2, batch 64, peak RSS: {name} vs ReLU",
                         "ratio": out[f"peak RSS {name}"] / relu, "target": "<= 1.10"})  # fmt: skip
    out["subnormals per tail step"] = count_subnormals(tail_step())
    out["rows"] = rows
    return out


# ------------------------------------------------------------------------------ reporting
def table(rows: list[dict[str, Any]], cols: Sequence[str], fmt: str = "{:.3f}") -> str:
    """A Markdown table of ``rows`` restricted to ``cols``."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [fmt.format(row[c]) if isinstance(row.get(c), float) else str(row.get(c, "-"))
                 for c in cols]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the selected sections, print Markdown tables, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per number")
    p.add_argument("--sections", default="steps,layer,frontends,compile,net,targets")
    p.add_argument("--rounds", type=int, default=31, help="targets section: interleaved rounds")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-dir", default=None, help="UCI data folder (frontends section)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--widths", default=None, help="net section widths, e.g. 128,512,1024,2048")
    p.add_argument("--batch", type=int, default=128, help="net section batch size")
    p.add_argument(
        "--compiled",
        default="auto",
        choices=("auto", "on", "off"),
        help="compiled columns of the net section (auto: on for cuda, off for cpu)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    p.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "blocked", "whole", "compiled"),
        help="lightning_dvi.moments.policy kernel backend (A/B runs)",
    )
    p.add_argument("--memory-budget", type=int, default=None, help="moments scratch bytes")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (default off)")
    p.add_argument("--max-cell-s", type=float, default=60.0, help="skip slower methods after")
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="net section: aten ops, non-view ops and host reads per step (+ CUDA kernels)",
    )
    args = p.parse_args(argv)
    if args.rss_child:  # a child process of the targets section: one peak-RSS measurement
        torch.set_num_threads(1)
        rss_child(args.rss_child)
        return {}
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    global DEVICE
    DEVICE = torch.device(args.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    from lightning_dvi.moments import policy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend, budget = policy.get_kernel_backend(), policy.get_memory_budget()
    policy.set_kernel_backend(args.kernels)
    if args.memory_budget is not None:
        policy.set_memory_budget(args.memory_budget)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)
        policy.set_kernel_backend(backend)  # type: ignore[arg-type]
        policy.set_memory_budget(budget)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        DEVICE = torch.device("cpu")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    repeats = args.repeats or (3 if args.quick else 21)
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:],
        "device": str(DEVICE), "kernels": args.kernels,
    }  # fmt: skip
    if DEVICE.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(DEVICE)
        result["tf32"] = torch.backends.cuda.matmul.allow_tf32
    result["load_before"] = os.getloadavg()
    make_step("DVI", 16, 8)()  # first-call costs (lazy init, allocator) out of the first row
    if "steps" in sections:
        widths, batches = ((50,), (32,)) if args.quick else ((50, 128), (32, 512))
        rows = bench_steps(widths, batches, repeats)
        result["steps"], result["step_ratios"] = rows, step_ratios(rows)
        print("\n## Training step (ms, median)\n")
        print(table(rows, ["width", "batch"] + [m[0] for m in STEP_METHODS]))
        print("\n## Aten ops per step (forward + backward)\n")
        print(table([{"width": r["width"], "batch": r["batch"], **r["ops"]} for r in rows],
                    ["width", "batch"] + [m[0] for m in STEP_METHODS]))  # fmt: skip
        print("\n## Ratios\n")
        print(table(result["step_ratios"], list(result["step_ratios"][0]), "{:.2f}"))
    if "layer" in sections:
        dims = (16, 64) if args.quick else (16, 32, 64, 128, 256, 512, 1024)
        rows = bench_layer(dims, repeats, quick=args.quick)
        labels = [k[0] for k in layer_kinds(args.quick)]
        mcvi = [lab for lab in labels if lab.startswith("MCVI")]
        result["layer"] = rows
        result["crossover"] = {lab: crossovers(rows, lab) for lab in mcvi}
        print("\n## One d x d layer, batch 10, forward (ms, median)\n")
        print(table(rows, ["d", *labels, "DVI peak MiB"]))
        print(
            "\nDVI against MCVI:",
            "; ".join(f"{lab}: {describe_crossover(rows, lab)}" for lab in mcvi),
        )
    if "frontends" in sections:
        result["pyro_guide"] = bench_pyro_guide(50, 32, repeats)
        print("\n## Pyro DeterministicGuide step vs bare dDVI step (ms)\n")
        print(table([result["pyro_guide"]], list(result["pyro_guide"])))
        if args.data_dir is None:
            print("\n(Lightning epoch vs bare loop skipped: pass --data-dir with UCI power)")
        else:
            lit = bench_lightning(args.data_dir, 50, 64, 1 if args.quick else 10)
            result["lightning"] = lit
            print("\n## Lightning epoch vs bare loop, UCI power (s)\n")
            print(table([lit], list(lit)))
    if "compile" in sections and not args.quick:
        result["compile"] = bench_compile(repeats)
        print("\n## torch.compile (inductor), forward + backward\n")
        print(table(result["compile"], ["kernel", "eager ms", "compile s", "compiled ms"]))
    if "net" in sections:
        if args.widths:
            widths = [int(w) for w in args.widths.split(",")]
        elif args.quick:
            widths = [16, 32]
        else:
            widths = [128, 256, 512, 1024, 2048] if DEVICE.type == "cuda" else [32, 64, 128]
        compiled = args.compiled == "on" or (args.compiled == "auto" and DEVICE.type == "cuda")
        opts: dict[str, Any] | None = None
        if compiled:
            opts = {"backend": args.compile_backend}
            if args.compile_mode:
                opts["mode"] = args.compile_mode
        rows = bench_net(widths, repeats, opts, args.batch, args.max_cell_s, count=args.count_ops)
        result["net"] = rows
        names = [m[0] for m in NET_METHODS]
        print(f"\n## 3-layer d x d net, batch {args.batch}, forward + backward (ms, median)\n")
        print(table(rows, ["d", *names]))
        if args.count_ops:
            print("\n## Ops per step: aten ops / non-view ops / host reads [/ CUDA kernels]\n")
            print(table(op_rows(rows), ["d", *(lab for lab in op_labels(rows))]))
        print("\n## Peak memory (MiB)\n")
        print(table(rows, ["d", *(n + " peak MiB" for n in names)], "{:.1f}"))
        if compiled:
            print("\n## Compiled (ms, median; compile s of the first call in the JSON)\n")
            print(table(rows, ["d", *(n + " compiled" for n in names)]))
    if "targets" in sections and DEVICE.type == "cpu":
        targets = bench_targets(3 if args.quick else args.rounds, args.quick)
        result["targets"] = targets
        print(f"\n## Issue 28 targets ({len(targets['rows'])} rows, interleaved, 1 thread)\n")
        print(table(targets["rows"], ["case", "ratio", "target"], "{:.2f}"))
        print("\nMedian ms per step:", ", ".join(f"{k}: {v:.3f}" for k, v in
                                                 targets["median ms"].items()))  # fmt: skip
        print("Subnormal values per dDVI step of the tail-heavy 8-128-128-2 net:",
              targets["subnormals per tail step"])  # fmt: skip
    result["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
