r"""Transformers trained elsewhere, made Bayesian: ViT-tiny-shaped digits and a sequence task.

Two tasks, each with a small pre-norm transformer written in plain torch (patch or token
embedding, learned positions, ``nn.TransformerEncoderLayer`` blocks with GELU, a final
LayerNorm, mean pooling over tokens, a linear classifier):

* ``digits``: scikit-learn's 8x8 digits cut into 2x2 patches (16 tokens of 4 pixels, one
  global mean and std from the training rows), a ViT-tiny-shaped classifier over 9 classes;
  the held-out class (digit 9 by default, every one of its images) is the OOD set;
* ``sequence``: sequences of 12 tokens generated offline from a seeded generator, tokens drawn
  uniformly from 12 in-distribution symbols in three groups of four; the label is the group
  with the most tokens (sequences with a tie are redrawn), replaced by a uniformly drawn other
  label with probability ``label_noise`` (0.2: no classifier beats 0.8 accuracy in
  expectation); the OOD set is sequences whose every token is, with probability 1/2, one of 4
  symbols never seen in training.

Rows (every one after ``deterministic`` starts from a trained network):

* ``deterministic``: Adam on the cross-entropy, the weights of the best validation epoch;
* ``temperature``: :func:`~lightning_dvi.lightning.temperature.fit_temperature` on the
  validation rows;
* ``dvi_last1``: ``from_torch(net, last_layers=1)`` (frozen backbone, Bayesian classifier
  head at the trained weights), a short ELBO fit by :class:`~lightning_dvi.DVIClassifier`
  (``mode="diag"``, ``kl_weight=1``, a Gaussian prior);
* ``ddvi_whole``: the whole network converted by ``from_torch`` (attention, LayerNorm, GELU and
  every linear layer Bayesian, posterior means at the trained weights) and fine-tuned with
  ``mode="diag"`` (dDVI), the same objective;
* ``posthoc_det``: post-hoc DVI from the deterministic weights: the converted network with
  posterior scales set from a prior and one scale factor calibrated on the validation NLL, no
  training;
* ``posthoc_ivon``: post-hoc DVI from an IVON posterior: the same architecture trained by
  ``ivon.IVON`` (Shen et al., 2024), whose optimiser state holds a diagonal Gaussian
  posterior :math:`\mathcal N(m, \operatorname{diag}(1 / (\lambda(h + \delta))))` (effective
  sample size :math:`\lambda`, Hessian estimate :math:`h`, weight decay :math:`\delta`), handed
  to the converted network as it is; ``posthoc_ivon_cal`` the same with one scale factor
  calibrated on the validation NLL; ``posthoc_ivon_ln1`` the same posterior with every
  LayerNorm's first-order form (``layer_norm_route="first_order"``), and
  ``posthoc_ivon_fast`` with that and SUQ's attention rule (``attention_rule="mean"``), and
  ``posthoc_ivon_closed`` with those and GELU's closed form (``gelu_rule="closed"``): the
  cheap rule set of :func:`~lightning_dvi.nn.posthoc.set_rules`; ``posthoc_ivon_indep``
  adds SUQ's skip connections (``skip_rule="independent"``: skip and branch added as
  independent, no cross-covariance carried through the branches); ``posthoc_ivon_slope``
  adds GELU's slope rule (``gelu_rule="slope"``: the exact mean, the variance's term linear
  in the input variance, :func:`~lightning_dvi.moments.smooth.gelu_slope_diag`) and leaves
  the categorical predictive's multinomial-probit part out where that moves it by at most
  0.03 in total variation (``probit_tolerance=0.03`` of
  :func:`~lightning_dvi.likelihoods.predictive.categorical_predictive`), and
  ``posthoc_ivon_suq`` is SUQ's rule set throughout: those rules and the pairwise mean-field
  probit predictive (Lu, Ie & Sha 2020;
  :func:`~lightning_dvi.likelihoods.functional.categorical_mean_field_predictive`) in place
  of the library's;
* ``posthoc_ivon_suq_compiled`` and ``deterministic_compiled`` (:data:`COMPILED_ROWS`, run only
  when named): ``posthoc_ivon_suq``'s
  predictive (the moment pass and the mean-field predictive) and the deterministic network's
  forward pass and softmax, each run through ``torch.compile`` (inductor, ``dynamic=False``;
  the moment pass traces into one graph, ``tests/test_compile_predictive.py``). The same
  numbers as the eager rows to float rounding; ``train_s`` is the compilation's CPU time (this
  process; the shapes of the test, OOD and timing rows, one graph each; a later seed may hit
  inductor's cache), also in the details with its wall time;
* ``ivon_mean``: the IVON network at its posterior means, one torch forward pass and a softmax
  (no variance at all: what the posterior's uncertainty adds to the rows above);
* ``ivon_mc8``, ``ivon_mc32``: the Monte Carlo predictive of that same IVON posterior,
  :math:`\frac1S\sum_s\operatorname{softmax}f(x; w_s)`, :math:`w_s` drawn by IVON's own
  ``sampled_params``, with :math:`S = 8` and :math:`32`.

Columns: test accuracy, NLL, ECE (15 bins) and ``ece_floor``
(:func:`~lightning_dvi.metrics.ece_noise_floor`: the ECE a perfectly calibrated model with these
predictions would score on this many rows), the OOD AUROC of the predictive entropy (OOD rows
positive), ``cost``: the CPU time of one row's predictive on the whole test set divided by that
of the deterministic network's (one torch forward pass and a softmax), the median over
``timing_repeats`` interleaved repeats after a warm-up (``time.process_time``; run it with one
thread), and ``train_s``: CPU seconds of the row's own training (for the rows built on the
deterministic or IVON network, the work after that training: conversion, fit, calibration).

Usage::

    python -m lightning_dvi_benchmarks.transformer [--seeds 3] [--task digits|sequence|both]
        [--quick] [--json out.json] [--markdown out.md] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from lightning_dvi.lightning.temperature import fit_temperature, temper_probs
from lightning_dvi.metrics import classification_summary, ece_noise_floor

from . import baselines, classification
from .baselines import Fitted
from .classification import Row, fit_dvi, summarise
from .data import Budget, ClassificationSplit
from .resnet_digits import _jsonable, machine

__all__ = [
    "COLUMNS",
    "COMPILED_ROWS",
    "ROWS",
    "TASKS",
    "Config",
    "Task",
    "TinySequenceClassifier",
    "TinyViT",
    "digits_task",
    "main",
    "markdown_table",
    "patches",
    "run",
    "sequence_task",
]

TaskName = Literal["digits", "sequence"]
#: The tasks, in table order.
TASKS: tuple[TaskName, ...] = ("digits", "sequence")
#: Table columns (see the module docstring).
COLUMNS = ("acc", "nll", "ece", "ece_floor", "ood_auroc", "cost", "train_s")
#: The rows, in table order.
ROWS = (
    "deterministic",
    "temperature",
    "dvi_last1",
    "ddvi_whole",
    "posthoc_det",
    "posthoc_ivon",
    "posthoc_ivon_cal",
    "posthoc_ivon_ln1",
    "posthoc_ivon_fast",
    "posthoc_ivon_closed",
    "posthoc_ivon_indep",
    "posthoc_ivon_slope",
    "posthoc_ivon_suq",
    "ivon_mean",
    "ivon_mc8",
    "ivon_mc32",
)
#: Rows run only when named (``Config.rows``, ``--rows``): each compiles with inductor, tens of
#: CPU seconds per input shape.
COMPILED_ROWS = ("posthoc_ivon_suq_compiled", "deterministic_compiled")


@dataclass(frozen=True)
class Config:
    r"""Everything a run depends on (written into the JSON next to the results).

    Args:
        seeds: one run per seed (initialisation, batch order, IVON's draws; the data are fixed).
        tasks: the tasks to run.
        width: the transformer's width (model dimension).
        heads: attention heads.
        layers: encoder blocks.
        budget: the deterministic training (Adam; the best validation epoch kept).
        ivon_lr: IVON's learning rate (cosine-annealed to 0).
        ivon_hess_init: IVON's initial Hessian estimate :math:`h_0` (its initial posterior std
            is :math:`1/\sqrt{\lambda(h_0 + \delta)}`).
        ivon_weight_decay: IVON's :math:`\delta` (the prior precision is :math:`\lambda\delta`).
        ivon_epochs: IVON's epochs (batch size of ``budget``, the best validation epoch kept).
        last_budget: the last-layer DVI fit.
        whole_budget: the whole-network dDVI fine-tune.
        whole_rows: the whole-network fine-tune sees only this many training rows (its
            moment pass costs hundreds of forward passes; the KL is still divided by the full
            training-set size).
        whole_val_rows: the whole-network fine-tune validates (its best epoch, and
            ``DVIClassifier(calibrate=True)``'s calibration: a few dozen moment passes) on only
            the first this many validation rows (``None``: all), for a quick run.
        prior_variance: the Gaussian prior variance of the DVI rows and of ``posthoc_det``'s
            standard deviations before calibration.
        calibration_rows: validation rows the calibrated rows fit their factor on.
        calibration_bounds: the factor's search interval.
        calibration_tol: the golden-section tolerance on the log factor.
        mc_samples: the Monte Carlo rows' sample counts.
        timing_rows: test rows each predictive is timed on.
        timing_repeats: repeats of each predictive timing (the median is kept).
        num_train: keep only this many training rows (``None``: all), for a quick run.
        sequence_rows: ``(train, val, test, ood)`` sequences of the sequence task.
        label_noise: the sequence task's probability of a replaced label.
        held_out: the digit class that is never trained on (the digits task's OOD set).
        data_seed: seeds the data (the digits split, the sequence generator).
        eval_rows: keep only the first this many validation, test and OOD rows (``None``: all).
        rows: the rows to run, in table order (``None``: all of :data:`ROWS`).
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    tasks: tuple[TaskName, ...] = TASKS
    width: int = 16
    heads: int = 2
    layers: int = 1
    budget: Budget = field(default_factory=lambda: Budget(epochs=30, lr=3e-3, batch_size=64))
    ivon_lr: float = 0.3
    ivon_hess_init: float = 1.0
    ivon_weight_decay: float = 1e-4
    ivon_epochs: int = 30
    last_budget: Budget = field(default_factory=lambda: Budget(epochs=5, lr=1e-2, batch_size=64))
    whole_budget: Budget = field(default_factory=lambda: Budget(epochs=1, lr=1e-4, batch_size=64))
    whole_rows: int = 128
    whole_val_rows: int | None = None
    prior_variance: float = 0.1
    calibration_rows: int = 24
    calibration_bounds: tuple[float, float] = (0.01, 10.0)
    calibration_tol: float = 0.2
    mc_samples: tuple[int, ...] = (8, 32)
    timing_rows: int = 32
    timing_repeats: int = 3
    num_train: int | None = None
    sequence_rows: tuple[int, int, int, int] = (1500, 200, 300, 300)
    label_noise: float = 0.2
    held_out: int = 9
    data_seed: int = 0
    eval_rows: int | None = None
    rows: tuple[str, ...] | None = None

    @classmethod
    def quick(cls) -> Config:
        """A smoke test in seconds: 400 training rows, 32 validation and test rows, one seed."""
        return cls(
            seeds=(0,),
            budget=Budget(epochs=15, lr=1e-2, batch_size=64),
            ivon_epochs=40,
            ivon_lr=0.5,
            last_budget=Budget(epochs=1, lr=1e-2, batch_size=64),
            whole_rows=32,
            whole_val_rows=8,
            whole_budget=Budget(epochs=1, lr=1e-4, batch_size=32),
            calibration_rows=8,
            calibration_tol=0.5,
            timing_rows=4,
            timing_repeats=1,
            num_train=400,
            sequence_rows=(400, 32, 32, 32),
            eval_rows=32,
        )


# --------------------------------------------------------------------------- models


class _Encoder(nn.Module):
    """Learned positions, pre-norm encoder blocks with GELU, a final LayerNorm, mean pooling."""

    def __init__(self, tokens: int, width: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(0.02 * torch.randn(tokens, width))
        self.blocks = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    width, heads, 4 * width, dropout=0.0, activation="gelu",
                    batch_first=True, norm_first=True,
                )
                for _ in range(layers)
            )
        )  # fmt: skip
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)


