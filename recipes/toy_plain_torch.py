"""Full DVI on the paper's toy heteroscedastic data, in plain PyTorch (no Lightning, no Pyro).

Trains a 1-128-128-2 ReLU BNN whose outputs are (m, l) with y ~ N(m, e^l), using the closed-form
expected log-likelihood on the full output covariance and the empirical-Bayes prior, then plots
the predictive mean +- 2 std and prints train/test log-likelihoods next to the true noise
model's. Run:

    .venv/bin/python recipes/toy_plain_torch.py --steps 900 --output outputs/toy_plain_torch.png

(``--threads 1`` is faster on a CPU shared with other jobs.)
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import Tensor

from lightning_dvi.data.toy import (
    make_toy_heteroscedastic,
    toy_mean,
    toy_noise_std,
    toy_true_log_likelihood,
)
from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import Sequential, mlp
from lightning_dvi.objective import KLSchedule, elbo
from lightning_dvi.priors import EmpiricalBayes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=900, help="optimisation steps")
    parser.add_argument("--seed", type=int, default=0, help="seed for data and initialisation")
    parser.add_argument("--output", type=Path, default=Path("outputs/toy_plain_torch.png"))
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=4e-3, help="Adam learning rate (cosine decay)")
    parser.add_argument(
        "--warmup-frac", type=float, default=0.6, help="fraction of steps with the KL off"
    )
    parser.add_argument(
        "--anneal-frac", type=float, default=0.2, help="fraction of steps ramping the KL in"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default; 1 is faster on a machine shared with others)",
    )
    return parser.parse_args()


class Standardiser:
    """Affine maps fitted on the training split; log-likelihoods go back to y's original units."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x_mean, self.x_std = x.mean(0), x.std(0)
        self.y_mean, self.y_std = y.mean(), y.std()

    def x(self, x: Tensor) -> Tensor:
        """Standardise inputs."""
        return (x - self.x_mean) / self.x_std

    def y(self, y: Tensor) -> Tensor:
        """Standardise targets."""
        return (y - self.y_mean) / self.y_std


@torch.no_grad()
def predictive(
    net: Sequential,
    lik: HeteroscedasticGaussian,
    x: Tensor,
    std: Standardiser,
    chunk: int = 250,
) -> torch.distributions.Normal:
    """Full-mode predictive of y in original units, in chunks to bound [B, 128, 128] memory."""
    means, stds = [], []
    for xb in std.x(x).split(chunk):
        dist = lik.predictive(net(xb, mode="full"))
        means.append(dist.mean * std.y_std + std.y_mean)
        stds.append(dist.stddev * std.y_std)
    return torch.distributions.Normal(torch.cat(means), torch.cat(stds))


def plot(
    net: Sequential,
    lik: HeteroscedasticGaussian,
    std: Standardiser,
    x: Tensor,
    y: Tensor,
    path: Path,
) -> None:
    grid = torch.linspace(-0.5, 0.5, 300).unsqueeze(-1)
    dist = predictive(net, lik, grid, std)
    g, mean, std = grid[:, 0].numpy(), dist.mean.numpy(), dist.stddev.numpy()
    true_mean, true_std = toy_mean(grid[:, 0]).numpy(), toy_noise_std(grid[:, 0]).numpy()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(x[:, 0].numpy(), y.numpy(), s=6, c="k", alpha=0.5, label="train data")
    ax.plot(g, mean, c="C0", label="DVI predictive mean")
    ax.fill_between(g, mean - 2 * std, mean + 2 * std, color="C0", alpha=0.25, label="± 2 std")
    ax.plot(g, true_mean, "C3--", lw=1, label="true mean")
    ax.plot(g, true_mean - 2 * true_std, "C3:", lw=1, label="true ± 2 noise std")
    ax.plot(g, true_mean + 2 * true_std, "C3:", lw=1)
    ax.set(xlabel="x", ylabel="y", title="Full DVI, empirical-Bayes prior, heteroscedastic noise")
    ax.legend(loc="upper left", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x_train, y_train = make_toy_heteroscedastic(500, seed=args.seed)
    x_test, y_test = make_toy_heteroscedastic(1000, seed=args.seed + 10_000)
    num_data = len(x_train)
    std = Standardiser(x_train, y_train)
    xs_train, ys_train = std.x(x_train), std.y(y_train)

    net = mlp(1, [128, 128], 2)
    with torch.no_grad():
        # With zero biases every first-layer ReLU has its kink at x = 0, and a 1-D fit then
        # spends most of its steps moving kinks; spread them over the standardised inputs.
        kinks = torch.empty(128).uniform_(-1.8, 1.8)
        net[0].bias_loc.copy_(-net[0].weight_loc[:, 0] * kinks)
        # Start with a small predicted noise (std e^-1.5 ~ 0.2 of y's): a large initial noise
        # lets the likelihood explain the data as noise and the mean fit stalls.
        net[-1].bias_loc[1] = -3.0
    lik = HeteroscedasticGaussian()
    prior = EmpiricalBayes(alpha=1.0, beta=10.0, mode="in_graph")
    schedule = KLSchedule(
        warmup_steps=int(args.warmup_frac * args.steps),
        anneal_steps=int(args.anneal_frac * args.steps),
    )
    optimiser = torch.optim.Adam(net.parameters(), lr=args.lr)
    lr_decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=args.steps)
    gen = torch.Generator().manual_seed(args.seed)

    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(num_data, (args.batch_size,), generator=gen)
        terms = elbo(
            net, lik, prior, xs_train[idx], ys_train[idx], num_data, kl_weight=schedule(step)
        )
        optimiser.zero_grad()
        terms.loss.backward()
        optimiser.step()
        lr_decay.step()
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  elbo/N {terms.elbo.item():8.4f}  "
                f"E[log lik] {terms.expected_log_likelihood.item():8.4f}  "
                f"KL {terms.kl.item():9.2f}  kl_weight {terms.kl_weight:.2f}  "
                f"{time.perf_counter() - start:6.1f}s",
                flush=True,
            )

    train_ll = predictive(net, lik, x_train, std).log_prob(y_train).mean().item()
    test_ll = predictive(net, lik, x_test, std).log_prob(y_test).mean().item()
    true_ll = toy_true_log_likelihood(x_test, y_test).item()
    with torch.no_grad():
        full_elbo = elbo(net, lik, prior, xs_train, ys_train, num_data).elbo.item()
    plot(net, lik, std, x_train, y_train, args.output)
    print(f"final train ELBO / N              {full_elbo:8.4f}")
    print(f"final train log-likelihood / pt   {train_ll:8.4f}")
    print(f"final test  log-likelihood / pt   {test_ll:8.4f}")
    print(f"true noise model test LL / pt     {true_ll:8.4f}")
    stds = {k: round(math.sqrt(v), 3) for k, v in prior.refresh(net).items()}
    print(f"empirical-Bayes prior std per group {stds}")
    print(f"wrote {args.output}  ({time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main()
