r"""The whole path on a small ResNet: a trained network, then post-hoc and Bayesian rows on digits.

A torchvision-shaped ResNet-18 (:func:`~lightning_dvi_benchmarks.torch_resnet.resnet18` with the
small-image stem, one input channel, stage widths ``width``, ``2 width``, ``4 width``,
``8 width``) is trained deterministically on scikit-learn's digits as ``[1, 8, 8]`` images
(:func:`~lightning_dvi_benchmarks.data.digits_split` with one global mean and std, 1257 / 180 /
360 stratified rows, the split fixed), Adam on the cross-entropy, the weights of the epoch with
the lowest validation NLL kept. Every other row starts from that trained network:

* ``deterministic``: the network's softmax;
* ``temperature``: :func:`~lightning_dvi.lightning.temperature.fit_temperature` on the
  validation rows, :math:`p_T = \operatorname{softmax}(\log p / T)`;
* ``laplace``: :func:`~lightning_dvi_benchmarks.baselines.fit_last_layer_laplace` on ``fc`` (GGN
  in full, prior precision on the validation NLL, Monte Carlo over the logit Gaussian);
* ``dvi_last1``: last-layer DVI, ``from_torch(net, last_layers=1)`` (frozen plain-torch
  backbone, ``fc`` Bayesian with its posterior means at the trained weights), trained by
  :class:`~lightning_dvi.DVIClassifier` (``mode="diag"``: the logits' Gaussian is exact for one
  Bayesian linear layer on deterministic features) with ``kl_weight=1`` and a Gaussian prior
  whose variance is chosen on the validation NLL (:func:`fit_converted`);
* ``dvi_last1_defaults``: the same network trained with ``DVIClassifier``'s default arguments
  (default ``kl_weight`` and prior, no prior selection; the same optimiser budget,
  :func:`fit_defaults`);
* ``dvi_last2``: last-2-layer DVI, ``from_torch(net, last_layers=2)``: the cut falls inside the
  last BasicBlock, so the backbone returns the block's input (for the skip) and its first
  convolution's activation, and the head (``layer4.1.conv2``, its BatchNorm, the residual sum,
  ReLU, pooling, ``fc``) is a two-input graph whose inputs are deterministic; trained as
  ``dvi_last1`` (``mode="diag"``, the same budget and prior selection);
* ``ddvi_whole``: the whole ResNet converted by ``from_torch(net)`` (every convolution and
  ``fc`` Bayesian, posterior means at the trained weights, BatchNorm on its running
  statistics, the residual sums with their cross-covariances) and fine-tuned with
  ``mode="diag"`` (dDVI), the same objective and prior selection, Adam at 1e-4.

Every row reports test accuracy, NLL, ECE (15 bins), the OOD AUROC of the predictive entropy
against the test images with their 64 pixels shuffled by one fixed permutation
(:meth:`~lightning_dvi_benchmarks.data.ClassificationSplit.ood_inputs`, the classification
benchmark's OOD set), and ``train_s``: CPU seconds (``time.process_time``, all threads) of the
deterministic training for ``deterministic`` and of the extra work after it for every other row.
Over seeds (initialisation and batch order) the table gives mean ± standard deviation.

Usage::

    python -m lightning_dvi_benchmarks.resnet_digits [--seeds 3] [--quick] [--json out.json]
        [--markdown out.md] [--width 16] [--epochs 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dvi.lightning.temperature import fit_temperature, temper_probs

from . import baselines
from .baselines import Fitted
from .classification import Row, evaluate, fit_dvi, markdown_table, summarise
from .data import Budget, ClassificationSplit, digits_split
from .torch_resnet import ResNet, resnet18

__all__ = [
    "COLUMNS",
    "ROWS",
    "Config",
    "as_sequential",
    "fit_converted",
    "fit_defaults",
    "fit_deterministic",
    "fit_laplace",
    "fit_temperature_row",
    "main",
    "run",
]

#: Table columns (``train_s``: CPU seconds, see the module docstring).
COLUMNS = ("acc", "nll", "ece", "ood_auroc", "train_s")


@dataclass(frozen=True)
class Config:
    """Everything a run depends on (written into the JSON next to the results).

    Args:
        seeds: one run per seed (network initialisation and batch order; the split is fixed).
        width: channels of the ResNet's first stage.
        budget: the deterministic training (Adam's learning rate, batch size, epochs).
        num_train: keep only this many training rows (stratified); ``None``: all 1257.
        split_seed: seeds the train/validation/test split.
        laplace_precisions: the prior precisions the Laplace row chooses from.
        dvi_budget: the DVI rows' training after the conversion (Adam, batch, epochs; the best
            validation epoch kept).
        whole_budget: the same for the whole-network row (a smaller learning rate: every
            weight moves, and at 1e-3 the validation NLL rose from the first epoch on).
        dvi_prior_variances: the Gaussian prior variances the DVI rows choose from on the
            validation NLL (as the Laplace row chooses its prior precision).
        dvi_settings: further :class:`~lightning_dvi.DVIClassifier` arguments of the DVI rows,
            as ``(name, value)`` pairs (``kl_weight=1``: the ELBO itself, no tempering).
        mc_eval: Monte Carlo draws for the mutual-information detector of sampling rows.
        rows: the rows to run, in table order (``"deterministic"`` and names of :data:`ROWS`);
            ``None``: all of them.
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    width: int = 16
    budget: Budget = field(default_factory=lambda: Budget(epochs=40, lr=3e-3, batch_size=64))
    num_train: int | None = None
    split_seed: int = 0
    laplace_precisions: tuple[float, ...] = (1e-2, 1e-1, 1.0, 10.0, 1e2, 1e3, 1e4)
    dvi_budget: Budget = field(default_factory=lambda: Budget(epochs=20, lr=1e-3, batch_size=64))
    whole_budget: Budget = field(default_factory=lambda: Budget(epochs=10, lr=1e-4, batch_size=64))
    dvi_prior_variances: tuple[float, ...] = (0.01, 0.1, 1.0)
    dvi_settings: tuple[tuple[str, Any], ...] = (("kl_weight", 1.0),)
    mc_eval: int = 64
    rows: tuple[str, ...] | None = None

    @classmethod
    def quick(cls) -> Config:
        """A smoke test in seconds: 100 training rows, width 4, 2 epochs, one seed."""
        return cls(
            seeds=(0,),
            width=4,
            budget=Budget(epochs=2, lr=1e-2, batch_size=64),
            num_train=100,
            laplace_precisions=(1.0, 100.0),
            dvi_budget=Budget(epochs=1, lr=1e-2, batch_size=64),
            whole_budget=Budget(epochs=1, lr=1e-3, batch_size=64),
            dvi_prior_variances=(0.1, 1.0),
            mc_eval=8,
        )


