"""The speed benchmark's ``frontends``, ``compile`` and ``net`` sections (recipes/speed_benchmark.py).

``frontends``: a ``DVIRegressor`` epoch on UCI power against a bare loop, and a Pyro
``DeterministicGuide`` step against the bare dDVI step. ``compile``: ``torch.compile`` of the
moment kernels and of a training step. ``net``: the GPU table of docs/benchmarks.md, a 3-layer
net ``BayesLinear(d, d)-ReLU-BayesLinear(d, d)-ReLU-BayesLinear(d, 2)``, batch 128, forward +
backward of ``sum(mean) + sum(cov)``, every method eager and compiled, with peak memory.
Everything runs on :data:`lightning_dvi_benchmarks.speed.DEVICE`.
"""

from __future__ import annotations

import functools
import statistics
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

from . import speed as S
from .speed import (
    IN_FEATURES,
    NUM_DATA,
    count_cuda_kernels,
    count_dispatch,
    peak_memory_mib,
    pyro_bnn,
    time_call,
)

__all__ = [
    "NET_METHODS",
    "bench_compile",
    "bench_compiled_step",
    "bench_lightning",
    "bench_net",
    "bench_pyro_guide",
    "net_cell",
    "net_step",
    "report_net",
]


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
            row["compiled ms"] = 1e3 * time_call(functools.partial(step, compiled), repeats)
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
    x = torch.randn(batch, d, device=S.DEVICE)
    if mode is None:
        plain = nn.Sequential(
            nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2)
        ).to(S.DEVICE)
        fwd = plain if compile_opts is None else torch.compile(plain, **compile_opts)

        def plain_step() -> None:
            plain.zero_grad(set_to_none=True)
            fwd(x).sum().backward()

        return plain_step
    net = Sequential(BayesLinear(d, d), ReLU(), BayesLinear(d, d), ReLU(), BayesLinear(d, 2))
    net.to(S.DEVICE)
    kwargs: dict[str, Any] = {"mode": mode}
    if samples is not None:
        kwargs["num_samples"] = samples
    forward = net if compile_opts is None else compile_network(net, **compile_opts)

    def step() -> None:
        net.zero_grad(set_to_none=True)
        out = forward(x, **kwargs)
        if isinstance(out, Gaussian):
            spread = out.var if out.cov is None else out.cov
            loss = out.mean.sum() + spread.sum()
        else:
            loss = out.sum()
        loss.backward()

    return step


def net_cell(
    method: str,
    d: int,
    batch: int,
    repeats: int,
    compile_opts: dict[str, Any] | None = None,
    count: bool = False,
) -> dict[str, Any]:
    """One cell of :func:`bench_net`: ``method`` at width ``d``, eager or compiled.

    The first call (compilation, lazy initialisation) is timed on its own; then the peak memory
    of one step, the op counts (``count``: :func:`count_dispatch` eager, the profiled CUDA
    kernels compiled on a GPU) and the median time over ``repeats`` samples (``max(2,
    repeats // 5)`` when the first call took over a second).

    Returns:
        ``{label: ms, label + " peak MiB": MiB, label + " first s": s}``, plus ``label + "
        compile s"`` (compiled) and ``label + " ops"`` (``count``), where ``label`` is
        ``method`` with `` compiled`` appended for a compiled cell.

    Raises:
        Exception: whatever the step raises (out of memory, no compiler, ...).
    """
    label = method + ("" if compile_opts is None else " compiled")
    cell: dict[str, Any] = {}
    if S.DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    if compile_opts is not None:
        # A fresh compilation per cell: Dynamo would otherwise recompile the previous width's
        # graph with dynamic shapes, and fall back to eager past its recompilation limit.
        torch._dynamo.reset()
    step = net_step(method, d, batch, compile_opts)
    start = time.perf_counter()
    step()  # first call: compilation, lazy initialisation
    first = time.perf_counter() - start
    cell[label + " first s"] = first
    if compile_opts is not None:
        cell[label + " compile s"] = first
    cell[label + " peak MiB"] = peak_memory_mib(step)
    if count and compile_opts is None:
        cell[label + " ops"] = count_dispatch(step)
    elif count and S.DEVICE.type == "cuda":
        cell[label + " ops"] = {"cuda kernels": count_cuda_kernels(step)}
    reps = repeats if first < 1.0 else max(2, repeats // 5)
    cell[label] = 1e3 * time_call(step, reps, warmup=1)
    return cell


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
    profiled CUDA kernels per compiled cell on a GPU. Each cell is :func:`net_cell`.
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
                    cell = net_cell(name, d, batch, repeats, opts, count)
                    row.update(cell)
                    if cell[label + " first s"] > max_cell_s:
                        slow.add(label)
                except Exception as err:  # out of memory, no compiler, ...
                    row[label] = f"failed: {type(err).__name__}"
                    slow.add(label)
        rows.append(row)
    return rows


def report_net(rows: list[dict[str, Any]], batch: int, compiled: bool, count_ops: bool) -> str:
    """The ``net`` section's Markdown report: times, op counts, peak memory, compiled times."""
    names = [m[0] for m in NET_METHODS]
    out = [f"\n## 3-layer d x d net, batch {batch}, forward + backward (ms, median)\n"]
    out.append(S.table(rows, ["d", *names]))
    if count_ops:
        out.append("\n## Ops per step: aten ops / non-view ops / host reads [/ CUDA kernels]\n")
        out.append(S.table(S.op_rows(rows), ["d", *S.op_labels(rows)]))
    out += [
        "\n## Peak memory (MiB)\n",
        S.table(rows, ["d", *(n + " peak MiB" for n in names)], "{:.1f}"),
    ]
    if compiled:
        out.append("\n## Compiled (ms, median; compile s of the first call in the JSON)\n")
        out.append(S.table(rows, ["d", *(n + " compiled" for n in names)]))
    return "\n".join(out)
