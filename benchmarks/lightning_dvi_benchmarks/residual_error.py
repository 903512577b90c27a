r"""The image residual-sum approximation against Monte Carlo, on ResNet blocks.

``python -m lightning_dvi_benchmarks.residual_error`` prints the table of ``docs/moments.md``
("Residual sums in converted networks").

A converted ResNet block computes ``relu(branch(x) + shortcut(x))``. On images (per-pixel
moments) a :class:`~lightning_dvi.nn.GraphNetwork` sums the two operands as if independent
(:mod:`lightning_dvi.nn.graph`), dropping :math:`2\operatorname{Cov}(a_i, b_i)` from the
variance of the sum. This measures what that costs: the block (torchvision-shaped
:class:`~lightning_dvi_benchmarks.torch_resnet.BasicBlock` or ``Bottleneck`` with BatchNorm in
eval mode, non-trivial running statistics) is converted with posterior std
``scale_fraction * |w|``, fed a diag Gaussian input :math:`x \sim \mathcal N(m, v)`, and its
diag-mode moments are compared with Monte Carlo over input and weight draws together (the
network's ``sample`` mode on sampled inputs). The same is done for the branch alone (the
per-pixel approximation of the convolutions, without any sum), so the two rows separate the
sum's error from the convolutions' own.

Errors are over the output units whose MC standard deviation is above 1e-3 of the largest (a
ReLU unit that is zero in every draw has none): the median and the largest relative error of
the standard deviation, and the largest mean error in MC standard deviations.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from lightning_dvi.gaussian import Gaussian
from lightning_dvi.nn import from_torch
from lightning_dvi.propagation import propagation

from .torch_resnet import BasicBlock, Bottleneck

__all__ = ["BlockError", "block_error", "main"]


@dataclass(frozen=True)
class BlockError:
    """One row: the errors of the diag moments of ``part`` against Monte Carlo."""

    block: str
    part: str
    scale_fraction: float
    std_median: float
    std_max: float
    mean_max: float
    dropped_median: float = float("nan")
    dropped_max: float = float("nan")


class _Part(nn.Module):
    """The block (``"block"``), its residual sum before the ReLU (``"sum"``) or its branch."""

    def __init__(self, block: nn.Module, part: str) -> None:
        super().__init__()
        self.block, self.part = block, part

    def forward(self, x: Tensor) -> Tensor:
        b = self.block
        if self.part == "block":
            out: Tensor = b(x)
            return out
        if isinstance(b, Bottleneck):
            h = b.relu(b.bn2(b.conv2(b.relu(b.bn1(b.conv1(x))))))
            branch: Tensor = b.bn3(b.conv3(h))
        else:
            assert isinstance(b, BasicBlock)
            branch = b.bn2(b.conv2(b.relu(b.bn1(b.conv1(x)))))
        if self.part == "branch":
            return branch
        shortcut: Tensor = x if b.downsample is None else b.downsample(x)
        if self.part == "pair":
            return torch.cat([branch, shortcut], 1)
        return branch + shortcut


def _block(kind: str, channels: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "basic":
        block: nn.Module = BasicBlock(channels, channels)
    elif kind == "basic-down":
        down = nn.Sequential(
            nn.Conv2d(channels, 2 * channels, 1, stride=2, bias=False), nn.BatchNorm2d(2 * channels)
        )
        block = BasicBlock(channels, 2 * channels, stride=2, downsample=down)
    else:
        block = Bottleneck(4 * channels, channels)
    block = block.double().train()
    with torch.no_grad():  # non-trivial running statistics
        for _ in range(4):
            block(torch.randn(8, *_in_shape(block, channels), dtype=torch.float64) * 1.5 + 0.3)
    return block.eval()


def _in_shape(block: nn.Module, channels: int, size: int = 6) -> tuple[int, int, int]:
    return (4 * channels if isinstance(block, Bottleneck) else channels, size, size)


def block_error(
    kind: str = "basic",
    part: str = "sum",
    scale_fraction: float = 0.2,
    channels: int = 4,
    num_samples: int = 10_000,
    seed: int = 0,
) -> BlockError:
    """Diag moments of a converted ResNet block (or its sum, or branch) against Monte Carlo.

    Args:
        kind: ``"basic"`` (identity shortcut), ``"basic-down"`` (stride-2 1x1-conv + BN
            shortcut) or ``"bottleneck"``.
        part: ``"block"`` (after the final ReLU), ``"sum"`` (before it) or ``"branch"``.
        scale_fraction: posterior std as a fraction of ``|w|``.
        channels: block width.
        num_samples: Monte Carlo draws of (input, weights).
        seed: seed of the block, the input and the draws.
    """
    block = _block(kind, channels, seed)
    net = from_torch(_Part(block, part), scale_fraction=scale_fraction)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (1, *_in_shape(block, channels))
    mean = torch.randn(shape, generator=gen, dtype=torch.float64)
    var = (0.3 * torch.rand(shape, generator=gen, dtype=torch.float64) + 0.05) ** 2
    with torch.no_grad():
        dvi = net(Gaussian(mean, var=var), mode="diag")
        torch.manual_seed(seed + 2)
        draws = []
        for chunk in range(0, num_samples, 2_000):
            s = min(2_000, num_samples - chunk)
            xs = mean + var.sqrt() * torch.randn(s, *shape, dtype=torch.float64)
            draws.append(cast(Tensor, net.propagate(xs, propagation("sample"))))
        mc = torch.cat(draws)
    mc_mean, mc_std = mc.mean(0), mc.std(0)
    live = mc_std > 1e-3 * mc_std.max()  # a ReLU output that is zero in every draw has no std
    std_rel = ((dvi.var.sqrt() - mc_std).abs() / mc_std)[live]
    mean_err = ((dvi.mean - mc_mean).abs() / mc_std)[live].max()
    dropped = torch.full((1,), float("nan"))
    if part == "sum":  # the share of Var(a + b) that 2 Cov(a, b) is, by MC of (a, b) jointly
        pair = from_torch(_Part(block, "pair"), scale_fraction=scale_fraction)
        with torch.no_grad():
            xs = mean + var.sqrt() * torch.randn(num_samples, *shape, dtype=torch.float64)
            ab = cast(Tensor, pair.propagate(xs, propagation("sample")))
        a, b = ab.chunk(2, dim=2)
        cov = ((a - a.mean(0)) * (b - b.mean(0))).mean(0)
        dropped = (2 * cov).abs()[live] / mc_std[live] ** 2
    return BlockError(
        kind, part, scale_fraction, float(std_rel.median()), float(std_rel.max()),
        float(mean_err), float(dropped.median()), float(dropped.max()),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Print the table of docs/moments.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=10_000)
    args = parser.parse_args(argv)
    print(
        "| block | part | δ | std rel. error, median | max | mean error (MC sd), max "
        "| dropped 2Cov(a,b)/Var(a+b), median | max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("basic", "basic-down", "bottleneck"):
        for delta in (0.1, 0.3):
            for part in ("branch", "sum", "block"):
                e = block_error(kind, part, delta, num_samples=args.num_samples)
                print(
                    f"| {e.block} | {e.part} | {delta} | {e.std_median:.3f} | {e.std_max:.3f} "
                    f"| {e.mean_max:.3f} | {e.dropped_median:.3f} | {e.dropped_max:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
