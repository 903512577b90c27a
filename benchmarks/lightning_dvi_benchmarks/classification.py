r"""The side-by-side classification benchmark: DVI rows next to plain, ensemble, dropout, Laplace.

A :class:`Row` names a method and its settings; :func:`run_row` trains it on a
:class:`~lightning_dvi_benchmarks.data.ClassificationSplit` under a
:class:`~lightning_dvi_benchmarks.data.Budget` with one seed and returns the test metrics
(accuracy, NLL, ECE with 15 bins, Brier score, AURC, the OOD AUROC of the predictive entropy
against feature-permuted test inputs and, for rows with samples, of the mutual information) and
the CPU seconds of training. :func:`summarise` turns runs over seeds into mean and standard
deviation and :func:`markdown_table` prints them. ``recipes/classification_benchmark.py`` is the
command-line front end.

Row kinds:

* ``"plain"``: a deterministic network (``weight_decay`` in the settings, default 0);
* ``"plain_tuned"``: the same with the weight decay chosen on the validation NLL;
* ``"ensemble"``: five plain networks (a deep ensemble);
* ``"mc_dropout"``: MC dropout with the rate chosen on the validation NLL;
* ``"laplace"``: last-layer Laplace on the weight-decay-tuned plain network;
* ``"dvi"``: :class:`~lightning_dvi.DVIClassifier`, every other setting passed to it as is
  (``{}``: the library's defaults), trained by ``lightning.Trainer``;
* ``"dvi_select"``: one ``"dvi"`` fit per candidate of ``settings["candidates"]`` (a sequence
  of ``DVIClassifier`` settings), each with, if ``settings["calibrate"]`` (default ``True``),
  a variant whose posterior standard deviations carry one factor fitted on the validation NLL
  (:func:`~lightning_dvi.nn.calibrate_scales`); the first candidate as trained is kept unless
  another variant beats its validation NLL by ``settings["z"]`` (default 2) paired standard
  errors
  (:func:`fit_dvi_selected`; time: all of them).

Architectures: ``"mlp"`` (``hidden`` widths) or ``"cnn"`` (:class:`lightning_dvi.nn.CNN` and its
plain twin; image inputs).
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from lightning_dvi.metrics import class_probability_samples, classification_summary, ece_noise_floor
from lightning_dvi.metrics.functional import reliability_bins

from . import baselines
from .baselines import Fitted
from .data import Budget, ClassificationSplit, plain_cnn, plain_mlp

__all__ = [
    "METRICS",
    "POOLED_METRICS",
    "Row",
    "evaluate",
    "fit_dvi",
    "fit_dvi_selected",
    "markdown_table",
    "run_row",
    "run_row_pooled",
    "summarise",
]

RowKind = Literal["plain", "plain_tuned", "ensemble", "mc_dropout", "laplace", "dvi", "dvi_select"]
#: Metrics of a run, in table order (``train_s``: CPU seconds of training).
METRICS = ("acc", "nll", "ece", "brier", "ood_auroc", "ood_auroc_mi", "train_s")
#: Metrics of a pooled run (:func:`run_row_pooled`), in table order.
POOLED_METRICS = ("acc", "nll", "ece", "ece_floor", "confidence", "brier", "ood_auroc", "train_s")


@dataclass(frozen=True)
class Row:
    """One benchmark row.

    Args:
        kind: the method (see the module docstring).
        arch: ``"mlp"`` or ``"cnn"``.
        hidden: hidden widths of the MLP (or of the CNN's dense head).
        settings: ``DVIClassifier`` arguments (``"dvi"``) or the baseline's options
            (``weight_decay``, ``members``, ``rates``, ...).
    """

    kind: RowKind
    arch: Literal["mlp", "cnn"] = "mlp"
    hidden: tuple[int, ...] = (100, 100)
    settings: Mapping[str, Any] = field(default_factory=dict)


class _History:
    """Lightning callback: every epoch's metrics; restores the best validation epoch's weights at fit end."""

    def __init__(self) -> None:
        from lightning.pytorch import Callback

        outer = self

        class _Callback(Callback):
            def on_validation_end(self, trainer: Any, module: Any) -> None:
                if trainer.sanity_checking:
                    return
                values = {k: float(v) for k, v in trainer.callback_metrics.items()}
                outer.epochs.append({"epoch": trainer.current_epoch, **values})
                value = values.get("val/nll", math.inf)
                if value < outer.best:
                    outer.best, outer.best_epoch = value, trainer.current_epoch
                    outer.state = copy.deepcopy(module.state_dict())

            def on_fit_end(self, trainer: Any, module: Any) -> None:
                # before the module's own on_fit_end (DVIClassifier's calibration)
                if outer.state is not None:
                    module.load_state_dict(outer.state)

        self.callback = _Callback()
        self.epochs: list[dict[str, float]] = []
        self.best, self.best_epoch = math.inf, -1
        self.state: dict[str, Tensor] | None = None


def fit_dvi(
    split: ClassificationSplit,
    budget: Budget,
    seed: int,
    row: Row = Row("dvi"),
    mc_eval: int = 64,
    net: nn.Module | None = None,
) -> Fitted:
    """:class:`~lightning_dvi.DVIClassifier` with ``row.settings``, trained by ``lightning.Trainer``.

    The learning rate comes from ``budget`` unless the settings give one. The shapes are read
    from the data at ``setup()``; ``details["history"]`` holds every epoch's logged metrics
    (the collapse diagnostics among them). MCVI rows predict with ``mc_eval`` weight samples.
    ``net``: a declared network to train (e.g. one made by ``from_torch`` from a trained
    network) instead of the one ``row.arch`` builds.
    """
    from lightning.pytorch import Trainer, seed_everything

    from lightning_dvi.lightning import DVIClassifier
    from lightning_dvi.nn import CNN

    seed_everything(seed, verbose=False)
    settings = {"lr": budget.lr, **row.settings}
    if net is not None:
        model = DVIClassifier(net=net, **settings)
    elif row.arch == "cnn":
        size = split.input_shape[-1]
        cnn = CNN(split.input_shape[0], split.num_classes, size, hidden=list(row.hidden))
        model = DVIClassifier(net=cnn, **settings)
    else:
        model = DVIClassifier(hidden=list(row.hidden), **settings)
    history = _History()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=budget.epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[history.callback],
    )  # fmt: skip
    loader = split.train_loader(budget.batch_size, seed)
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, loader, split.eval_loader("val"))
    seconds = time.process_time() - start  # training, and calibrate=True's calibration
    model.eval()
    if model.mode in ("sample", "local"):
        model.num_samples = mc_eval

    def samples(x: Tensor, count: int) -> Tensor:
        with torch.no_grad():
            return class_probability_samples(model(x), count)

    details = {"history": history.epochs, "settings": dict(row.settings)}
    return Fitted(model.predictive, seconds, history.best_epoch, samples, details, model)


def fit_dvi_selected(
    split: ClassificationSplit, budget: Budget, seed: int, row: Row, mc_eval: int = 64
) -> Fitted:
    r"""The ``"dvi_select"`` row: :func:`lightning_dvi.lightning.temperature.select_classifier`.

    Every candidate of ``row.settings["candidates"]`` (``DVIClassifier`` settings) is trained by
    :func:`fit_dvi` (its weights of the validation-best epoch, ``calibrate=False``), and the
    library's rule chooses on the validation rows among them and their post-hoc variants (a
    factor on the posterior standard deviations, a predictive temperature, both;
    ``row.settings["kinds"]``, default all three; ``calibrate=False``: none): the first
    candidate as trained is kept unless a variant beats its validation log-likelihood by
    ``row.settings["z"]`` (default 2) paired standard errors, and then the lowest validation
    NLL among those that do. The test rows are never seen by the choice.
    ``train_seconds``: every candidate's training and the calibration. ``details``: the kept
    candidate's index, settings, factor, temperature and kind; per variant its candidate,
    kind, factor, temperature, validation NLL, paired gain over the reference and that gain's
    standard error (``variants``), and, for analysis only, each variant's test accuracy, NLL
    and ECE (``variant_test``; the choice never reads them).

    Raises:
        ValueError: without candidates, or with settings other than ``candidates``,
            ``calibrate``, ``kinds`` and ``z``.
    """
    from lightning_dvi.lightning import DVIClassifier
    from lightning_dvi.lightning.temperature import DEFAULT_KINDS, select_classifier

    options = dict(row.settings)
    candidates = [dict(c) for c in options.pop("candidates", ())]
    kinds = tuple(options.pop("kinds", DEFAULT_KINDS))
    if not bool(options.pop("calibrate", True)):
        kinds = ()
    z = float(options.pop("z", 2.0))
    if not candidates or options:
        raise ValueError(
            "dvi_select needs settings {'candidates': [...], 'calibrate': bool, 'kinds': [...], "
            f"'z': float}}, got {row.settings!r}"
        )
    fits: list[Fitted] = []
    seconds = 0.0
    for settings in candidates:
        one = Row("dvi", row.arch, row.hidden, {**settings, "calibrate": False})
        fits.append(fit_dvi(split, budget, seed, one, mc_eval))
        seconds += fits[-1].train_seconds
    models = [cast(DVIClassifier, f.net) for f in fits]  # fit_dvi's model
    trained = [copy.deepcopy(m.state_dict()) for m in models]  # as trained, T = 1, no floor
    start = time.process_time()
    choice = select_classifier(models, split.x_val, split.y_val, z=z, kinds=kinds)
    seconds += time.process_time() - start
    kept = fits[choice.kept.candidate]
    kept_state = copy.deepcopy(models[choice.kept.candidate].state_dict())
    scored = _score_variants(split, models, trained, choice, z)
    models[choice.kept.candidate].load_state_dict(kept_state)
    kept.train_seconds = seconds
    kept.details = {
        **kept.details,
        "settings": dict(row.settings),
        "chosen": choice.kept.candidate,
        "chosen_settings": candidates[choice.kept.candidate],
        "chosen_kind": choice.kept.kind,
        "chosen_factor": choice.kept.scale,
        "chosen_temperature": choice.kept.temperature,
        "chosen_floor": choice.kept.floor,
        "variants": choice.as_dict()["variants"],
        **scored,
    }
    return kept


def _score_variants(
    split: ClassificationSplit,
    models: Sequence[Any],
    trained: Sequence[dict[str, Tensor]],
    choice: Any,
    z: float,
) -> dict[str, Any]:
    """Analysis of a :func:`fit_dvi_selected` choice (the choice never reads the test rows).

    ``variant_test``: every variant's test accuracy, NLL, ECE, ECE floor and confidence.
    ``own_choice``: per candidate, the index of the variant
    :func:`~lightning_dvi.lightning.temperature.calibrate_classifier` keeps for that candidate
    alone (the same gate against *its own* trained predictive), i.e. what
    ``DVIClassifier(**candidate)`` with ``calibrate=True`` ends with on the same fit.
    The models are left as trained.
    """
    from lightning_dvi.lightning.temperature import paired_choice
    from lightning_dvi.nn.posthoc import scale_posterior

    tests, val_lp = [], []
    target = split.y_val.long().unsqueeze(-1)
    for variant in choice.variants:
        model = models[variant.candidate]
        model.load_state_dict(trained[variant.candidate])
        if variant.scale != 1.0:
            scale_posterior(model.net, variant.scale)
        model.predictive_temperature.fill_(variant.temperature)
        model.predictive_floor.fill_(variant.floor)
        val = model.predictive(split.x_val).double()
        val_lp.append(val.gather(-1, target).squeeze(-1).clamp_min(1e-30).log())
        probs = model.predictive(split.x_test)
        summary = classification_summary(probs, split.y_test)
        tests.append(
            {"kind": variant.kind, "candidate": variant.candidate, "acc": summary["acc"],
             "nll": summary["nll"], "ece": summary["ece"], "ece_floor": ece_noise_floor(probs),
             "confidence": float(probs.max(-1).values.mean())}
        )  # fmt: skip
    for model, state in zip(models, trained, strict=True):
        model.load_state_dict(state)
    own = []
    for m in range(len(models)):
        indices = [v for v, variant in enumerate(choice.variants) if variant.candidate == m]
        kept, _ = paired_choice([val_lp[v] for v in indices], z)
        own.append(indices[kept])
    return {"variant_test": tests, "own_choice": own}


def _factory(row: Row, split: ClassificationSplit) -> Callable[[float], nn.Module]:
    """Builds the row's plain network for a dropout rate."""
    if row.arch == "cnn":
        return lambda p: plain_cnn(split.num_classes, hidden=row.hidden, dropout=p)
    width = math.prod(split.input_shape)
    return lambda p: plain_mlp(width, row.hidden, split.num_classes, dropout=p)


