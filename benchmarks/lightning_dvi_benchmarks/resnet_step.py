r"""CPU time of one training step of a ResNet-18: deterministic against whole-network dDVI.

A data point for issue 29's time question (cuTAGI reports 142.6 s per CIFAR-10 epoch of a
ResNet-18 on a GPU; this package's GPU time is unmeasured until a GPU is lent). Both steps
train the same torchvision-shaped ResNet-18 (:func:`~lightning_dvi_benchmarks.torch_resnet.resnet18`
with the small-image stem, ``width`` channels in the first stage, 3 input channels) on one
synthetic batch of ``[batch, 3, size, size]`` images with Adam:

* ``deterministic``: the torch network, cross-entropy, backward, Adam step (BatchNorm in
  training mode);
* ``ddvi``: the network converted by ``from_torch`` (every weight layer Bayesian, BatchNorm on
  its running statistics), the per-datum ELBO of :func:`lightning_dvi.objective.elbo` in
  ``mode="diag"`` (the categorical bound, a Gaussian prior, :math:`N` = 50 000), backward, Adam.

Each is warmed up once, then ``steps`` steps are timed with ``time.process_time`` (CPU seconds
of every thread) and the median is reported, the two interleaved step by step so that load
changes hit both alike.

Usage::

    python -m lightning_dvi_benchmarks.resnet_step [--width 64] [--size 32] [--batch 32]
        [--steps 3] [--threads 1] [--count-ops]

``--count-ops`` adds what one step of each dispatches (aten ops, non-view ops, host reads:
:func:`~lightning_dvi_benchmarks.timing.count_dispatch`, the counter of the GPU suite's resnet
section), with the steps' own Adam and with a ``foreach`` Adam (the CUDA default).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .resnet_digits import machine
from .torch_resnet import resnet18

__all__ = ["ddvi_step", "deterministic_step", "main", "resnet_pair", "step_counts", "step_seconds"]

Step = Callable[[torch.Tensor, torch.Tensor], None]


def deterministic_step(net: nn.Module, foreach: bool | None = None) -> Step:
    """``step(x, y)``: cross-entropy of the torch network, backward, Adam step (lr 1e-3)."""
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=foreach)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimiser.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimiser.step()

    return step


def ddvi_step(
    net: nn.Module,
    num_data: int = 50_000,
    device: torch.device | str | None = None,
    foreach: bool | None = None,
) -> Step:
    """``step(x, y)``: the per-datum dDVI ELBO of ``from_torch(net)``, backward, Adam step.

    Every weight layer Bayesian, BatchNorm on its running statistics (``freeze_statistics``),
    the categorical bound over 10 classes, a Gaussian prior, :math:`N` = ``num_data``; the
    converted network is moved to ``device`` before its optimiser is built (``foreach``:
    Adam's implementation, torch's default for ``None``).
    """
    from lightning_dvi.likelihoods import Categorical
    from lightning_dvi.nn import BatchNorm1d, BatchNorm2d, from_torch
    from lightning_dvi.objective import elbo
    from lightning_dvi.priors import GaussianPrior

    converted = from_torch(net)
    for module in converted.modules():
        if isinstance(module, (BatchNorm1d, BatchNorm2d)):
            module.freeze_statistics = True
    converted.train()
    likelihood, prior = Categorical(10), GaussianPrior()
    if device is not None:
        converted.to(device)
        likelihood.to(device)
        prior.to(device)
    params = [p for p in converted.parameters() if p.requires_grad]
    optimiser = torch.optim.Adam(params, lr=1e-3, foreach=foreach)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimiser.zero_grad()
        elbo(converted, likelihood, prior, x, y, num_data=num_data, mode="diag").loss.backward()
        optimiser.step()

    return step


def resnet_pair(x: torch.Tensor, width: int = 64, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """Two identical CIFAR-stem ResNet-18s for 3-channel ``x``: ``(plain, bayes)``.

    ``plain`` is in training mode, its BatchNorm running statistics set by one pass over ``x``
    (non-trivial statistics for the converted network); ``bayes`` holds the same weights and
    statistics, in evaluation mode, for :func:`ddvi_step`.
    """
    torch.manual_seed(seed)
    plain = resnet18(num_classes=10, in_channels=3, small_input=True, width=width)
    plain.to(x.device).train()
    with torch.no_grad():
        plain(x)
    bayes = resnet18(num_classes=10, in_channels=3, small_input=True, width=width)
    bayes.load_state_dict(plain.state_dict())
    return plain, bayes.to(x.device).eval()


def step_seconds(
    width: int = 64, size: int = 32, batch: int = 32, steps: int = 3, seed: int = 0
) -> dict[str, list[float]]:
    """CPU seconds of each timed step: ``{"deterministic": [...], "ddvi": [...]}``.

    Raises:
        ValueError: for ``steps < 1`` or ``batch < 2``.
    """
    if steps < 1 or batch < 2:
        raise ValueError(f"need steps >= 1 and batch >= 2, got steps={steps}, batch={batch}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.arange(batch) % 10
    plain, bayes = resnet_pair(x, width, seed)
    runs = {"deterministic": deterministic_step(plain), "ddvi": ddvi_step(bayes)}
    for step in runs.values():  # warm-up: allocations, first-call dispatch
        step(x, y)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, step in runs.items():
            start = time.process_time()
            step(x, y)
            times[name].append(time.process_time() - start)
    return times


def step_counts(
    width: int = 64, size: int = 32, batch: int = 8, seed: int = 0
) -> dict[str, dict[str, int]]:
    """What one step dispatches: ``{"deterministic", "ddvi"} x {"", " foreach"}`` -> counts."""
    from .timing import count_dispatch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.arange(batch) % 10
    out = {}
    for suffix, foreach in (("", None), (" foreach", True)):
        plain, bayes = resnet_pair(x, width, seed)
        steps = {
            "deterministic": deterministic_step(plain, foreach),
            "ddvi": ddvi_step(bayes, foreach=foreach),
        }
        for name, step in steps.items():
            out[name + suffix] = count_dispatch(functools.partial(step, x, y))
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    """The command line: print the median CPU seconds per step and their ratio."""
    parser = argparse.ArgumentParser(prog="python -m lightning_dvi_benchmarks.resnet_step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--count-ops", action="store_true", help="aten ops per step too")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        times = step_seconds(args.width, args.size, args.batch, args.steps)
        counts = step_counts(args.width, args.size, args.batch) if args.count_ops else None
        info = machine()
    finally:
        torch.set_num_threads(threads)
    median = {name: statistics.median(values) for name, values in times.items()}
    ratio = median["ddvi"] / median["deterministic"]
    print(
        f"ResNet-18 width {args.width}, {args.size}x{args.size}, batch {args.batch}, "
        f"{args.threads} thread(s), {info['cpu']}, load {' '.join(info['loadavg'])}: "
        f"deterministic {median['deterministic']:.3f} CPU s/step, "
        f"dDVI {median['ddvi']:.3f} CPU s/step ({ratio:.1f}x)"
    )
    if counts is not None:
        for name, c in counts.items():
            print(
                f"{name}: {c['aten ops']} aten ops, {c['non-view ops']} non-view, "
                f"{c['host reads']} host reads per step"
            )
    return {"times": times, "median": median, "ratio": ratio, "machine": info, "counts": counts}


if __name__ == "__main__":
    main()