def make_split(config: Config) -> ClassificationSplit:
    """Digits as ``[1, 8, 8]`` images, one global mean and std (the CNN protocol's preprocessing)."""
    return digits_split(
        "global", images=True, num_train=config.num_train, split_seed=config.split_seed
    )


def make_resnet(config: Config) -> ResNet:
    """The untrained ResNet-18 of the benchmark (small-image stem, one channel, ten classes)."""
    return resnet18(num_classes=10, in_channels=1, small_input=True, width=config.width)


def fit_deterministic(split: ClassificationSplit, config: Config, seed: int) -> Fitted:
    """Row ``deterministic``: Adam on the cross-entropy, the best validation epoch's weights."""
    return baselines.fit_plain(split, lambda _: make_resnet(config), config.budget, seed)


class _Features(nn.Module):
    """A ResNet up to (not including) ``fc``: the pooled, flattened features."""

    def __init__(self, net: ResNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        n = self.net
        x = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        x = n.layer4(n.layer3(n.layer2(n.layer1(x))))
        return torch.flatten(n.avgpool(x), 1)


def as_sequential(net: ResNet) -> nn.Sequential:
    """``nn.Sequential(features, fc)`` sharing ``net``'s modules: the same function as ``net``.

    What the last-layer Laplace of :mod:`~lightning_dvi_benchmarks.baselines` takes (a
    sequential network that ends in an ``nn.Linear``).
    """
    return nn.Sequential(_Features(net), net.fc)


def _trained_net(base: Fitted) -> ResNet:
    if not isinstance(base.net, ResNet):
        raise ValueError("the post-hoc rows need the deterministic row's ResNet (base.net)")
    return base.net


def fit_temperature_row(split: ClassificationSplit, base: Fitted) -> Fitted:
    """Row ``temperature``: :math:`T` fitted on the validation NLL of the trained network."""
    start = time.process_time()
    t = fit_temperature(base.predict(split.x_val), split.y_val)
    seconds = time.process_time() - start
    return Fitted(
        lambda x: temper_probs(base.predict(x), t),
        seconds,
        base.best_epoch,
        details={"temperature": t},
    )


def fit_laplace(split: ClassificationSplit, base: Fitted, config: Config) -> Fitted:
    """Row ``laplace``: last-layer Laplace on ``fc`` (time: the fit only, not the training)."""
    net = as_sequential(_trained_net(base)).eval()
    trained = Fitted(base.predict, 0.0, base.best_epoch, net=net)
    return baselines.fit_last_layer_laplace(split, trained, config.laplace_precisions)


def fit_converted(
    split: ClassificationSplit,
    base: Fitted,
    config: Config,
    seed: int,
    convert: Callable[[ResNet], nn.Module],
    budget: Budget | None = None,
) -> Fitted:
    """A DVI row: ``convert`` a copy of the trained ResNet, train it with ``DVIClassifier``.

    One training per prior variance of ``config.dvi_prior_variances``, each by
    :func:`~lightning_dvi_benchmarks.classification.fit_dvi` (``config.dvi_budget``, the best
    validation epoch kept; ``budget`` overrides it); the variance with the lowest validation
    NLL is the row. Time: every conversion and training (the selection included), not the
    deterministic training.
    """
    budget = budget if budget is not None else config.dvi_budget
    fits = []
    for variance in config.dvi_prior_variances:
        start = time.process_time()
        net = convert(copy.deepcopy(_trained_net(base)))
        seconds = time.process_time() - start
        settings = {**dict(config.dvi_settings), "prior": "gaussian", "prior_variance": variance}
        row = Row("dvi", settings=settings)
        fitted = fit_dvi(split, budget, seed, row, config.mc_eval, net=net)
        fitted.train_seconds += seconds
        fits.append((baselines.nll(fitted.predict(split.x_val), split.y_val), variance, fitted))
    best_nll, variance, best = min(fits, key=lambda f: f[0])
    best.train_seconds = sum(f[2].train_seconds for f in fits)
    best.details.update(
        prior_variance=variance,
        val_nll=best_nll,
        val_nll_per_prior_variance={v: nll for nll, v, _ in fits},
    )
    return best


def fit_defaults(
    split: ClassificationSplit,
    base: Fitted,
    config: Config,
    seed: int,
    convert: Callable[[ResNet], nn.Module],
) -> Fitted:
    """A DVI row with :class:`~lightning_dvi.DVIClassifier`'s default arguments.

    No ``config.dvi_settings`` and no prior selection: the library's default ``kl_weight``,
    prior and mode; only the optimiser budget (``config.dvi_budget``: learning rate, batch,
    epochs, best validation epoch) is the tuned row's, so the two rows differ in the objective
    alone. Time: the conversion and the one training.
    """
    start = time.process_time()
    net = convert(copy.deepcopy(_trained_net(base)))
    seconds = time.process_time() - start
    fitted = fit_dvi(split, config.dvi_budget, seed, Row("dvi"), config.mc_eval, net=net)
    fitted.train_seconds += seconds
    return fitted


def _last_layers(k: int) -> Callable[[ResNet], nn.Module]:
    def convert(net: ResNet) -> nn.Module:
        from lightning_dvi.nn import from_torch

        return from_torch(net, last_layers=k)

    return convert


def _whole(net: ResNet) -> nn.Module:
    """The whole ResNet converted (torch.fx graph), BatchNorm on its running statistics.

    The converted BatchNorm layers keep the trained running statistics while the network
    fine-tunes (``freeze_statistics``): the rule for converted networks, so training and
    evaluation normalise alike.
    """
    from lightning_dvi.nn import BatchNorm1d, BatchNorm2d, from_torch

    converted = from_torch(net)
    for module in converted.modules():
        if isinstance(module, (BatchNorm1d, BatchNorm2d)):
            module.freeze_statistics = True
    return converted.train()


PostHoc = Callable[[ClassificationSplit, Fitted, Config, int], Fitted]
#: The rows after ``deterministic``: ``(split, trained row, config, seed) -> Fitted``.
ROWS: dict[str, PostHoc] = {
    "temperature": lambda split, base, config, seed: fit_temperature_row(split, base),
    "laplace": lambda split, base, config, seed: fit_laplace(split, base, config),
    "dvi_last1": lambda split, base, config, seed: fit_converted(
        split, base, config, seed, _last_layers(1)
    ),
    "dvi_last1_defaults": lambda split, base, config, seed: fit_defaults(
        split, base, config, seed, _last_layers(1)
    ),
    "dvi_last2": lambda split, base, config, seed: fit_converted(
        split, base, config, seed, _last_layers(2)
    ),
    "ddvi_whole": lambda split, base, config, seed: fit_converted(
        split, base, config, seed, _whole, config.whole_budget
    ),
}


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _line(name: str, seed: int, out: Mapping[str, Any]) -> str:
    return (
        f"[seed {seed}] {name:<14} acc {out['acc']:.4f}  nll {out['nll']:.4f}  "
        f"ece {out['ece']:.4f}  ood_auroc {out['ood_auroc']:.3f}  {out['train_s']:.1f} CPU s"
    )


def run(
    config: Config, progress: Callable[[str], None] = _progress
) -> dict[str, list[dict[str, Any]]]:
    """Every row of ``config`` for every seed: ``{row: [metrics per seed]}``.

    Raises:
        ValueError: for a row name that is neither ``deterministic`` nor in :data:`ROWS`.
    """
    rows = config.rows if config.rows is not None else ("deterministic", *ROWS)
    unknown = [r for r in rows if r != "deterministic" and r not in ROWS]
    if unknown:
        raise ValueError(
            f"unknown rows {unknown}; choose from {['deterministic', *ROWS]} (Config.rows)"
        )
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        # a frozen backbone is in eval mode on purpose; the other is Lightning's own deprecation
        warnings.filterwarnings("ignore", r".*module\(s\) in eval mode.*")
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")
        return _run(config, rows, progress)


def _run(
    config: Config, rows: Sequence[str], progress: Callable[[str], None]
) -> dict[str, list[dict[str, Any]]]:
    split = make_split(config)
    progress(f"{split.name}, ResNet-18 width {config.width}, seeds {list(config.seeds)}")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    for seed in config.seeds:
        base = fit_deterministic(split, config, seed)
        state = copy.deepcopy(base.net.state_dict()) if base.net is not None else None
        for name in rows:
            if name == "deterministic":
                fitted = base
            else:
                fitted = ROWS[name](split, base, config, seed)
                if state is not None and base.net is not None:
                    base.net.load_state_dict(state)  # a row must not change the next one's start
            out = evaluate(split, fitted, config.mc_eval)
            out["seed"] = seed
            results[name].append(out)
            progress(_line(name, seed, out))
    return results


def machine() -> dict[str, Any]:
    """CPU model, load average, torch version and threads: what the timings depend on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {
        "cpu": model,
        "loadavg": load,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def report(
    config: Config, results: Mapping[str, Sequence[Mapping[str, Any]]], seconds: float
) -> dict[str, Any]:
    """The JSON document: config, machine, per-seed runs and mean/std per metric."""
    return {
        "config": asdict(config),
        "machine": machine(),
        "cpu_seconds": seconds,
        "summary": {name: summarise(runs, COLUMNS) for name, runs in results.items()},
        "runs": {name: list(runs) for name, runs in results.items()},
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dvi_benchmarks.resnet_digits",
        description=__doc__.split("\n", 1)[0] if __doc__ else None,
    )
    parser.add_argument("--seeds", type=int, help="number of seeds 0, 1, ... (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny data, 2 epochs")
    parser.add_argument("--width", type=int, help="channels of the first stage (default 16)")
    parser.add_argument("--epochs", type=int, help="deterministic epochs (default 40)")
    parser.add_argument("--rows", help=f"comma-separated rows (default: all of {list(ROWS)})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line: run, print the markdown table, write JSON/markdown when asked."""
    args = _parser().parse_args(argv)
    config = Config.quick() if args.quick else Config()
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
        config = replace(config, seeds=tuple(range(args.seeds)))
    if args.width is not None:
        config = replace(config, width=args.width)
    if args.epochs is not None:
        config = replace(config, budget=replace(config.budget, epochs=args.epochs))
    if args.rows:
        config = replace(config, rows=tuple(r.strip() for r in args.rows.split(",")))
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        start = time.process_time()
        results = run(config)
        document = report(config, results, time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    table = markdown_table(results, COLUMNS)
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2, default=_jsonable) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")
    return document


def _jsonable(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    main()