def fit_row(split: ClassificationSplit, row: Row, budget: Budget, seed: int) -> Fitted:
    """Train ``row`` once."""
    make, opts = _factory(row, split), dict(row.settings)
    if row.kind == "plain":
        return baselines.fit_plain(split, make, budget, seed, **opts)
    if row.kind == "plain_tuned":
        return baselines.fit_plain_tuned(split, make, budget, seed, **opts)
    if row.kind == "ensemble":
        return baselines.fit_ensemble(split, make, budget, seed, **opts)
    if row.kind == "mc_dropout":
        return baselines.fit_mc_dropout(split, make, budget, seed, **opts)
    if row.kind == "laplace":
        base = baselines.fit_plain_tuned(split, make, budget, seed)
        return baselines.fit_last_layer_laplace(split, base, **opts)
    if row.kind == "dvi":
        return fit_dvi(split, budget, seed, row)
    if row.kind == "dvi_select":
        return fit_dvi_selected(split, budget, seed, row)
    raise ValueError(f"unknown row kind {row.kind!r}")


def run_row(
    split: ClassificationSplit, row: Row, budget: Budget, seed: int, mc_eval: int = 64
) -> dict[str, Any]:
    """Train ``row`` with ``seed`` and return its test metrics, ``train_s`` and ``best_epoch``.

    Also ``confidence``, the mean top-class probability (above ``acc``: over-confident),
    ``ece_floor`` and ``reliability`` (:func:`evaluate`), the row's chosen hyper-parameters
    (``details``) and, for DVI rows, every epoch's logged validation metrics (``history``).
    """
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return evaluate(split, fit_row(split, row, budget, seed), mc_eval)