class TinyViT(_Encoder):
    """ViT-tiny-shaped: patch vectors ``[B, tokens, patch_dim]`` to class logits ``[B, classes]``.

    Args:
        tokens: patches per image.
        patch_dim: values per patch.
        width: model dimension.
        heads: attention heads.
        layers: encoder blocks.
        classes: output classes.
    """

    def __init__(
        self, tokens: int, patch_dim: int, width: int, heads: int, layers: int, classes: int
    ) -> None:
        super().__init__(tokens, width, heads, layers, classes)
        self.patch_embed = nn.Linear(patch_dim, width)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits."""
        x = self.patch_embed(x) + self.pos_embed
        out: Tensor = self.head(self.norm(self.blocks(x)).mean(dim=1))
        return out


class TinySequenceClassifier(_Encoder):
    """Token ids ``[B, tokens]`` to class logits ``[B, classes]`` (an embedding table in front).

    Args:
        vocab: the number of symbols.
        tokens: sequence length.
        width: model dimension.
        heads: attention heads.
        layers: encoder blocks.
        classes: output classes.
    """

    def __init__(
        self, vocab: int, tokens: int, width: int, heads: int, layers: int, classes: int
    ) -> None:
        super().__init__(tokens, width, heads, layers, classes)
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids: Tensor) -> Tensor:
        """Class logits."""
        x = self.embed(ids) + self.pos_embed
        out: Tensor = self.head(self.norm(self.blocks(x)).mean(dim=1))
        return out


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Task:
    """One task: its split, its OOD inputs and its untrained network.

    Attributes:
        name: ``"digits"`` or ``"sequence"``.
        split: train, validation and test rows.
        ood: out-of-distribution inputs, in the layout of the test inputs.
        make_net: an untrained network (seed torch first).
    """

    name: str
    split: ClassificationSplit
    ood: Tensor
    make_net: Callable[[], nn.Module]


def patches(images: Tensor, size: int = 2) -> Tensor:
    """Square images ``[N, H, W]`` as ``[N, (H/size)(W/size), size²]`` patches, row-major.

    Examples:
        >>> patches(torch.arange(16.0).reshape(1, 4, 4))[0, 1]  # the second patch, top row
        tensor([2., 3., 6., 7.])
    """
    n, h, w = images.shape
    x = images.reshape(n, h // size, size, w // size, size).permute(0, 1, 3, 2, 4)
    return x.reshape(n, (h // size) * (w // size), size * size)


def digits_task(config: Config) -> Task:
    """Digits as 16 patches of 2x2 pixels, 9 classes; the held-out class is the OOD set.

    Stratified 70 / 10 / 20 per cent split of the other classes' 1617 rows (``data_seed``),
    one global mean and std from the training rows; labels above ``held_out`` shift down by one.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    inside = y != config.held_out
    x_in, y_in = x[inside], y[inside]
    y_in = np.where(y_in > config.held_out, y_in - 1, y_in)
    rows = np.arange(len(y_in))
    rest, test = train_test_split(rows, test_size=0.2, stratify=y_in, random_state=config.data_seed)
    train, val = train_test_split(
        rest, test_size=round(0.1 * len(y_in)), stratify=y_in[rest], random_state=config.data_seed
    )
    if config.num_train is not None and config.num_train < len(train):
        train, _ = train_test_split(
            train, train_size=config.num_train, stratify=y_in[train], random_state=config.data_seed
        )
    loc, scale = x_in[train].mean(), x_in[train].std()

    def inputs(values: np.ndarray) -> Tensor:
        images = torch.tensor((values - loc) / scale, dtype=torch.float32).reshape(-1, 8, 8)
        return patches(images)

    def labels(idx: np.ndarray) -> Tensor:
        return torch.tensor(y_in[idx], dtype=torch.long)

    parts = [np.sort(p) for p in (train, val, test)]
    name = f"digits 2x2 patches, class {config.held_out} held out ({'/'.join(str(len(p)) for p in parts)})"
    split = ClassificationSplit(
        name,
        inputs(x_in[parts[0]]),
        labels(parts[0]),
        inputs(x_in[parts[1]]),
        labels(parts[1]),
        inputs(x_in[parts[2]]),
        labels(parts[2]),
        9,
    )
    c = config

    def make() -> nn.Module:
        return TinyViT(16, 4, c.width, c.heads, c.layers, 9)

    return Task("digits", split, inputs(x[~inside]), make)