def evaluate(
    split: ClassificationSplit, fitted: Fitted, mc_eval: int = 64, ece_draws: int = 200
) -> dict[str, Any]:
    """The test metrics of a trained row (see :func:`run_row`), its ``train_s`` and ``best_epoch``.

    The OOD inputs are :meth:`~lightning_dvi_benchmarks.data.ClassificationSplit.ood_inputs`;
    rows with ``samples`` also get the mutual-information detector from ``mc_eval`` draws.
    Also ``ece_floor``, the 15-bin ECE a perfectly calibrated model with these predictions
    would score on these test rows (:func:`~lightning_dvi.metrics.ece_noise_floor`, from
    ``ece_draws`` label draws), and ``reliability``, the 15 reliability-diagram bins
    (:func:`~lightning_dvi.metrics.functional.reliability_bins`, as lists).
    """
    x, ood = split.x_test, split.ood_inputs()
    samples = ood_samples = None
    if fitted.samples is not None:
        samples, ood_samples = fitted.samples(x, mc_eval), fitted.samples(ood, mc_eval)
    probs = fitted.predict(x)
    out: dict[str, Any] = classification_summary(
        probs, split.y_test, fitted.predict(ood), samples, ood_samples
    )
    # the sign of the calibration gap: accuracy above confidence is under-confidence
    out["confidence"] = float(probs.max(-1).values.mean())
    out["ece_floor"] = ece_noise_floor(probs, draws=ece_draws)
    top = probs.max(-1)
    bins = reliability_bins(top.values, (top.indices == split.y_test).double(), 15)
    out["reliability"] = {k: v.tolist() for k, v in bins.items()}
    out.update(train_s=fitted.train_seconds, best_epoch=fitted.best_epoch)
    out["details"] = {k: v for k, v in fitted.details.items() if k != "history"}
    if "history" in fitted.details:
        out["history"] = fitted.details["history"]
    return out


def run_row_pooled(
    splits: Sequence[ClassificationSplit],
    row: Row,
    budget: Budget,
    seed: int,
    ece_draws: int = 200,
) -> dict[str, Any]:
    """Train ``row`` on every split and score the pooled test predictions as one test set.

    For splits whose test sets partition a data set
    (:func:`~lightning_dvi_benchmarks.data.digits_folds`), every row is scored once, by the
    model that did not train on it: accuracy, NLL, ECE, Brier score, AURC and the OOD AUROC of
    the predictive entropy over all the pooled rows (no mutual information: it needs samples
    of every fold's model on the same inputs), the mean ``confidence``, the ECE a perfectly
    calibrated model with these predictions would score on this many rows
    (``ece_floor``, :func:`~lightning_dvi.metrics.ece_noise_floor`), the summed CPU seconds of
    training (``train_s``) and every split's ``best_epoch``.

    Raises:
        ValueError: for no splits.
    """
    if not splits:
        raise ValueError("run_row_pooled needs at least one split")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    probs, ood_probs, targets, seconds, best = [], [], [], 0.0, []
    for split in splits:
        fitted = fit_row(split, row, budget, seed)
        probs.append(fitted.predict(split.x_test))
        ood_probs.append(fitted.predict(split.ood_inputs()))
        targets.append(split.y_test)
        seconds += fitted.train_seconds
        best.append(fitted.best_epoch)
    pooled = torch.cat(probs)
    out: dict[str, Any] = classification_summary(pooled, torch.cat(targets), torch.cat(ood_probs))
    out["confidence"] = float(pooled.max(-1).values.mean())
    out["ece_floor"] = ece_noise_floor(pooled, draws=ece_draws, seed=seed)
    out.update(train_s=seconds, best_epoch=best, rows=len(pooled))
    return out