#: The sequence task's symbols: 12 in distribution (three groups of four), 4 only in the OOD set.
SEQUENCE_VOCAB, SEQUENCE_SYMBOLS, SEQUENCE_LENGTH, SEQUENCE_GROUPS = 16, 12, 12, 3


def _sequences(count: int, gen: torch.Generator, label_noise: float) -> tuple[Tensor, Tensor]:
    """``count`` in-distribution sequences without a tie and their (noisy) labels."""
    ids: list[Tensor] = []
    labels: list[Tensor] = []
    group = SEQUENCE_SYMBOLS // SEQUENCE_GROUPS
    while sum(int(i.shape[0]) for i in ids) < count:
        draw = torch.randint(0, SEQUENCE_SYMBOLS, (2 * count, SEQUENCE_LENGTH), generator=gen)
        counts = torch.stack([((draw // group) == g).sum(-1) for g in range(SEQUENCE_GROUPS)], -1)
        top = counts.topk(2, dim=-1).values
        keep = top[:, 0] > top[:, 1]
        ids.append(draw[keep])
        labels.append(counts[keep].argmax(-1))
    x, y = torch.cat(ids)[:count], torch.cat(labels)[:count]
    flip = torch.rand(count, generator=gen) < label_noise
    other = (y + torch.randint(1, SEQUENCE_GROUPS, (count,), generator=gen)) % SEQUENCE_GROUPS
    return x, torch.where(flip, other, y)


def sequence_task(config: Config) -> Task:
    """The generated sequence task (module docstring); the data depend on ``data_seed`` only."""
    gen = torch.Generator().manual_seed(config.data_seed)
    n_train, n_val, n_test, n_ood = config.sequence_rows
    if config.num_train is not None:
        n_train = min(n_train, config.num_train)
    x_tr, y_tr = _sequences(n_train, gen, config.label_noise)
    x_va, y_va = _sequences(n_val, gen, config.label_noise)
    x_te, y_te = _sequences(n_test, gen, config.label_noise)
    ood = torch.randint(0, SEQUENCE_SYMBOLS, (n_ood, SEQUENCE_LENGTH), generator=gen)
    unseen = torch.randint(SEQUENCE_SYMBOLS, SEQUENCE_VOCAB, ood.shape, generator=gen)
    ood = torch.where(torch.rand(ood.shape, generator=gen) < 0.5, unseen, ood)
    name = (
        f"sequences of {SEQUENCE_LENGTH} tokens, majority group of 3, label noise "
        f"{config.label_noise} ({n_train}/{n_val}/{n_test})"
    )
    split = ClassificationSplit(name, x_tr, y_tr, x_va, y_va, x_te, y_te, SEQUENCE_GROUPS)
    c = config

    def make() -> nn.Module:
        return TinySequenceClassifier(
            SEQUENCE_VOCAB, SEQUENCE_LENGTH, c.width, c.heads, c.layers, SEQUENCE_GROUPS
        )

    return Task("sequence", split, ood, make)


# --------------------------------------------------------------------------- IVON


@dataclass
class IVONFit:
    """A network trained by IVON and the optimiser that holds its posterior.

    Attributes:
        net: the network at the posterior means.
        optimizer: the ``ivon.IVON`` optimiser (its state: the Hessian estimate per parameter).
        seconds: CPU seconds of the training.
        best_epoch: the epoch whose means and state were kept.
    """

    net: nn.Module
    optimizer: Any
    seconds: float
    best_epoch: int


def fit_ivon(task: Task, config: Config, seed: int) -> IVONFit:
    r"""Train ``task``'s network by ``ivon.IVON`` (one weight draw per step, cosine learning rate).

    The effective sample size :math:`\lambda` is the number of training rows; the weights and
    optimiser state of the epoch with the lowest validation NLL of the 8-sample predictive
    are kept.
    """
    import ivon  # type: ignore[import-untyped]  # ivon-opt ships no type information

    split = task.split
    torch.manual_seed(seed)
    net = task.make_net()
    optimizer = ivon.IVON(
        net.parameters(),
        lr=config.ivon_lr,
        ess=float(split.num_train),
        hess_init=config.ivon_hess_init,
        weight_decay=config.ivon_weight_decay,
    )
    steps = config.ivon_epochs * math.ceil(split.num_train / config.budget.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    best, best_epoch, kept = math.inf, -1, None
    start = time.process_time()
    for epoch in range(config.ivon_epochs):
        net.train()
        for x, y in split.train_loader(config.budget.batch_size, seed + epoch):
            with optimizer.sampled_params(train=True):
                optimizer.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            schedule.step()
        net.eval()
        value = baselines.nll(ivon_mc_probs(net, optimizer, split.x_val, 8), split.y_val)
        if value < best:
            best, best_epoch = value, epoch
            kept = (copy.deepcopy(net.state_dict()), copy.deepcopy(optimizer.state_dict()))
    assert kept is not None
    net.load_state_dict(kept[0])
    optimizer.load_state_dict(kept[1])
    net.eval()
    return IVONFit(net, optimizer, time.process_time() - start, best_epoch)


@torch.no_grad()
def ivon_mc_probs(net: nn.Module, optimizer: Any, x: Tensor, samples: int) -> Tensor:
    r""":math:`\frac1S\sum_s\operatorname{softmax}f(x; w_s)`, :math:`w_s` from IVON's posterior."""
    total = torch.zeros(())
    for _ in range(samples):
        with optimizer.sampled_params():
            total = total + torch.softmax(net(x), dim=-1)
    return total / samples


# --------------------------------------------------------------------------- rows


def _convert(net: nn.Module, **kwargs: Any) -> nn.Module:
    from lightning_dvi.nn import from_torch

    converted: nn.Module = from_torch(copy.deepcopy(net), **kwargs)
    return converted


def _dvi_row(
    task: Task, net: nn.Module, budget: Budget, config: Config, seed: int, num_data: int
) -> Fitted:
    """``DVIClassifier(net=net)`` trained on the ELBO (diag, ``kl_weight=1``, Gaussian prior)."""
    settings = {
        "kl_weight": 1.0,
        "prior": "gaussian",
        "prior_variance": config.prior_variance,
        "num_data": num_data,
    }
    with warnings.catch_warnings():
        # a frozen backbone is in eval mode on purpose; the other is Lightning's own deprecation
        warnings.filterwarnings("ignore", r".*module\(s\) in eval mode.*")
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\).*")
        return fit_dvi(task.split, budget, seed, Row("dvi", settings=settings), net=net)


def fit_last_layer(task: Task, base: Fitted, config: Config, seed: int) -> Fitted:
    """Row ``dvi_last1``: the head Bayesian (``last_layers=1``), a short ELBO fit."""
    assert base.net is not None
    start = time.process_time()
    net = _convert(base.net, last_layers=1)
    seconds = time.process_time() - start
    fitted = _dvi_row(task, net, config.last_budget, config, seed, task.split.num_train)
    fitted.train_seconds += seconds
    return fitted


def fit_whole(task: Task, base: Fitted, config: Config, seed: int) -> Fitted:
    """Row ``ddvi_whole``: every layer converted, a dDVI fine-tune from the trained weights."""
    assert base.net is not None
    start = time.process_time()
    net = _convert(base.net).train()
    seconds = time.process_time() - start
    split = task.split
    rows = torch.randperm(split.num_train, generator=torch.Generator().manual_seed(seed))
    rows = rows[: config.whole_rows]
    few = replace(split, x_train=split.x_train[rows], y_train=split.y_train[rows])
    if config.whole_val_rows is not None:
        val = slice(0, config.whole_val_rows)
        few = replace(few, x_val=split.x_val[val], y_val=split.y_val[val])
    fitted = _dvi_row(replace(task, split=few), net, config.whole_budget, config, seed, len(rows))
    fitted.details["rows"] = len(rows)
    fitted.train_seconds += seconds
    return fitted


def fit_temperature_row(task: Task, base: Fitted) -> Fitted:
    """Row ``temperature``: :math:`T` fitted on the validation NLL of the trained network."""
    start = time.process_time()
    t = fit_temperature(base.predict(task.split.x_val), task.split.y_val)
    return Fitted(
        lambda x: temper_probs(base.predict(x), t),
        time.process_time() - start,
        base.best_epoch,
        details={"temperature": t},
    )


#: The categorical predictives a one-pass row may choose (:data:`PREDICTIVES`): the library's
#: (:func:`~lightning_dvi.likelihoods.predictive.categorical_predictive`), the same with its
#: multinomial-probit part left out where that moves the result by at most 0.03 in total
#: variation, and the pairwise mean-field probit form (Lu, Ie & Sha 2020).
PredictiveName = Literal["library", "probit_tolerance_0.03", "mean_field"]


def categorical_from_moments(name: PredictiveName) -> Callable[[Tensor, Tensor], Tensor]:
    """The categorical predictive ``(logit mean, logit var) -> probabilities`` called ``name``."""
    from lightning_dvi.likelihoods.functional import categorical_mean_field_predictive
    from lightning_dvi.likelihoods.predictive import categorical_predictive

    if name == "library":
        return categorical_predictive
    if name == "probit_tolerance_0.03":
        return lambda mean, var: categorical_predictive(mean, var, probit_tolerance=0.03)
    if name == "mean_field":
        return categorical_mean_field_predictive
    raise ValueError(f"unknown predictive {name!r}")


def moment_probs(
    net: nn.Module, predictive: PredictiveName = "library", compile: bool = False
) -> Callable[[Tensor], Tensor]:
    """The one-pass predictive of a declared network: diag moments, then a categorical predictive.

    The weight moments are taken once, here (:func:`lightning_dvi.nn.posterior.frozen_moments`:
    the posterior is fixed from now on), not on every call. ``predictive``: see
    :func:`categorical_from_moments`. ``compile``: run the moment pass and the predictive
    through ``torch.compile`` instead (one graph per input shape; the compiled graph computes
    the weight moments itself, fused with their first use).
    """
    from lightning_dvi.nn.posterior import frozen_moments

    frozen = frozen_moments(net)
    categorical = categorical_from_moments(predictive)
    if compile:

        def body(x: Tensor) -> Tensor:
            out = net(x, mode="diag")
            return categorical(out.mean, out.var)

        return _no_grad(torch.compile(body, dynamic=False))

    def predict(x: Tensor) -> Tensor:
        with torch.no_grad(), frozen:
            out = net(x, mode="diag")
            return categorical(out.mean, out.var)

    return predict


def _no_grad(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def predict(x: Tensor) -> Tensor:
        with torch.no_grad():
            return fn(x)

    return predict


def compiled_row(
    predict: Callable[[Tensor], Tensor], shapes_of: Sequence[Tensor], net: nn.Module | None
) -> Fitted:
    """A compiled predictive, compiled now on every input in ``shapes_of`` (one graph each).

    ``train_seconds`` is the compilation's CPU time in this process (``time.process_time``;
    inductor's compile workers, if any, are not counted), ``details["compile_wall_s"]`` its
    wall time.
    """
    cpu, wall = time.process_time(), time.perf_counter()
    for x in shapes_of:
        predict(x)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    details = {"compile_cpu_s": cpu, "compile_wall_s": wall, "graphs": len(shapes_of)}
    return Fitted(predict, cpu, 0, details=details, net=net)


def _calibrated(
    net: nn.Module, task: Task, config: Config, seconds: float, details: dict[str, Any]
) -> Fitted:
    """``net``'s one-pass predictive after one network-wide scale factor fitted on validation NLL."""
    from lightning_dvi.likelihoods import Categorical
    from lightning_dvi.nn import posthoc

    split = task.split
    start = time.process_time()
    rows = slice(0, config.calibration_rows)
    result = posthoc.calibrate_scales(
        net,
        Categorical(split.num_classes),
        split.x_val[rows],
        split.y_val[rows],
        bounds=config.calibration_bounds,
        tol=config.calibration_tol,
    )
    details = {**details, "factor": result.factor, "val_nll_before": result.nll_before,
               "val_nll_after": result.nll_after, "evaluations": result.evaluations}  # fmt: skip
    seconds += time.process_time() - start
    return Fitted(moment_probs(net), seconds, -1, details=details, net=net)


def fit_posthoc_deterministic(task: Task, base: Fitted, config: Config) -> Fitted:
    """Row ``posthoc_det``: the deterministic weights as means, stds from the prior, calibrated."""
    from lightning_dvi.nn import posthoc

    assert base.net is not None
    start = time.process_time()
    std = posthoc.prior_std(base.net, variance=config.prior_variance)
    net = posthoc.from_torch_posterior(base.net, std).eval()
    details = {"prior_variance": config.prior_variance}
    return _calibrated(net, task, config, time.process_time() - start, details)


#: The moment rules of the rows that set them (:func:`lightning_dvi.nn.posthoc.set_rules`).
RULES: dict[str, dict[str, str]] = {
    "posthoc_ivon_ln1": {"layer_norm_route": "first_order"},
    "posthoc_ivon_fast": {"layer_norm_route": "first_order", "attention_rule": "mean"},
    "posthoc_ivon_closed": {
        "layer_norm_route": "first_order",
        "attention_rule": "mean",
        "gelu_rule": "closed",
    },
    "posthoc_ivon_indep": {
        "layer_norm_route": "first_order",
        "attention_rule": "mean",
        "gelu_rule": "closed",
        "skip_rule": "independent",
    },
    "posthoc_ivon_slope": {
        "layer_norm_route": "first_order",
        "attention_rule": "mean",
        "gelu_rule": "slope",
        "skip_rule": "independent",
    },
    "posthoc_ivon_suq": {
        "layer_norm_route": "first_order",
        "attention_rule": "mean",
        "gelu_rule": "slope",
        "skip_rule": "independent",
    },
}
#: The categorical predictive of the rows that do not take the library's.
PREDICTIVES: dict[str, PredictiveName] = {
    "posthoc_ivon_slope": "probit_tolerance_0.03",
    "posthoc_ivon_suq": "mean_field",
}


def ivon_posterior(fit: IVONFit, **rules: Any) -> nn.Module:
    """The converted network with IVON's posterior: means its weights, stds from its state.

    ``rules``: ``attention_rule``/``layer_norm_route``/``gelu_rule`` of
    :func:`~lightning_dvi.nn.posthoc.from_torch_posterior` (default: the library's).
    """
    from lightning_dvi.nn import posthoc

    std = posthoc.ivon_std(fit.optimizer, fit.net)
    return posthoc.from_torch_posterior(fit.net, std, **rules).eval()


def fit_posthoc_ivon_rules(fit: IVONFit, row: str) -> Fitted:
    """Rows ``posthoc_ivon_ln1`` … ``_suq``: IVON's stds as they are, cheaper rules (:data:`RULES`).

    The rows in :data:`PREDICTIVES` also choose their categorical predictive.
    """
    start = time.process_time()
    net = ivon_posterior(fit, **RULES[row])
    seconds = time.process_time() - start
    predictive = PREDICTIVES.get(row, "library")
    details = {**RULES[row], "predictive": predictive}
    return Fitted(moment_probs(net, predictive), seconds, fit.best_epoch, net=net, details=details)


def fit_posthoc_ivon(task: Task, fit: IVONFit, config: Config, calibrate: bool) -> Fitted:
    """Rows ``posthoc_ivon`` (IVON's stds as they are) and ``posthoc_ivon_cal`` (one factor fitted)."""
    start = time.process_time()
    net = ivon_posterior(fit)
    seconds = time.process_time() - start
    if calibrate:
        return _calibrated(net, task, config, seconds, {})
    return Fitted(moment_probs(net), seconds, fit.best_epoch, net=net)


def ivon_mean_row(fit: IVONFit) -> Fitted:
    """Row ``ivon_mean``: the IVON network at its posterior means (one torch forward pass)."""
    net = fit.net

    def predict(x: Tensor) -> Tensor:
        with torch.no_grad():
            return torch.softmax(net(x), dim=-1)

    return Fitted(predict, 0.0, fit.best_epoch, net=net)


def ivon_mc_row(task: Task, fit: IVONFit, samples: int) -> Fitted:
    """Rows ``ivon_mc8``/``ivon_mc32``: Monte Carlo over the same posterior as ``posthoc_ivon``.

    :func:`lightning_dvi.nn.posthoc.monte_carlo_predictive`: ``samples`` whole-weight draws of
    the converted network's posterior (the parameters that hold one: every linear, attention
    and embedding weight; IVON's own ``sampled_params`` would also draw the LayerNorm gains and
    the positional table, which the converted network keeps as point values).
    """
    from lightning_dvi.likelihoods import Categorical
    from lightning_dvi.nn import posthoc

    net = ivon_posterior(fit)
    likelihood = Categorical(task.split.num_classes)

    def predict(x: Tensor) -> Tensor:
        probs = posthoc.monte_carlo_predictive(net, likelihood, x, samples)
        assert isinstance(probs, Tensor)
        return probs

    return Fitted(predict, 0.0, fit.best_epoch, details={"samples": samples})


# --------------------------------------------------------------------------- evaluation


def evaluate(task: Task, fitted: Fitted, ece_draws: int = 200) -> dict[str, Any]:
    """Test accuracy, NLL, ECE, its noise floor, the OOD AUROC of the predictive entropy, ``train_s``."""
    split = task.split
    probs = fitted.predict(split.x_test)
    out: dict[str, Any] = classification_summary(probs, split.y_test, fitted.predict(task.ood))
    out["ece_floor"] = ece_noise_floor(probs, draws=ece_draws)
    out["confidence"] = float(probs.max(-1).values.mean())
    out["train_s"] = fitted.train_seconds
    out["details"] = dict(fitted.details)
    return out


def predictive_costs(
    predicts: Mapping[str, Callable[[Tensor], Tensor]], x: Tensor, base: str, repeats: int
) -> dict[str, float]:
    """CPU time of each predictive on ``x`` over that of ``predicts[base]`` (medians of repeats).

    One warm-up call each, then ``repeats`` rounds that time every predictive once in turn (so
    a slow phase of a shared machine touches every row alike), each timed call right after an
    untimed call of the same predictive; ``time.process_time``. Without that call a row runs
    in the caches the previous row left: the first row of a round (the deterministic
    reference) then measured 1.25-1.5x slower than the same torch forward pass timed later in
    the round (``ivon_mean`` at 0.64-0.72x of ``deterministic`` at ``f517cff``), which flattered
    every ratio.
    """
    times: dict[str, list[float]] = {name: [] for name in predicts}
    for fn in predicts.values():
        fn(x)
    for _ in range(max(repeats, 1)):
        for name, fn in predicts.items():
            fn(x)  # warm: the timed call does not pay for the previous row's cache footprint
            start = time.process_time()
            fn(x)
            times[name].append(time.process_time() - start)
    reference = statistics.median(times[base])
    return {name: statistics.median(t) / reference for name, t in times.items()}


def module_times(
    net: nn.Module, x: Tensor, mode: str = "diag", repeats: int = 5
) -> dict[str, float]:
    """CPU milliseconds per module of a declared network's moment pass (medians of ``repeats``).

    Every module's ``propagate`` and ``propagate_cross`` are timed while the network runs on
    ``x`` (``time.process_time``, inclusive of the children they call); keys are
    ``"<module name> (<class>)"`` and ``"<module name> (<class>) cross"``, and ``"total"`` for the
    whole pass under ``torch.no_grad``. One warm-up pass first. The instance attributes that
    wrap the methods are removed afterwards.
    """
    from lightning_dvi.nn import BayesModule

    runs: dict[str, list[float]] = {}
    current: dict[str, float] = {}

    def timed(key: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                current[key] = current.get(key, 0.0) + time.process_time() - start

        return call

    wrapped: list[BayesModule] = []
    for name, module in net.named_modules():
        if isinstance(module, BayesModule) and module is not net:
            label = f"{name} ({type(module).__name__})"
            module.propagate = timed(label, module.propagate)  # type: ignore[method-assign]  # timing wrapper, removed below
            module.propagate_cross = timed(f"{label} cross", module.propagate_cross)  # type: ignore[method-assign]  # as above
            wrapped.append(module)
    try:
        with torch.no_grad():
            net(x, mode=mode)
            for _ in range(max(repeats, 1)):
                current.clear()
                start = time.process_time()
                net(x, mode=mode)
                current["total"] = time.process_time() - start
                for key, value in current.items():
                    runs.setdefault(key, []).append(value)
    finally:
        for module in wrapped:
            del module.propagate, module.propagate_cross
    return {key: 1e3 * statistics.median(values) for key, values in runs.items()}


def torch_forward_ms(net: nn.Module, x: Tensor, repeats: int = 5) -> float:
    """CPU milliseconds of ``net(x)`` and a softmax under ``torch.no_grad`` (median, one warm-up)."""
    times = []
    with torch.no_grad():
        torch.softmax(net(x), -1)
        for _ in range(max(repeats, 1)):
            start = time.process_time()
            torch.softmax(net(x), -1)
            times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def module_report(
    config: Config, task_name: TaskName = "digits", seed: int = 0, repeats: int = 5
) -> dict[str, Any]:
    """Per-module CPU ms of the IVON posterior's diag moment pass under each rule set.

    Trains ``task_name``'s network by IVON (``seed``), converts it with the library's rules
    (``posthoc_ivon``) and with those of :data:`RULES`, and times every module
    (:func:`module_times`) on ``config.timing_rows`` test rows, against the torch network's
    forward pass on the same rows (:func:`torch_forward_ms`).

    Returns:
        ``{"forward_ms": float, "rules": {row: {module: ms}}}``.
    """
    task = _task(task_name, config)
    fit = fit_ivon(task, config, seed)
    x = task.split.x_test[: config.timing_rows]
    out: dict[str, Any] = {"forward_ms": torch_forward_ms(fit.net, x, repeats), "rules": {}}
    for row, rules in {"posthoc_ivon": {}, **RULES}.items():
        out["rules"][row] = module_times(ivon_posterior(fit, **rules), x, repeats=repeats)
    return out


def module_table(report: Mapping[str, Any], min_ms: float = 0.2) -> str:
    """:func:`module_report` as a markdown table: CPU ms and multiples of the torch forward pass.

    Modules below ``min_ms`` under every rule set are left out (the total keeps them).
    """
    rules: Mapping[str, Mapping[str, float]] = report["rules"]
    forward = float(report["forward_ms"])
    names = list(next(iter(rules.values())))
    keep = [
        n for n in names if n == "total" or max(r.get(n, 0.0) for r in rules.values()) >= min_ms
    ]
    keep = [n for n in keep if n != "total"] + ["total"]
    head = " | ".join(f"{row} ms (x fwd)" for row in rules)
    lines = [f"| module | {head} |", "|" + "---|" * (len(rules) + 1)]
    for name in keep:
        cells = []
        for r in rules.values():
            ms = r.get(name, 0.0)
            cells.append(f"{ms:.1f} ({ms / forward:.1f})")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines.append(f"| torch forward pass | {forward:.2f} ms |" + " |" * (len(rules) - 1))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _line(task: str, name: str, seed: int, out: Mapping[str, Any]) -> str:
    return (
        f"[{task} seed {seed}] {name:<17} acc {out['acc']:.4f}  nll {out['nll']:.4f}  "
        f"ece {out['ece']:.4f}  floor {out['ece_floor']:.4f}  ood {out['ood_auroc']:.3f}  "
        f"cost {out['cost']:.2f}x  "
        f"{out['train_s']:.1f} CPU s"
    )


def _task(name: str, config: Config) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {list(TASKS)}")
    task = digits_task(config) if name == "digits" else sequence_task(config)
    if config.eval_rows is None:
        return task
    rows, split = slice(0, config.eval_rows), task.split
    split = replace(
        split,
        x_val=split.x_val[rows],
        y_val=split.y_val[rows],
        x_test=split.x_test[rows],
        y_test=split.y_test[rows],
    )
    return replace(task, split=split, ood=task.ood[rows])


def run_seed(
    task: Task, config: Config, seed: int, rows: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Every row of one task and seed: ``{row: metrics}`` (costs measured together at the end)."""
    split = task.split
    base = baselines.fit_plain(split, lambda _: task.make_net(), config.budget, seed)
    fitted: dict[str, Fitted] = {"deterministic": base}
    wanted = set(rows)
    x = split.x_test[: config.timing_rows]
    shapes = (split.x_test, task.ood, x)  # every input a compiled row sees: one graph each
    if "temperature" in wanted:
        fitted["temperature"] = fit_temperature_row(task, base)
    if "dvi_last1" in wanted:
        fitted["dvi_last1"] = fit_last_layer(task, base, config, seed)
    if "ddvi_whole" in wanted:
        fitted["ddvi_whole"] = fit_whole(task, base, config, seed)
    if "posthoc_det" in wanted:
        fitted["posthoc_det"] = fit_posthoc_deterministic(task, base, config)
    ivon_rows = {
        "posthoc_ivon",
        "posthoc_ivon_cal",
        "ivon_mean",
        "posthoc_ivon_suq_compiled",
        *RULES,
    }
    if wanted & {*ivon_rows, *(f"ivon_mc{s}" for s in config.mc_samples)}:
        ivon_fit = fit_ivon(task, config, seed)
        if "posthoc_ivon" in wanted:
            fitted["posthoc_ivon"] = fit_posthoc_ivon(task, ivon_fit, config, calibrate=False)
        if "posthoc_ivon_cal" in wanted:
            fitted["posthoc_ivon_cal"] = fit_posthoc_ivon(task, ivon_fit, config, calibrate=True)
        for row in RULES:
            if row in wanted:
                fitted[row] = fit_posthoc_ivon_rules(ivon_fit, row)
        if "posthoc_ivon_suq_compiled" in wanted:
            suq = fitted.get("posthoc_ivon_suq") or fit_posthoc_ivon_rules(
                ivon_fit, "posthoc_ivon_suq"
            )
            assert suq.net is not None
            predict = moment_probs(suq.net, PREDICTIVES["posthoc_ivon_suq"], compile=True)
            fitted["posthoc_ivon_suq_compiled"] = compiled_row(predict, shapes, suq.net)
        if "ivon_mean" in wanted:
            fitted["ivon_mean"] = ivon_mean_row(ivon_fit)
        for samples in config.mc_samples:
            if f"ivon_mc{samples}" in wanted:
                fitted[f"ivon_mc{samples}"] = ivon_mc_row(task, ivon_fit, samples)
    if "deterministic_compiled" in wanted:
        net = base.net
        assert net is not None
        torch_pass = torch.compile(lambda x: torch.softmax(net(x), -1), dynamic=False)
        fitted["deterministic_compiled"] = compiled_row(_no_grad(torch_pass), shapes, net)
    out = {name: evaluate(task, fitted[name]) for name in rows if name in fitted}
    predicts = {name: fitted[name].predict for name in out}
    costs = predictive_costs(predicts, x, "deterministic", config.timing_repeats)
    for name, metrics in out.items():
        metrics.update(cost=costs[name], seed=seed)
    return out


def run(
    config: Config, progress: Callable[[str], None] = _progress
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every task, row and seed of ``config``: ``{task: {row: [metrics per seed]}}``.

    Raises:
        ValueError: for an unknown task or row.
    """
    rows = config.rows if config.rows is not None else ROWS
    known = set(ROWS) | set(COMPILED_ROWS) | {f"ivon_mc{s}" for s in config.mc_samples}
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {sorted(known)} (Config.rows)")
    if "deterministic" not in rows:
        rows = ("deterministic", *rows)  # every cost is relative to it
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in config.tasks:
        task = _task(name, config)
        progress(f"{task.split.name}; OOD: {len(task.ood)} rows; seeds {list(config.seeds)}")
        results[name] = {row: [] for row in rows}
        for seed in config.seeds:
            for row, metrics in run_seed(task, config, seed, rows).items():
                results[name][row].append(metrics)
                progress(_line(name, row, seed, metrics))
    return results


def markdown_table(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], keys: Sequence[str] = COLUMNS
) -> str:
    """``{row: runs}`` as a markdown table: mean ± std per column (cost and seconds as means ± std)."""
    formats = {"train_s": "{0:.1f} ± {1:.1f}", "cost": "{0:.2f} ± {1:.2f}"}
    return classification.markdown_table(runs, keys, label="row", formats=formats)


def acceptance(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], row: str = "posthoc_ivon"
) -> dict[str, Any]:
    """Issue 42's acceptance on one task: ``row`` against ``ivon_mc32`` (means over seeds).

    NLL and ECE at most those of the 32-sample Monte Carlo predictive of the same posterior,
    and a predictive cost at most 3 deterministic forward passes.
    """
    mine, mc = summarise(runs[row], COLUMNS), summarise(runs["ivon_mc32"], COLUMNS)
    checks = {
        "nll": (mine["nll"][0], mc["nll"][0], mine["nll"][0] <= mc["nll"][0]),
        "ece": (mine["ece"][0], mc["ece"][0], mine["ece"][0] <= mc["ece"][0]),
        "cost": (mine["cost"][0], 3.0, mine["cost"][0] <= 3.0),
    }
    return {
        "row": row,
        "checks": {k: {"value": v, "bound": b, "met": bool(m)} for k, (v, b, m) in checks.items()},
        "met": all(m for _, _, m in checks.values()),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dvi_benchmarks.transformer",
        description=__doc__.split("\n", 1)[0] if __doc__ else None,
    )
    parser.add_argument("--seeds", type=int, help="number of seeds 0, 1, ... (default 3, quick 1)")
    parser.add_argument("--task", choices=(*TASKS, "both"), default="both", help="default both")
    parser.add_argument("--quick", action="store_true", help="smoke test: small data, few epochs")
    parser.add_argument(
        "--rows",
        help=f"comma-separated rows (default: all of {list(ROWS)}; also {list(COMPILED_ROWS)})",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--module-times",
        action="store_true",
        help="instead of the table: per-module CPU ms of the IVON posterior's moment pass "
        "under each rule set (first task, seed 0)",
    )
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` of parsed command-line arguments."""
    config = Config.quick() if args.quick else Config()
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
        config = replace(config, seeds=tuple(range(args.seeds)))
    if args.task != "both":
        config = replace(config, tasks=(args.task,))
    if args.rows:
        config = replace(config, rows=tuple(r.strip() for r in args.rows.split(",")))
    return config


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line: run, print one table per task and the acceptance, write JSON/markdown."""
    args = _parser().parse_args(argv)
    config = config_from_args(args)
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.module_times:
        try:
            report = module_report(config, config.tasks[0], config.seeds[0])
            report["machine"] = machine()
        finally:
            torch.set_num_threads(threads)
        print(module_table(report))
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
        return report
    try:
        start = time.process_time()
        results = run(config)
        seconds = time.process_time() - start
        document: dict[str, Any] = {
            "config": asdict(config),
            "machine": machine(),
            "cpu_seconds": seconds,
        }
    finally:
        torch.set_num_threads(threads)
    document["summary"] = {
        task: {row: summarise(runs, COLUMNS) for row, runs in rows.items()}
        for task, rows in results.items()
    }
    document["runs"] = results
    text: list[str] = []
    verdicts: dict[str, Any] = {}
    for task, rows in results.items():
        text += [f"### {task}", "", markdown_table(rows), ""]
        judged = [
            r
            for r in ("posthoc_ivon", "posthoc_ivon_cal", *RULES, "posthoc_ivon_suq_compiled")
            if r in rows
        ]
        if judged and "ivon_mc32" in rows:
            verdicts[task] = {row: acceptance(rows, row) for row in judged}
    if verdicts:
        document["acceptance"] = verdicts
    print("\n".join(text))
    if verdicts:
        print(json.dumps(verdicts, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2, default=_jsonable) + "\n")
    if args.markdown is not None:
        args.markdown.write_text("\n".join(text))
    return document


if __name__ == "__main__":
    main()