def summarise(
    runs: Iterable[Mapping[str, Any]], keys: Sequence[str] = METRICS
) -> dict[str, tuple[float, float]]:
    """Mean and (population) standard deviation of each metric over runs (NaN where absent)."""
    runs = list(runs)
    out = {}
    for key in keys:
        values = torch.tensor([float(r.get(key, math.nan)) for r in runs], dtype=torch.float64)
        out[key] = (float(values.mean()), float(values.std(unbiased=False)))
    return out


def markdown_table(
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    keys: Sequence[str] = METRICS,
    *,
    label: str = "model",
    formats: Mapping[str, str] | None = None,
) -> str:
    """A markdown table of ``{row name: runs}``: one cell per metric, ``mean ± std`` by default.

    Args:
        results: runs per row name.
        keys: the metrics, one column each.
        label: the header of the first column.
        formats: per metric, a template over ``(mean, std)``; by default ``"{0:.3f} ± {1:.3f}"``,
            and train seconds as a mean, ``"{0:.1f}"``. Metrics absent from every run print "—".
    """
    templates = {"train_s": "{0:.1f}", **(formats or {})}
    lines = [f"| {label} | {' | '.join(keys)} |", "|" + "---|" * (len(keys) + 1)]
    for name, runs in results.items():
        stats = summarise(runs, keys)
        cells = [
            "—" if math.isnan(m) else templates.get(k, "{0:.3f} ± {1:.3f}").format(m, s)
            for k, (m, s) in stats.items()
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)
